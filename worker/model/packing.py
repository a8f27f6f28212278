"""A model's weights in one block of device memory, filled tensor by tensor as the loader reads them.

The block is laid out from the config alone (every tensor's shape is known before any is read), allocated once
on the device in the model's dtype, and each source tensor is converted and copied into its place as it arrives:
weights stream from the file to the device, and the host holds one tensor at a time, never the model. Products
that the model fuses (q|k|v, gate|up) take their source tensors as row ranges of one place.

With norm folding (worker.model.llama.Layer), a product's rows are multiplied by their norm's weight in fp32
before the cast, from the source's own precision, exactly as `(w.float() * g.float()).to(dtype)`; a product that
arrives before its norm waits (in its source dtype, on the device) until the norm comes.

Allocated one by one on the GPU, the ~200 tensors of a small model left the caching allocator's 20 MiB segments
part empty (SmolLM2-135M: 280 MiB reserved for 257 MiB of weights); one block costs its size rounded to 2 MiB.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch

from worker.model.config import ModelLoadError

WEIGHT_DTYPES = frozenset({torch.float64, torch.float32, torch.bfloat16, torch.float16})  # what a stored weight may be
PACK_ALIGN = 512  # bytes: every packed tensor starts at a multiple (cuBLAS and Triton want 16 at least)


@dataclass(frozen=True)
class Place:
    """Where a source tensor goes: rows [start, stop) of packed tensor `target` (all rows: None), transposed or not;
    `fold`: the name of the norm whose weight multiplies it."""

    target: str
    start: int | None = None
    stop: int | None = None
    transposed: bool = False
    fold: str | None = None


class Pack:
    """Declare every packed tensor (`add`), allocate them in one block (`allocate`), then `fill` them."""

    def __init__(self) -> None:
        self._shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        self.views: dict[str, torch.Tensor] = {}
        self._places: dict[str, Place] = {}
        self._ones: set[str] = set()  # packed norms left at ones (their weight folded into products)
        self._filled: set[str] = set()  # source names written

    def add(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
        self._shapes[name] = (shape, dtype)

    def route(self, source: str, place: Place) -> None:
        """Source tensor `source` goes to `place`."""
        self._places[source] = place

    def folded(self, norm: str) -> None:
        """Packed norm `norm` is folded into its products: it holds ones."""
        self._ones.add(norm)

    def allocate(self, device: torch.device) -> dict[str, torch.Tensor]:
        """One block for every declared tensor: name -> view."""
        offsets: list[tuple[str, int, int]] = []
        total = 0
        for name, (shape, dtype) in self._shapes.items():
            nbytes = int(torch.Size(shape).numel()) * torch.empty((), dtype=dtype).element_size()
            offsets.append((name, total, nbytes))
            total += -(-nbytes // PACK_ALIGN) * PACK_ALIGN
        flat = torch.empty(total, dtype=torch.uint8, device=device)
        for name, offset, nbytes in offsets:
            shape, dtype = self._shapes[name]
            self.views[name] = flat[offset : offset + nbytes].view(dtype).view(shape)
        for name in self._ones:
            self.views[name].fill_(1)
        return self.views

    def fill(self, tensors: Iterable[tuple[str, torch.Tensor]], where: str) -> dict[str, torch.Tensor]:
        """Copy each source tensor to its place (converting it to the pack's dtype on the device). Returns the source
        tensors with no place in the pack (the caller's: e.g. GGUF's rope_freqs). Raises ModelLoadError for a
        tensor of the wrong shape, a repeated one, or one missing at the end."""
        norms: dict[str, torch.Tensor] = {}  # folded norms' source weights, fp32 on the device
        waiting: dict[str, list[tuple[str, torch.Tensor]]] = {}  # norm -> products that arrived before it
        extra: dict[str, torch.Tensor] = {}
        folded_norms = {p.fold for p in self._places.values() if p.fold is not None}
        for name, tensor in tensors:
            if name in self._filled or name in norms:
                raise ModelLoadError(f"{where}: tensor {name} appears twice")
            if name in folded_norms:
                self._check_norm(name, tensor, where)
                norm = norms[name] = tensor.to(self._device).float()
                self._filled.add(name)
                for product, held in waiting.pop(name, []):
                    self._write(product, held, norm)
                continue
            place = self._places.get(name)
            if place is None:
                extra[name] = tensor
                continue
            if place.fold is not None and place.fold not in norms:
                waiting.setdefault(place.fold, []).append((name, tensor.to(self._device)))
                continue
            self._write(name, tensor, None if place.fold is None else norms[place.fold])
        missing = sorted(set(self._places) - self._filled) + sorted(n for n in folded_norms if n not in norms)
        if missing:
            shown = ", ".join(missing[:8]) + (" ..." if len(missing) > 8 else "")
            raise ModelLoadError(f"{where}: tensors missing: {shown}")
        return extra

    @property
    def _device(self) -> torch.device:
        return next(iter(self.views.values())).device

    def _dest(self, place: Place) -> torch.Tensor:
        view = self.views[place.target]
        if place.transposed:
            view = view.t()
        return view if place.start is None else view[place.start : place.stop]

    def _check_norm(self, name: str, tensor: torch.Tensor, where: str) -> None:
        for place in self._places.values():
            if place.fold == name:
                cols = self.views[place.target].shape[-1]
                if tuple(tensor.shape) != (cols,):
                    raise ModelLoadError(f"{where}: tensor {name} has shape {tuple(tensor.shape)}, expected ({cols},)")
                return

    def _write(self, name: str, tensor: torch.Tensor, norm: torch.Tensor | None) -> None:
        place = self._places[name]
        dest = self._dest(place)
        if tuple(tensor.shape) != tuple(dest.shape):
            raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
        if tensor.dtype not in WEIGHT_DTYPES:  # an integer, boolean, complex or fp8 tensor is not cast as if it were one
            raise ModelLoadError(f"tensor {name} is {tensor.dtype}: weights are floating point here "
                                 "(quantized checkpoints are not read)")
        if norm is None:
            dest.copy_(tensor)
        else:
            dest.copy_(tensor.to(dest.device).float() * norm)
        self._filled.add(name)
