"""The pieces every model family shares: a weight matrix (and its bias), RMSNorm and rotary position embedding
(its tables: worker.model.rope)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


class Linear:
    """A weight (out, in), or stored transposed as (in, out) contiguous, and an optional bias (out,); views of the
    model's packed weights (worker.model.packing).

    The CPU keeps the vocabulary head transposed: a one-row product then streams it in order
    (measured on a 2-core machine here: 5.4 ms against 11.3 ms for the 49152x576 head, and about
    even at 8 rows). The layers' smaller weights multiply as fast or faster as (out, in).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, transposed: bool = False) -> None:
        if transposed and bias is not None:
            raise ValueError("a transposed weight takes no bias")
        self.weight = weight
        self.bias = bias
        self.transposed = transposed
        self.in_features, self.out_features = weight.shape if transposed else weight.shape[::-1]

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.transposed:
            return x @ self.weight
        if self.bias is not None and x.is_cuda:
            # The product rounded to the dtype, then the bias, as the decode steps' row products do it; cuBLASLt's
            # bias epilogue would also want more workspace than the worker gives cuBLAS (worker.engine.workspace).
            return self.add_bias(F.linear(x, self.weight))
        return F.linear(x, self.weight, self.bias)  # on the CPU as transformers computes it

    def add_bias(self, y: torch.Tensor) -> torch.Tensor:
        """y (rows, out) from a product of the weight alone, with the bias added (y itself when there is none)."""
        return y if self.bias is None else y.add_(self.bias)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows `ids` of the (out, in) weight: an embedding lookup through a tied head."""
        return self.weight[:, ids].t() if self.transposed else self.weight[ids]

    @property
    def nbytes(self) -> int:
        extra = 0 if self.bias is None else self.bias.numel() * self.bias.element_size()
        return self.weight.numel() * self.weight.element_size() + extra


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: (T, heads, hd); cos/sin: (T, hd)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos[:, None, :] + rotated.float() * sin[:, None, :]).to(x.dtype)
