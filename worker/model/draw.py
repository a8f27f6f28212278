"""Seeded random tensors for the `random:` presets (worker.model.loader), drawn one at a time as the model reads them."""

from __future__ import annotations

import torch


class Draw:
    """Tensors from one generator on one device: products normal(0, 0.02), norms ones or zeros, uniform ranges."""

    def __init__(self, seed: int, device: torch.device) -> None:
        self.device = device
        self.gen = torch.Generator(device=device).manual_seed(seed)

    def normal(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=self.gen, device=self.device).mul_(0.02)

    def uniform(self, low: float, high: float, *shape: int) -> torch.Tensor:
        return torch.rand(*shape, generator=self.gen, device=self.device).mul_(high - low).add_(low)

    def ones(self, n: int) -> torch.Tensor:
        return torch.ones(n, device=self.device)

    def zeros(self, n: int) -> torch.Tensor:
        return torch.zeros(n, device=self.device)
