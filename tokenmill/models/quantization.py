"""Weights kept quantized (`--quantization`): the block formats, the kernel's packed layout, and quantization at load.

Decoding at small batch reads every weight once per step, so a 4-bit weight streams in a quarter of bf16's time.
Two block formats (32 weights of one output row per block) cover everything served quantized:
- 4-bit with a min, w = d q + m, q in 0..15: GGUF Q4_1, GGUF Q4_0 (w = d (q - 8), i.e. m = -8d), and `int4`
  (group-wise, group 32, a float model quantized at load);
- 8-bit, w = d q + m, q in -128..127: GGUF Q8_0 (symmetric: m = 0) and `int8` (per block of 32, a float model
  at load; asymmetric, 256 levels from the block's min to its max: teacher-forced top-1 agreement of the default
  model with its float32 weights is 0.996, against 0.961 for symmetric blocks of 32 (0.969 with float32 scales,
  0.965 with blocks of 16; issue 15 asks 0.98). That model's weights are themselves on a Q4_1 grid, which the
  min-max grid nearly contains, so a float model gains less than that; it still has twice symmetric's levels).
d and m are float16, as GGUF stores them, so a GGUF tensor is repacked without any rounding. The kernels
(tokenmill/kernels/csrc/quant_linear.cpp) read the layout that `pack` makes, documented there.

`w8a8` quantizes the activations too (W8A8Weight): int8 weights per output channel, each token's activations
quantized to int8 at run time (a scale per 64 K) by the kernel (tokenmill/kernels/csrc/w8a8.cpp), int32 dot
products. Those are what makes a prefill faster (integer dot products do 2-4 times the float multiply-adds per
instruction), where the formats above only shrink the weight stream of decoding. The embedding and the lm_head
stay dense.

Where the kernels cannot run (TOKENMILL_CPU_ISA=none, CUDA, float16), a quantized flag the user chose (int8, int4,
w8a8, gguf) fails the start-up, and `--quantization none` serves dense weights. `auto`, the default, means "quantized
where the kernels serve it": there it dequantizes the GGUF at load and says so in the log, so that the default
model starts on a GPU."""
from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

logger = logging.getLogger("tokenmill.quantization")

BLOCK = 32  # weights per block (one scale, one min)
GROUP = 16  # outputs per packed group: one 64-byte vector holds 16 outputs x 4 K
QUANTIZATIONS = ("auto", "none", "gguf", "int8", "int4", "w8a8")
LOAD_TIME = ("int8", "int4", "w8a8")  # quantized at load from a dense (or dequantized GGUF) weight
GGUF_KEPT_TYPES = ("Q4_0", "Q4_1", "Q8_0")  # GGUF types served quantized; others are dequantized at load


@dataclass
class QuantizedTensor:
    """A weight's rows in block form, as read from a file or quantized, before packing: the loader yields these,
    and a row reorder (Llama's q/k un-permutation) or a row concatenation (fused qkv, gate_up) works on them."""
    kind: str  # "q4" | "q8"
    q: torch.Tensor  # [N, K]: uint8 0..15 (q4) or int8 (q8)
    d: torch.Tensor  # [N, K/32] float16
    m: torch.Tensor | None  # [N, K/32] float16 (None: zero)
    source: str  # what it came from, for the log: "Q4_1", "Q8_0", "int8", ...

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.q.shape)

    def dequantize(self) -> torch.Tensor:
        n, k = self.q.shape
        w = self.q.float().view(n, k // BLOCK, BLOCK) * self.d.float().unsqueeze(-1)
        if self.m is not None:
            w = w + self.m.float().unsqueeze(-1)
        return w.view(n, k)

    def rows(self, order: torch.Tensor) -> QuantizedTensor:
        return QuantizedTensor(self.kind, self.q[order], self.d[order], None if self.m is None else self.m[order],
                               self.source)

    @staticmethod
    def cat(parts: list[QuantizedTensor]) -> QuantizedTensor:
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        sources = sorted({p.source for p in parts})
        return QuantizedTensor(parts[0].kind, torch.cat([p.q for p in parts]), torch.cat([p.d for p in parts]), m,
                               "+".join(sources))


def from_gguf(data: np.ndarray, type_name: str, shape: tuple[int, int]) -> QuantizedTensor:
    """A GGUF Q4_0/Q4_1/Q8_0 tensor's raw bytes ([N, bytes per row]) in block form (no rounding: the same values)."""
    n, k = shape
    raw = np.ascontiguousarray(data).reshape(n, k // BLOCK, -1)
    d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16).reshape(n, k // BLOCK))
    if type_name == "Q8_0":  # d, then 32 int8
        q = torch.from_numpy(raw[..., 2:34].copy().view(np.int8).reshape(n, k))
        return QuantizedTensor("q8", q, d, None, type_name)
    if type_name == "Q4_1":  # d, m, then 16 bytes: element j in the low nibble of byte j, element 16 + j high
        m, qs = torch.from_numpy(raw[..., 2:4].copy().view(np.float16).reshape(n, k // BLOCK)), raw[..., 4:20]
    elif type_name == "Q4_0":  # d, then the nibbles of q, w = d (q - 8)
        m, qs = -8 * d, raw[..., 2:18]
    else:
        raise ValueError(f"GGUF type {type_name} is not served quantized")
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).reshape(n, k)
    return QuantizedTensor("q4", torch.from_numpy(q), d, m, type_name)


def quantize(weight: torch.Tensor, kind: str) -> QuantizedTensor:
    """Weight-only quantization of a float [N, K] weight (K a multiple of 32), scale and min per block of 32:
    `int8` (w = d q + m, q in -128..127) or `int4` (w = d q + m, q in 0..15, the Q4_1 form)."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // BLOCK, BLOCK)
    if kind == "int8":
        lo, hi = w.amin(-1), w.amax(-1)
        d = ((hi - lo) / 255).half()
        m = (lo + 128 * d.float()).half()  # the value of q = 0: q = -128 is the block's min
        inv = torch.where(d > 0, 1 / d.float(), torch.zeros(()))
        q = torch.round((w - m.float().unsqueeze(-1)) * inv.unsqueeze(-1)).clamp(-128, 127).to(torch.int8)
        return QuantizedTensor("q8", q.view(n, k), d, m, kind)
    if kind == "int4":
        lo, hi = w.amin(-1), w.amax(-1)
        d, m = ((hi - lo) / 15).half(), lo.half()
        inv = torch.where(d > 0, 1 / d.float(), torch.zeros(()))
        q = torch.round((w - m.float().unsqueeze(-1)) * inv.unsqueeze(-1)).clamp(0, 15).to(torch.uint8)
        return QuantizedTensor("q4", q.view(n, k), d, m, kind)
    raise ValueError(f"unknown weight quantization {kind!r}")


class QuantizedWeight:
    """A weight in the kernel's layout: qweight [N/16, K/32, 4 (q4) or 8 (q8), 16, 4] uint8 and meta
    [N/16, K/32, 2, 16] int16 (d, then m, as float16 bits)."""

    def __init__(self, t: QuantizedTensor):
        n, k = t.shape
        if k % BLOCK:
            raise ValueError(f"a quantized weight needs K divisible by {BLOCK}, got {k}")
        self.kind, self.source, self.out_features, self.in_features = t.kind, t.source, n, k
        groups, blocks = -(-n // GROUP), k // BLOCK
        pad = groups * GROUP - n

        def padded(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x, x.new_zeros(pad, *x.shape[1:])]) if pad else x

        q = padded(t.q).view(groups, GROUP, blocks, 8, 4).permute(0, 2, 3, 1, 4)  # [G, B, 8 (K/4), 16, 4]
        first = padded(t.d).view(torch.int16)
        if t.kind == "q4":
            q = q.to(torch.uint8)
            self.qweight = (q[:, :, :4] | (q[:, :, 4:] << 4)).contiguous()
        else:
            self.qweight = q.contiguous().view(torch.uint8)
        second = torch.zeros_like(first) if t.m is None else padded(t.m).view(torch.int16)
        self.meta = torch.stack([first, second], 1).view(groups, GROUP, 2, blocks).permute(0, 3, 2, 1).contiguous()

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.meta.nbytes

    def dequantize_rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Rows ids of the float32 weight (an embedding lookup reads only these)."""
        g, r = ids // GROUP, ids % GROUP
        quants = self.qweight[g, :, :, r, :]  # [*ids.shape, K/32, 4 or 8, 4]
        if self.kind == "q4":
            quants = torch.cat([quants & 0x0F, quants >> 4], dim=-2)
        else:
            quants = quants.view(torch.int8)
        meta = self.meta[g, :, :, r]  # [T, K/32, 2]
        w = quants.reshape(*ids.shape, -1, BLOCK).float() * meta[..., 0].view(torch.float16).float().unsqueeze(-1)
        w = w + meta[..., 1].view(torch.float16).float().unsqueeze(-1)
        return w.reshape(*ids.shape, self.in_features)

    def dequantize(self) -> torch.Tensor:
        return self.dequantize_rows(torch.arange(self.out_features))


class QuantizedEmbedding(nn.Module):
    """An embedding table kept quantized (GGUF's token_embd is Q8_0, and tied to the lm_head): a lookup
    dequantizes only the rows it reads; the tied lm_head runs the quantized kernel on the same bytes."""

    def __init__(self, weight: QuantizedWeight):
        super().__init__()
        self.quant = weight
        self.num_embeddings, self.embedding_dim = weight.out_features, weight.in_features
        self.dtype = torch.float32  # the serving dtype, set once the model is cast (pack_weights)
        self.quant_ops = None  # the CPU kernels, for the tied lm_head (set by load_model)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.quant.dequantize_rows(ids).to(self.dtype)


W8A8_BLOCK = 64  # K per activation scale in the W8A8 kernel (w8a8.cpp says why)


class W8A8Weight:
    """`--quantization w8a8`: a float [N, K] weight as int8 per output channel, symmetric (sw = amax / 127,
    q = round(w / sw) in -127..127: never -128, which the AVX2 kernel's sign trick needs), in the layout
    w8a8.cpp reads: qweight [N/16, K/4, 16, 4] int8 (16 outputs x 4 consecutive K per 64 bytes; N padded to 16,
    K to 64, with zeros) and meta [N/16, 1 + K/64, 16] float32: per group of 16 outputs the scales, then per
    64-K block 128 times the block's sum of q (the VNNI path's compensation for its unsigned activations; exact
    integers). One scale per output (not per block of 32 as int8's) keeps each block's sum an integer product
    that the kernel scales once per token and block."""
    kind = source = "w8a8"

    def __init__(self, weight: torch.Tensor):
        n, k = weight.shape
        self.out_features, self.in_features = n, k
        w = weight.detach().float()
        amax = w.abs().amax(1)
        # 127 / amax as one division (a scalar / tensor in torch multiplies by a rounded reciprocal)
        inv = torch.where(amax > 0, torch.tensor(127.0).div(amax), torch.zeros(()))
        q = torch.round(w * inv.unsqueeze(1)).clamp(-127, 127).to(torch.int8)
        groups, blocks = -(-n // GROUP), -(-k // W8A8_BLOCK)
        padded = torch.zeros(groups * GROUP, blocks * W8A8_BLOCK, dtype=torch.int8)
        padded[:n, :k] = q
        self.qweight = padded.view(groups, GROUP, blocks * W8A8_BLOCK // 4, 4).permute(0, 2, 1, 3).contiguous()
        scales = torch.zeros(groups * GROUP)
        scales[:n] = amax / 127
        sums = 128 * padded.view(groups * GROUP, blocks, W8A8_BLOCK).sum(-1, dtype=torch.int32)  # <= 2^21: exact
        meta = torch.cat([scales.unsqueeze(1), sums.float()], 1)  # [N padded, 1 + blocks]
        self.meta = meta.view(groups, GROUP, 1 + blocks).permute(0, 2, 1).contiguous()

    @property
    def nbytes(self) -> int:
        return self.qweight.nbytes + self.meta.nbytes

    @property
    def scales(self) -> torch.Tensor:
        return self.meta[:, 0].reshape(-1)[:self.out_features]

    def int8_rows(self) -> torch.Tensor:
        """The [N, K] int8 quants (the packing undone)."""
        groups, k4 = self.qweight.shape[:2]
        q = self.qweight.permute(0, 2, 1, 3).reshape(groups * GROUP, k4 * 4)
        return q[:self.out_features, :self.in_features]

    def dequantize(self) -> torch.Tensor:
        return self.int8_rows().float() * self.scales.unsqueeze(1)


def quant_linear(ops, x: torch.Tensor, weight: QuantizedWeight | W8A8Weight, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] @ weight^T (+ bias) on the quantized kernel, in x's dtype."""
    op = ops.w8a8_linear if isinstance(weight, W8A8Weight) else ops.quant_linear
    out = op(x.reshape(-1, weight.in_features), weight.qweight, weight.meta, bias, weight.out_features)
    return out.view(*x.shape[:-1], weight.out_features)


def quantization_kernels(quantization: str, is_gguf: bool, dtype: torch.dtype, device: torch.device,
                         gguf_has_quantized: bool = True):
    """The CPU kernels that will serve weights kept quantized, or None where weights stay (or become) dense.
    Where quantized weights were asked for (int8, int4, w8a8, gguf) and the kernels cannot run, this refuses to start
    rather than serve dense weights under a quantized flag; --quantization none asks for the dense weights. With
    auto, a GGUF holding Q4_0/Q4_1/Q8_0 tensors (gguf_has_quantized) is dequantized, with a log line."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"unknown --quantization {quantization!r}; choose from {', '.join(QUANTIZATIONS)}")
    if quantization == "gguf" and not is_gguf:
        raise ValueError("--quantization gguf needs a GGUF model; use int8, int4 or w8a8 to quantize this one at "
                         "load")
    if quantization == "none" or (quantization == "auto" and not is_gguf):
        return None
    from tokenmill.kernels import cpu_ops
    ops = cpu_ops() if device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) else None
    if ops is None and quantization == "auto" and gguf_has_quantized:
        logger.warning("quantization auto: no quantized kernels for %s in %s; the GGUF's quantized tensors are "
                       "dequantized to %s at load", device.type, dtype, str(dtype).removeprefix("torch."))
    elif ops is None and quantization in (*LOAD_TIME, "gguf"):
        why = ("the quantized kernels are CPU kernels" if device.type != "cpu" else
               "they run in float32 and bfloat16" if dtype not in (torch.float32, torch.bfloat16) else
               "the CPU kernels are off (the log says why: TOKENMILL_CPU_ISA, or a failed build)")
        dense = str(dtype).removeprefix("torch.")
        raise ValueError(
            f"--quantization {quantization}: the quantized weights cannot be served on {device.type} in {dense} "
            f"({why}); what would run is dense {dense} weights"
            f"{' (the GGUF dequantized at load)' if is_gguf else ' (the checkpoint as it is)'}: pass "
            "--quantization none to serve those, or run on the CPU in float32/bfloat16")
    return ops


def attach_kernels(model: nn.Module, ops) -> None:
    for module in model.modules():
        if getattr(module, "quant", None) is not None:
            module.quant_ops = ops


def describe_weights(model: nn.Module) -> str:
    """Weight bytes resident and what is kept quantized, for the start-up log."""
    quantized = [m.quant for m in model.modules() if getattr(m, "quant", None) is not None]
    dense = list(model.parameters())
    total = sum(q.nbytes for q in quantized) + sum(p.nbytes for p in dense)
    counts: dict[str, int] = {}
    for q in quantized:
        counts[q.source] = counts.get(q.source, 0) + 1
    kept = ", ".join(f"{n} {source}" for source, n in sorted(counts.items())) or "none"
    dtype = str(dense[0].dtype).removeprefix("torch.") if dense else "-"
    return f"{total / 1e6:.1f} MB (kept quantized: {kept}; dense {dtype}: {len(dense)} tensors)"
