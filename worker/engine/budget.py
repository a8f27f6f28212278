"""How much one engine step may hold: the token budget and how prompts are cut into chunks.

Prompt tokens one step may prefill, besides its decode rows, bound the step's latency for the sessions
that are decoding. A prompt is cut into chunks of at most PREFILL_CHUNK tokens counted from the session's
own start, never by what else is in the step, so a session computes the same chunks (and the same
numbers) alone or batched with others.
"""

from __future__ import annotations

CPU_STEP_TOKENS = 256
GPU_STEP_TOKENS = 2048  # also the rows of the largest prefill graph (worker.engine.graphs)
PREFILL_CHUNK = {"cpu": 256, "cuda": 512}

# Positions a session's slot is backed ahead of its next rows when pages allow (cuda_state.table): its next page is
# mapped this many tokens before the first token that needs it, between steps.
AHEAD_TOKENS = 16
