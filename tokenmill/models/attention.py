"""Attention over the paged KV cache, behind one interface with two backends.

The batch is flat: decodes (one query token each) come first, then prefill chunks. Sequence s owns query rows
query_start_loc[s]:query_start_loc[s+1] and, after this step, seq_lens[s] tokens of KV in the blocks of row s of
block_tables; its newest token is its last query row. New K/V of every token are written into their slots
before any sequence reads, so a chunk or a request admitted in the same step can read blocks another request
is writing in this very step. The runner builds the metadata once per step and every layer reuses it.

A backend takes a layer's fused qkv projection and returns the attention output: it applies the layer's q/k
norms (Qwen3, Gemma 3) and RoPE, writes K/V to the cache and attends. Two optional arguments serve models whose
layers differ (Gemma 3): `sliding_window` (the row at position p sees only keys p - W + 1..p; None: all) and
`rope` (this layer's RotaryEmbedding instead of meta.rope). A sliding layer still writes every token's K/V: the
block tables stay shared by all layers, and the window is applied when reading.
- `cpu`: tokenmill's kernels (tokenmill/kernels): RoPE fused with the cache write, and one varlen paged
  attention call for decode rows and prefill chunks together, reading each KV block in place.
- `triton`: tokenmill's Triton kernels (tokenmill/kernels/triton/attention.py), the default on CUDA: one varlen
  prefill launch over the paged cache for every prefill chunk of the step, and split-K decode; the torch_sdpa
  layout, writes and one-byte rules, only the attention itself differs.
- `torch_sdpa`: gathers each sequence's blocks and calls torch's scaled_dot_product_attention; the reference
  for the kernels, and the path where neither kernel set serves (CUDA without triton, other devices).

A layer's cache is (k_cache, v_cache, kv_scales): with --kv-cache-dtype fp8/int8 the caches hold one byte per
element and kv_scales [2, kv_heads, head_dim] float32 says what a byte is worth (tokenmill/models/kv_quant.py); writes
quantize, reads of earlier steps' K/V dequantize, and the K/V a step computes (a prefill chunk's own, a decode's own
token) are attended as computed, unquantized. While `calibrating` (the first forward pass, when the scales are
computed), each layer sets its scales from its K and V before writing them."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from tokenmill.models.kv_quant import as_bytes, calibrate, dequantize, is_one_byte, quantize

logger = logging.getLogger("tokenmill.attention")


@dataclass
class AttentionMetadata:
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64 flat slot = block_id * block_size + offset
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32: KV tokens after this step, this step's included
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32, padded with block 0
    num_decodes: int = 0  # the first num_decodes sequences have one query token each
    query_lens: list[int] = field(default_factory=list)  # per sequence, on the host
    context_lens: list[int] = field(default_factory=list)  # seq_lens on the host
    rope: torch.nn.Module | None = None  # the model's RotaryEmbedding (cos/sin tables), set by the model
    derived: dict = field(default_factory=dict)  # per-step tensors a backend derives once for all layers


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache[block_ids] as whole-block row copies: on the CPU, index_select of flat rows moves the bytes about
    twice as fast as advanced indexing."""
    return cache.view(cache.shape[0], -1).index_select(0, block_ids).view(-1, *cache.shape[1:])


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotated_qkv(layer, qkv: torch.Tensor, meta: AttentionMetadata, rope=None):
    """q [T, Hq, D], k and v [T, Hkv, D] from a layer's fused projection: q/k norms, then RoPE."""
    q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
    q = q.view(-1, layer.num_heads, layer.head_dim)
    k = k.view(-1, layer.num_kv_heads, layer.head_dim)
    v = v.view(-1, layer.num_kv_heads, layer.head_dim)
    if layer.q_norm is not None:
        q, k = layer.q_norm(q), layer.k_norm(k)
    rope = rope or meta.rope
    key = ("cos_sin", q.dtype, id(rope))
    if key not in meta.derived:
        meta.derived[key] = rope(meta.positions, q.dtype)
    cos, sin = meta.derived[key]
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v


class TorchSDPABackend:
    """Runs on CPU and CUDA with torch ops only."""

    name = "torch_sdpa"
    calibrating = False  # the first forward pass sets the KV scales (see the module docstring)

    @staticmethod
    def kv_cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[tuple, tuple]:
        shape = (num_blocks, block_size, num_kv_heads, head_dim)
        return shape, shape

    def forward(self, layer, qkv: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, sliding_window: int | None = None, rope=None) -> torch.Tensor:
        """layer: the model's Attention (head counts, norms, scale); qkv: [T, (Hq + 2 Hkv) * D]. Returns [T, Hq, D]."""
        q, k, v = rotated_qkv(layer, qkv, meta, rope)
        k_cache, v_cache, kv_scales = kv_cache
        if is_one_byte(k_cache.dtype):
            if self.calibrating:
                calibrate(kv_scales, k, v, k_cache.dtype)
            kq, vq = quantize(k, kv_scales[0], k_cache.dtype), quantize(v, kv_scales[1], k_cache.dtype)
            as_bytes(k_cache).view(-1, *k.shape[1:]).index_copy_(0, meta.slot_mapping, as_bytes(kq))
            as_bytes(v_cache).view(-1, *v.shape[1:]).index_copy_(0, meta.slot_mapping, as_bytes(vq))
        else:
            k_cache.view(-1, *k.shape[1:]).index_copy_(0, meta.slot_mapping, k)
            v_cache.view(-1, *v.shape[1:]).index_copy_(0, meta.slot_mapping, v)
        return self._attend(q, k, v, k_cache, v_cache, kv_scales, meta, layer.scale, sliding_window)

    @staticmethod
    def _gather(cache: torch.Tensor, block_ids: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype):
        """The blocks [n, block_size, kv_heads, D], dequantized to dtype when the cache is one-byte."""
        if not is_one_byte(cache.dtype):
            return gather_blocks(cache, block_ids)
        return dequantize(gather_blocks(as_bytes(cache), block_ids).view(cache.dtype), scales, dtype)

    @staticmethod
    def _decode_inputs(meta: AttentionMetadata, block_size: int,
                       window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The decodes' block tables (flattened) and their [d, 1, 1, keys] mask, once per step and window."""
        key = ("decode", window)
        if key not in meta.derived:
            d = meta.num_decodes
            width = -(-max(meta.context_lens[:d]) // block_size)
            tables = meta.block_tables[:d, :width].long()
            lens = meta.seq_lens[:d].long()
            kpos = torch.arange(width * block_size, device=lens.device)[None, :]
            mask = kpos < lens[:, None]
            if window is not None:  # the decode row sits at lens - 1 and sees keys > lens - 1 - window
                mask &= kpos >= (lens - window)[:, None]
            meta.derived[key] = tables.flatten(), mask[:, None, None, :]
        return meta.derived[key]

    def _attend(self, q, k, v, k_cache, v_cache, kv_scales, meta: AttentionMetadata, scale: float,
                window: int | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        d = meta.num_decodes
        if d:
            flat_table, mask = self._decode_inputs(meta, k_cache.shape[1], window)
            kv_shape = (d, -1, k_cache.shape[2], k_cache.shape[3])
            keys = self._gather(k_cache, flat_table, kv_scales[0], q.dtype).view(kv_shape)
            values = self._gather(v_cache, flat_table, kv_scales[1], q.dtype).view(kv_shape)
            if is_one_byte(k_cache.dtype):  # each decode's own token from this step's K/V, not the cache
                rows, newest = torch.arange(d, device=q.device), meta.seq_lens[:d].long() - 1
                keys[rows, newest], values[rows, newest] = k[:d], v[:d]
            keys, values = keys.transpose(1, 2), values.transpose(1, 2)
            o = F.scaled_dot_product_attention(q[:d].unsqueeze(2), keys, values, attn_mask=mask, scale=scale,
                                               enable_gqa=gqa)
            out[:d] = o.squeeze(2)
        start = d
        for s in range(d, len(meta.query_lens)):
            n, ctx = meta.query_lens[s], meta.context_lens[s]
            e = start + n
            qs = q[start:e].transpose(0, 1)
            if ctx == n and (window is None or n <= window):  # nothing cached, no window: plain causal
                ks, vs, mask, causal = k[start:e].transpose(0, 1), v[start:e].transpose(0, 1), None, True
            else:
                blocks = meta.block_tables[s, :-(-ctx // k_cache.shape[1])].long()
                ks = self._gather(k_cache, blocks, kv_scales[0], q.dtype).flatten(0, 1)[:ctx]
                vs = self._gather(v_cache, blocks, kv_scales[1], q.dtype).flatten(0, 1)[:ctx]
                if is_one_byte(k_cache.dtype):  # the chunk's own keys from this step's K/V, not the cache
                    ks[ctx - n:], vs[ctx - n:] = k[start:e], v[start:e]
                ks, vs = ks.transpose(0, 1), vs.transpose(0, 1)
                qpos = torch.arange(ctx - n, ctx, device=q.device)
                kpos = torch.arange(ctx, device=q.device)
                mask, causal = kpos[None, :] <= qpos[:, None], False
                if window is not None:
                    mask &= kpos[None, :] > qpos[:, None] - window
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal, scale=scale,
                                               enable_gqa=gqa)
            out[start:e] = o.transpose(0, 1)
            start = e
        return out


class TritonBackend(TorchSDPABackend):
    """The Triton kernels for the attention itself; RoPE, norms and cache writes as torch_sdpa (torch ops).
    Graph-safe for decode-only steps: it reads lengths from tensors and takes its launch shape from the batch
    (tokenmill/engine/cuda_graph.py)."""

    name = "triton"

    def __init__(self, block_m: int | None = None, block_n: int | None = None, num_splits: int | None = None):
        """Tile sizes and the decode split count: None picks them from the shapes (the tests set small ones)."""
        from tokenmill.kernels.triton import attention as kernels
        self.kernels = kernels
        self.block_m, self.block_n, self.num_splits = block_m, block_n, num_splits

    def _attend(self, q, k, v, k_cache, v_cache, kv_scales, meta: AttentionMetadata, scale: float,
                window: int | None = None) -> torch.Tensor:
        out = torch.empty_like(q)
        d, n = meta.num_decodes, len(meta.query_lens)
        self.kernels.decode_attention(out, q, k, v, k_cache, v_cache, kv_scales, meta.block_tables, meta.seq_lens,
                                      d, scale, window, self.num_splits, self.block_n)
        if n > d:
            self.kernels.prefill_attention(out, q, k, v, k_cache, v_cache, kv_scales, meta.block_tables,
                                           meta.seq_lens, meta.query_start_loc, d, n - d, max(meta.query_lens[d:]),
                                           scale, window, self.block_m, self.block_n)
        return out


class CPUKernelBackend:
    """tokenmill's C++ kernels: float32 or bfloat16 on the CPU."""

    name = "cpu"
    calibrating = False  # the first forward pass sets the KV scales (see the module docstring)

    BLOCK_SIZES = (16, 32, 64, 128)  # the kernel is compiled for these
    HEAD_DIM_MULTIPLE = 32

    def __init__(self, ops):
        self.ops = ops

    @staticmethod
    def kv_cache_shapes(num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int) -> tuple[tuple, tuple]:
        """K transposed within a block ([dims][tokens]), so that scores over a block are vector FMAs; one head's
        block is contiguous in both."""
        return (num_blocks, num_kv_heads, head_dim, block_size), (num_blocks, num_kv_heads, block_size, head_dim)

    def forward(self, layer, qkv: torch.Tensor, kv_cache: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                meta: AttentionMetadata, sliding_window: int | None = None, rope=None) -> torch.Tensor:
        k_cache, v_cache, kv_scales = kv_cache
        if self.calibrating and is_one_byte(k_cache.dtype):  # once: K and V computed in torch for their amax
            _, k, v = rotated_qkv(layer, qkv, meta, rope)
            calibrate(kv_scales, k, v, k_cache.dtype)
        tokens = qkv.shape[0]
        q = torch.empty(tokens, layer.num_heads, layer.head_dim, dtype=qkv.dtype)
        # one-byte cache: this step's own K (from rope_and_cache) and V (a view of qkv) are attended unquantized
        k = v = None
        if is_one_byte(k_cache.dtype):
            k = torch.empty(tokens, layer.num_kv_heads, layer.head_dim, dtype=qkv.dtype)
            v = qkv[:, layer.q_size + layer.kv_size:].view(tokens, layer.num_kv_heads, layer.head_dim)
        norm = layer.q_norm is not None
        rope = rope or meta.rope
        self.ops.rope_and_cache(qkv, meta.positions, rope.cos, rope.sin, k_cache, v_cache,
                                meta.slot_mapping, q, layer.q_norm.weight if norm else None,
                                layer.k_norm.weight if norm else None, layer.q_norm.eps if norm else 0.0, kv_scales, k)
        out = torch.empty_like(q)
        self.ops.paged_attention(out, q, k_cache, v_cache, meta.block_tables, meta.seq_lens,
                                 meta.query_start_loc, layer.scale, sliding_window or 0, kv_scales, k, v)
        return out


ATTENTION_BACKENDS = ("auto", CPUKernelBackend.name, TritonBackend.name, TorchSDPABackend.name)


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def get_attention_backend(name: str, device: torch.device, dtype: torch.dtype, block_size: int, head_dim: int):
    """auto: the CPU kernels where they serve this device, dtype and shape; the Triton kernels on CUDA; else
    torch_sdpa. The choice is logged."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {list(ATTENTION_BACKENDS)}")
    if name == TritonBackend.name or (name == "auto" and device.type == "cuda"):
        if triton_available():
            logger.info("attention backend: triton")
            return TritonBackend()
        if name == TritonBackend.name:
            raise ValueError("--attention-backend triton needs the triton package")
    if name in ("auto", CPUKernelBackend.name):
        from tokenmill.kernels import cpu_ops
        usable = (device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                  and block_size in CPUKernelBackend.BLOCK_SIZES and head_dim % CPUKernelBackend.HEAD_DIM_MULTIPLE == 0)
        ops = cpu_ops() if usable else None
        if ops is not None:
            logger.info("attention backend: cpu (tokenmill kernels, %s)", ops.name.removeprefix("tokenmill_"))
            return CPUKernelBackend(ops)
        if name == CPUKernelBackend.name:
            raise ValueError(f"--attention-backend cpu needs the CPU kernels, on the CPU, in float32 or bfloat16, "
                             f"with a block size in {CPUKernelBackend.BLOCK_SIZES} and a head_dim that is a multiple "
                             f"of {CPUKernelBackend.HEAD_DIM_MULTIPLE} (device {device.type}, dtype {dtype}, block "
                             f"size {block_size}, head_dim {head_dim}; the log says why kernels are missing)")
    logger.info("attention backend: torch_sdpa")
    return TorchSDPABackend()
