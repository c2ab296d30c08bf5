"""Linear layers whose CPU weights are laid out once for oneDNN.

On the CPU, F.linear calls MKL's sgemm, which runs far below the machine for the few-row matmuls of decoding,
and worse still on non-Intel CPUs. On the 2-core AVX2 EPYC we develop on, an 8x576 @ 576x3456 float32 linear
took 1.53 ms with F.linear and 0.44 ms with oneDNN and a weight reordered ahead of time (256 rows: 12.9 ms and
8.3 ms). The packed weight replaces the dense one, so memory does not double."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def onednn_linear_supported(dtype: torch.dtype) -> bool:
    """Whether this CPU has a oneDNN inner product for dtype (bf16 needs AVX512-BF16 or AMX)."""
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        weight = torch.ops.mkldnn._reorder_linear_weight(torch.ones(8, 8, dtype=dtype))
        torch.ops.mkldnn._linear_pointwise(torch.ones(2, 8, dtype=dtype), weight, None, "none", [], "")
        return True
    except RuntimeError:
        return False


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """The oneDNN layout of a [out, in] CPU weight, or None where oneDNN cannot serve it."""
    if weight.device.type != "cpu" or not onednn_linear_supported(weight.dtype):
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    packed: torch.Tensor | None = None

    def pack(self) -> None:
        self.packed = pack_weight(self.weight)
        if self.packed is not None:
            self.weight = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)
