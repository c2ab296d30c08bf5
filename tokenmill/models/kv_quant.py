"""KV-cache dtypes (--kv-cache-dtype, vLLM's names): one byte per cached element, so the same --kv-cache-memory
holds twice the tokens of bf16 (four times float32).

- `auto`: the model's dtype. `fp8` = `fp8_e4m3`: float8 e4m3fn (3 mantissa bits, largest 448).
  `fp8_e5m2`: float8 e5m2 (2 mantissa bits, largest 57344). `int8`: symmetric int8.
- Stored value = x / scale (rounded to nearest even, saturating), read value = stored * scale. The scales of a
  layer are a float32 [2, kv_heads, head_dim] tensor (K, V), one per channel; the CPU kernel folds K's into the
  query and applies V's to the output, so its inner loops read raw codes.
- fp8: per tensor, as vLLM: 1.0 by default; with --calculate-kv-scales, set once from the first forward pass
  by vLLM's rule: scale_k = amax|K| / 200 and scale_v = amax|V| / 100 (its K_SCALE_CONSTANT and
  V_SCALE_CONSTANT), the same value in every channel. That leaves 2.2x (K) and 4.5x (V) of headroom below e4m3's
  448 for later tokens larger than the first step's, and costs no precision: a float format's relative error does
  not depend on the scale (only values below 2^-6 of it, ~1e-4 of the amax, turn subnormal).
- int8 has no default that works, so its scales are always calibrated on the first forward pass, per channel
  (KV head and dimension, as KIVI does for keys): scale = that channel's amax over the step's tokens x
  INT8_MARGIN / 127; anything beyond is clamped to +-127. Per channel because int8's error is absolute (half a
  step of the scale) and K has outlier channels: in Gemma 3 270M a K channel reaches 73 where the median
  channel's amax is 1.5, so a per-head scale left the median channel 2-3 levels and broke greedy decoding at the
  first token (per channel, it decodes as fp8 does). The margin trades resolution (a third of the levels unused
  at first) for room for later, larger tokens; on SmolLM2's teacher-forced agreement with HF float32
  (tests/test_kv_cache_dtype.py) margins 1.0, 1.2 and 1.5 gave 0.974, 0.969 and 0.979: within the measure's
  noise, so the widest.
- "The first forward pass" is the first step the engine runs: its requests' prompt tokens (K after the q/k norms
  and RoPE), every layer in turn, before anything is written. That step runs the model layer by layer (the
  fused decoder-stack kernel has no calibration), then the scales are fixed for the pool's lifetime, so a block
  cached for a prefix means the same thing to every later request. A first step of very few tokens calibrates
  on little data; that is vLLM's behaviour too.

The CPU kernels decode in registers (tokenmill/kernels/csrc/kv_quant.h); the pure-torch backend dequantizes the
blocks it gathers, through torch's float8 dtypes (on CUDA too).
"""
from __future__ import annotations

import torch

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
_STORAGE = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2,
            "int8": torch.int8}
_LARGEST = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0  # vLLM's: amax / constant is the fp8 scale
INT8_MARGIN = 1.5


def kv_storage_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype the cache tensors hold: the model's for auto, else a one-byte dtype."""
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype not in _STORAGE:
        raise ValueError(f"--kv-cache-dtype {kv_cache_dtype!r}: choose from {list(KV_CACHE_DTYPES)}")
    return _STORAGE[kv_cache_dtype]


def is_one_byte(cache_dtype: torch.dtype) -> bool:
    return cache_dtype in _LARGEST


def needs_calibration(kv_cache_dtype: str, calculate_kv_scales: bool) -> bool:
    """Whether the first forward pass sets the scales: always for int8, for fp8 when asked."""
    return kv_cache_dtype == "int8" or (kv_cache_dtype != "auto" and calculate_kv_scales)


def calibrate(scales: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache_dtype: torch.dtype) -> None:
    """Set one layer's scales [2, kv_heads, head_dim] in place from its K and V [tokens, kv_heads, head_dim]."""
    if cache_dtype == torch.int8:
        for row, x in ((0, k), (1, v)):
            amax = x.detach().abs().amax(dim=0).float()
            scales[row] = torch.where(amax > 0, amax * INT8_MARGIN / 127.0, torch.ones_like(amax))
        return
    for row, x, constant in ((0, k, K_SCALE_CONSTANT), (1, v, V_SCALE_CONSTANT)):
        amax = x.detach().abs().max().float()
        scales[row] = amax / constant if amax > 0 else 1.0


def as_bytes(cache: torch.Tensor) -> torch.Tensor:
    """A one-byte cache viewed as uint8, for the copies torch does not implement for float8 (index_copy_)."""
    return cache.view(torch.uint8) if is_one_byte(cache.dtype) else cache


def quantize(x: torch.Tensor, scales: torch.Tensor, cache_dtype: torch.dtype) -> torch.Tensor:
    """x [..., kv_heads, head_dim] → cache_dtype, with scales [kv_heads, head_dim]: what the kernels write
    (x * (1 / scale) in float32, round to nearest even, saturate)."""
    largest = _LARGEST[cache_dtype]
    y = x.float() * scales.reciprocal()
    if cache_dtype == torch.int8:
        return y.round().clamp(-largest, largest).to(torch.int8)
    return y.clamp(-largest, largest).to(cache_dtype)


def dequantize(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """q [..., kv_heads, head_dim] of a one-byte dtype → dtype, times the scales [kv_heads, head_dim]."""
    return (q.float() * scales).to(dtype)
