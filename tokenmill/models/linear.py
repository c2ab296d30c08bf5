"""Linear layers whose CPU weights are laid out once for oneDNN (and, for decode-sized batches, once more for
tokenmill's small-M kernel; where that kernel also serves prefill chunks, AMX-BF16 CPUs in bf16, its layout is
the only copy: `one_layout`).

On the CPU, F.linear calls MKL's sgemm, which runs far below the machine for the few-row matmuls of decoding,
and worse still on non-Intel CPUs. On the 2-core AVX2 EPYC we develop on, an 8x576 @ 576x3456 float32 linear
took 1.53 ms with F.linear and 0.44 ms with oneDNN and a weight reordered ahead of time (256 rows: 12.9 ms and
8.3 ms). The packed weight replaces the dense one, so memory does not double."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.quantization import quant_linear


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


# On a CPU without native bf16 (no AVX512-BF16 or AMX: oneDNN refuses bf16 there), torch's bf16 matmul is
# emulated, and from a few dozen rows on it is faster to convert both operands to float32, multiply there and
# round the output to bf16 (the same products, summed in float32 as bf16 GEMMs sum). Measured on the 2-core AVX2
# EPYC (Zen 3), ms bf16 / via float32: 32x576 @ 576x3072 6.9/3.2, 512 rows 98/18; 576 -> 49152 (the lm_head)
# 114/108 at 32 rows, 2012/468 at 512, but 27/92 at 8, where converting its 28M weights dominates.
BF16_VIA_FLOAT32_MIN_ROWS = 32


def linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    if packed is not None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    if (x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.numel() >= BF16_VIA_FLOAT32_MIN_ROWS * x.shape[-1]
            and not onednn_linear_supported(torch.bfloat16)):
        return F.linear(x.float(), weight.float(), None if bias is None else bias.float()).to(torch.bfloat16)
    return F.linear(x, weight, bias)


# Up to this many rows, tokenmill's small-M kernel (tokenmill/kernels) beats oneDNN: the weights of a decode
# step stream from memory once. Measured on the 2-core EPYC (Zen 4, AVX512-BF16), SmolLM2's 121 bf16 weights
# (269 MB) in one pass, 2 threads: 8.9 vs 14.9 ms at 1 row, 9.8 vs 13.6 at 4, 13.2 vs 15.3 at 8, 19.9 vs 18.9 at 16.
SMALL_M_MAX_ROWS = 8


def one_layout(ops, small: torch.Tensor | None, in_features: int) -> bool:
    """Whether the small-M layout can be a weight's only copy: where the kernel's default path for prefill chunks
    serves them from it as fast as oneDNN, as measured (benchmarks/results/one-copy.md): bf16 on AMX-BF16 (K in
    steps of 32), float32 on the blocked GEMM (the AVX2 build's default; gemm_small_m.cpp kF32Default). Elsewhere
    the oneDNN layout stays for prefill chunks."""
    if small is None:
        return False
    if small.dtype == torch.bfloat16:
        return in_features % 32 == 0 and ops.small_m_large_path(torch.bfloat16) == "amx_bf16"
    return ops.small_m_large_path(torch.float32) == "f32_gemm"


def unpack_small_m(small: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The dense [out, in] weight back from pack_small_m's layout."""
    if small.dtype == torch.bfloat16:  # [N/16, K/2, 16, 2]
        dense = small.permute(0, 2, 1, 3).reshape(-1, in_features)
    else:  # [N/VL, K, VL]
        dense = small.permute(0, 2, 1).reshape(-1, in_features)
    return dense[:out_features].contiguous()


def pack_small_m(ops, weight: torch.Tensor | None, packed: torch.Tensor | None) -> torch.Tensor | None:
    """The small-M kernel's layout of a weight (from the dense or the oneDNN form), or None where it cannot serve."""
    dense = weight if weight is not None else (packed.to_dense() if packed is not None else None)
    if ops is None or dense is None or dense.device.type != "cpu" or not ops.small_m_supported(dense.dtype):
        return None
    if dense.dtype == torch.bfloat16 and dense.shape[1] % 2:
        return None
    return ops.pack_small_m(dense.detach().contiguous())


# A weight kept quantized (tokenmill/models/quantization.py) always calls the quantized kernel, which picks its
# own path by rows (integer dot products for decode-sized batches, dequantize + oneDNN for prefill chunks; the
# measured threshold is in quant_linear.cpp); a W8A8 weight (`--quantization w8a8`) calls w8a8.cpp's kernel at
# every row count: int8 dot products pay off for prefill chunks (compute) and decode batches (a byte per weight).
# No dense copy is kept.


class Linear(nn.Linear):
    packed: torch.Tensor | None = None  # oneDNN's layout
    small_m: torch.Tensor | None = None  # the small-M kernel's layout, when the CPU kernels run
    ops = None
    quant = None  # a QuantizedWeight replacing weight, when the weight is kept quantized
    quant_ops = None  # the CPU kernels that serve it
    lora = None  # a LoRALinear (tokenmill/lora/layers.py) with --enable-lora: adds each token's adapter delta

    def set_quantized(self, weight, ops) -> None:
        self.quant, self.quant_ops, self.weight = weight, ops, None

    def fused_weights(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """What llama_forward's layer_linear takes: (oneDNN layout, small-M layout), or (qweight, meta)."""
        return (self.quant.qweight, self.quant.meta) if self.quant is not None else (self.packed, self.small_m)

    def pack(self) -> None:
        if self.quant is not None:
            return
        self.packed = pack_weight(self.weight)
        if self.packed is not None:
            self.weight = None

    def use_cpu_kernels(self, ops) -> None:
        """Lays the weight out for the small-M kernel (ops), dropping the oneDNN copy where that layout serves every
        row count (one_layout); None: back to one layout that torch serves, the small-M copy dropped."""
        if ops is None:
            if self.small_m is not None and self.packed is None and self.weight is None:  # the only copy
                dense = unpack_small_m(self.small_m, self.out_features, self.in_features)
                self.packed = pack_weight(dense)
                if self.packed is None:
                    self.weight = nn.Parameter(dense, requires_grad=False)
            self.ops, self.small_m = None, None
            return
        self.ops = ops
        if self.small_m is None and self.quant is None:
            self.small_m = pack_small_m(ops, self.weight, self.packed)
        if self.packed is not None and one_layout(ops, self.small_m, self.in_features):
            self.packed = None

    @property
    def single_copy(self) -> bool:
        """The small-M layout is this weight's only copy."""
        return self.small_m is not None and self.packed is None and self.weight is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_forward(x)
        return out if self.lora is None else self.lora.add_delta(x, out)

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            return quant_linear(self.quant_ops, x, self.quant, self.bias)
        if self.small_m is not None and x.dim() == 2 and (x.shape[0] <= SMALL_M_MAX_ROWS or self.single_copy):
            return self.ops.small_m_linear(x, self.small_m, self.bias, self.out_features)
        return linear(x, self.weight, self.bias, self.packed)


def _second_copies(model: nn.Module) -> list[torch.Tensor]:
    """The small-M layouts held beside another copy of the same weight (oneDNN's or the dense one)."""
    return [m.small_m for m in model.modules() if isinstance(m, Linear) and m.small_m is not None
            and not m.single_copy]


def has_second_copies(model: nn.Module) -> bool:
    """Whether some linear weight of the model is held twice (oneDNN's and the small-M layout): what sleep level 1
    can free without losing the weights."""
    return bool(_second_copies(model))


def second_copy_bytes(model: nn.Module) -> int:
    """What sleep level 1 frees of the weights (use_cpu_kernels(None), only where has_second_copies): the linears'
    second copies and the tied lm_head's layout beside the embedding (with one copy, that layout stays too)."""
    copies = _second_copies(model)
    head = getattr(model, "tied_lm_head_small_m", None)
    if copies and head is not None:
        copies.append(head)
    return sum(t.untyped_storage().nbytes() for t in copies)
