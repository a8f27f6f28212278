"""The tiles of a prefill step's attention: runs of a prompt chunk's consecutive rows (host side, numpy only).

worker.kernels.prefill serves each tile with one program per query head, loading every K/V block once
for the tile's rows; a tile never crosses a chunk, so its rows share a slot. The GPU executor writes a
step's tiles into the prefill graphs' static inputs: TILE_ROWS and the grid (max_tiles) are fixed.
"""

from __future__ import annotations

import numpy as np

# Rows of one chunk per program. H100 sweep of the kernel (4 warps, 64-key blocks, Triton's 3 pipeline stages) over
# worker.bench.prefill's scenarios, 30 layers' attention: 128-row tiles with 8 warps took 1.1-1.6x the time of
# 64-row ones, 32-row and 16-row tiles (2 stages) 1.2-2.1x and 1.5-2.2x; 2 stages for 64-row tiles won only on one
# 2,048-row chunk at 2,048-4,095 keys (2.19 against 2.41 ms) and lost 1.66x on a 128-row chunk at 1,800 keys.
TILE_ROWS = 64


def max_tiles(rows: int, chunks: int) -> int:
    """Tiles that `rows` rows cut into at most `chunks` chunks and one run of padding rows can need: each of the
    chunks + 1 runs adds at most one partial tile to the rows' whole ones, ceil(rows / TILE_ROWS) + chunks."""
    return min(rows, -(-rows // TILE_ROWS) + chunks)


def prefill_tiles(starts: list[int], counts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """(first row, rows) of each tile of the chunks at rows starts[i] .. starts[i] + counts[i] - 1, in order."""
    firsts: list[np.ndarray] = []
    ends: list[np.ndarray] = []
    for start, n in zip(starts, counts, strict=True):
        if n > 0:
            firsts.append(np.arange(start, start + n, TILE_ROWS, dtype=np.int64))
            ends.append(np.full(len(firsts[-1]), start + n, dtype=np.int64))
    if not firsts:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    first = np.concatenate(firsts)
    return first, np.minimum(np.concatenate(ends) - first, TILE_ROWS)
