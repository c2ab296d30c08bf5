"""Paged attention in Triton: the `triton` attention backend (tokenmill/models/attention.py), the default on CUDA.

Two kernels read the paged KV cache in place ([num_blocks, block_size, kv_heads, head_dim], the torch_sdpa
layout), so no step gathers blocks into dense tensors:
- `prefill_attention`: varlen prefill. One launch covers the query tokens of every prefill sequence of the step
  (grid: sequence x query tile x query head). A chunk's rows attend in full to the sequence's cached prefix
  (prefix-cache hits, earlier chunks) and causally within the step's new tokens; a row at position p sees keys
  p - W + 1..p under a sliding window W. Flash-attention style: one pass over the keys with an online softmax,
  keys in tiles of BLOCK_N positions whose block ids come from the block table per position.
- `decode_attention`: split-K decode (flash-decoding). A decode is one query row per head, so a grid of one
  program per (sequence, KV head) leaves most of the GPU idle at small batches; the keys are cut into
  `num_splits` ranges, each program writes a partial output and its log-sum-exp, and a second kernel combines
  them. One program serves all the query heads of a KV head (GQA), padded to 16 rows for tl.dot, so each K/V tile
  is read once per group, as SGLang's grouped decode kernel does. The split count depends only on the batch
  shape, never on sequence lengths, so a CUDA graph captured for a batch size replays with any lengths.

One-byte KV caches (tokenmill/models/kv_quant.py): tiles are dequantized in registers (code * per-channel scale,
rounded to the model dtype, as the torch reference does) and the step's own K/V (the tokens the cache just
quantized) are read from the unquantized k/v tensors instead, the rule every backend follows.

Written against the Triton APIs shared by 3.6 (the GPU machine) and 3.9 (the CPU venv): tl.dot, masked
tl.load/tl.store, tl.where, tl.exp, tl.max/tl.sum. With TRITON_INTERPRET=1 (read when this module is imported)
they run on CPU tensors; tests/test_triton_attention.py checks them that way against the torch reference."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tokenmill import envs
from tokenmill.models.kv_quant import is_one_byte


@triton.jit
def _kv_tile(cache_ptr, new_ptr, scale_ptr, table_row_ptr, kpos, n_mask, kv_head, offs_d, d_mask, new_row0, new_pos0,
             block_size, stride_cb, stride_cs, stride_ch, stride_nt, stride_nh, ONE_BYTE: tl.constexpr):
    """K or V at key positions kpos as a [BLOCK_D, BLOCK_N] tile (dims x keys), in the dtype of new_ptr. With a
    one-byte cache: dequantized, and positions >= new_pos0 (this step's own tokens) read from the new K/V rows
    new_row0 + (pos - new_pos0)."""
    block = tl.load(table_row_ptr + kpos // block_size, mask=n_mask, other=0).to(tl.int64)
    offset = block * stride_cb + (kpos % block_size) * stride_cs + kv_head * stride_ch
    mask = d_mask[:, None] & n_mask[None, :]
    tile = tl.load(cache_ptr + offset[None, :] + offs_d[:, None], mask=mask, other=0.0)
    if ONE_BYTE:
        scale = tl.load(scale_ptr + offs_d, mask=d_mask, other=0.0)
        tile = (tile.to(tl.float32) * scale[:, None]).to(new_ptr.dtype.element_ty)
        is_new = kpos >= new_pos0
        rows = (new_row0 + kpos - new_pos0).to(tl.int64)
        new = tl.load(new_ptr + rows[None, :] * stride_nt + kv_head * stride_nh + offs_d[:, None],
                      mask=mask & is_new[None, :], other=0.0)
        tile = tl.where(is_new[None, :], new, tile)
    return tile


@triton.jit
def _dot(a, b, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    """a @ b accumulated in float32. IEEE: float32 operands multiplied in full precision, not tf32 (which would
    drop 13 mantissa bits); bf16/fp16 operands take tl.dot's default. DOT_F32: the operands widened to float32
    first (exact for bf16/fp16 values); set under the interpreter, whose tl.dot multiplies bfloat16 operands as
    raw integers (Triton 3.9)."""
    if DOT_F32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _prefill_kernel(out_ptr, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, scales_ptr, block_tables_ptr,
                    seq_lens_ptr, query_start_loc_ptr, seq_offset, sm_scale, window, head_dim, group, block_size,
                    stride_qt, stride_qh, stride_ot, stride_oh, stride_kt, stride_kh, stride_vt, stride_vh,
                    stride_cb, stride_cs, stride_ch, stride_bt, stride_scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, ONE_BYTE: tl.constexpr,
                    IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    seq = tl.program_id(0) + seq_offset
    tile_m = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // group
    q_start = tl.load(query_start_loc_ptr + seq)
    qlen = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile_m * BLOCK_M < qlen:
        ctx = tl.load(seq_lens_ptr + seq)
        prefix = ctx - qlen  # cached tokens before this step's
        offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = offs_m < qlen
        qpos = prefix + offs_m
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < head_dim
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
                    mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        hi = tl.minimum(ctx, prefix + (tile_m + 1) * BLOCK_M)  # past the tile's last row: masked anyway
        lo = tl.where(window > 0, tl.maximum(0, prefix + tile_m * BLOCK_M - window + 1) // BLOCK_N * BLOCK_N, 0)
        table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
        for start in range(lo, hi, BLOCK_N):
            kpos = start + tl.arange(0, BLOCK_N)
            n_mask = kpos < hi
            kt = _kv_tile(k_cache_ptr, k_ptr, scales_ptr + kv_head * head_dim, table_row, kpos, n_mask, kv_head,
                          offs_d, d_mask, q_start, prefix, block_size, stride_cb, stride_cs, stride_ch, stride_kt,
                          stride_kh, ONE_BYTE)
            s = _dot(q, kt, IEEE, DOT_F32) * sm_scale
            mask = m_mask[:, None] & n_mask[None, :] & (kpos[None, :] <= qpos[:, None])
            mask = mask & ((window == 0) | (kpos[None, :] > qpos[:, None] - window))
            s = tl.where(mask, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows with nothing visible yet
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            vt = _kv_tile(v_cache_ptr, v_ptr, scales_ptr + stride_scale + kv_head * head_dim, table_row, kpos, n_mask,
                          kv_head, offs_d, d_mask, q_start, prefix, block_size, stride_cb, stride_cs, stride_ch,
                          stride_vt, stride_vh, ONE_BYTE)
            acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), tl.trans(vt), IEEE, DOT_F32)
            m_i = m_new
        l_i = tl.where(l_i == 0.0, 1.0, l_i)
        out = acc / l_i[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & d_mask[None, :])


@triton.jit
def _decode_split_kernel(mid_o_ptr, mid_lse_ptr, q_ptr, k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, scales_ptr,
                         block_tables_ptr, seq_lens_ptr, sm_scale, window, head_dim, group, block_size, num_splits,
                         stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                         stride_cb, stride_cs, stride_ch, stride_bt, stride_scale,
                         BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                         ONE_BYTE: tl.constexpr, IEEE: tl.constexpr, DOT_F32: tl.constexpr):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(seq_lens_ptr + seq)
    lo = tl.where(window > 0, tl.maximum(0, ctx - window), 0)
    per_split = tl.cdiv(tl.cdiv(ctx - lo, num_splits), BLOCK_N) * BLOCK_N
    s_lo = lo + split * per_split
    s_hi = tl.minimum(s_lo + per_split, ctx)
    offs_h = tl.arange(0, BLOCK_H)
    h_mask = offs_h < group
    heads = kv_head * group + offs_h
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < head_dim
    q = tl.load(q_ptr + seq.to(tl.int64) * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=h_mask[:, None] & d_mask[None, :], other=0.0)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], tl.float32)
    table_row = block_tables_ptr + seq.to(tl.int64) * stride_bt
    for start in range(s_lo, s_hi, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        n_mask = kpos < s_hi
        # the decode's own token (position ctx - 1) is its row `seq` of k and v
        kt = _kv_tile(k_cache_ptr, k_ptr, scales_ptr + kv_head * head_dim, table_row, kpos, n_mask, kv_head, offs_d,
                      d_mask, seq, ctx - 1, block_size, stride_cb, stride_cs, stride_ch, stride_kt, stride_kh,
                      ONE_BYTE)
        s = _dot(q, kt, IEEE, DOT_F32) * sm_scale
        s = tl.where(n_mask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp(m_i - m_new)  # every tile has at least one visible key: m_new is finite
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = _kv_tile(v_cache_ptr, v_ptr, scales_ptr + stride_scale + kv_head * head_dim, table_row, kpos, n_mask,
                      kv_head, offs_d, d_mask, seq, ctx - 1, block_size, stride_cb, stride_cs, stride_ch, stride_vt,
                      stride_vh, ONE_BYTE)
        acc = acc * alpha[:, None] + _dot(p.to(vt.dtype), tl.trans(vt), IEEE, DOT_F32)
        m_i = m_new
    empty = l_i == 0.0  # a split past the end of a short sequence
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    # mid_o [seqs, q_heads, splits, BLOCK_D] float32, mid_lse [seqs, q_heads, splits]
    mid = (seq.to(tl.int64) * group * tl.num_programs(1) + heads) * num_splits + split
    tl.store(mid_o_ptr + mid[:, None] * BLOCK_D + offs_d[None, :], out, mask=h_mask[:, None])
    tl.store(mid_lse_ptr + mid, lse, mask=h_mask)


@triton.jit
def _decode_reduce_kernel(out_ptr, mid_o_ptr, mid_lse_ptr, head_dim, num_splits, stride_ot, stride_oh,
                          BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    base = (seq.to(tl.int64) * tl.num_programs(1) + head) * num_splits
    lse = tl.load(mid_lse_ptr + base + offs_s, mask=s_mask, other=float("-inf"))
    weights = tl.exp(lse - tl.max(lse, 0))
    parts = tl.load(mid_o_ptr + (base + offs_s)[:, None] * BLOCK_D + offs_d[None, :], mask=s_mask[:, None], other=0.0)
    out = tl.sum(parts * weights[:, None], 0) / tl.sum(weights, 0)
    tl.store(out_ptr + seq.to(tl.int64) * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < head_dim)


INTERPRETED = envs.TRITON_INTERPRET  # read at import, as triton.jit does


def _cache_strides(cache: torch.Tensor) -> tuple[int, int, int]:
    assert cache.stride(-1) == 1, "the KV cache's head_dim must be contiguous"
    return cache.stride(0), cache.stride(1), cache.stride(2)


def prefill_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, kv_scales: torch.Tensor, block_tables: torch.Tensor,
                      seq_lens: torch.Tensor, query_start_loc: torch.Tensor, first_seq: int, num_seqs: int,
                      max_query_len: int, scale: float, window: int | None = None,
                      block_m: int | None = None, block_n: int | None = None) -> None:
    """out[rows of sequences first_seq .. first_seq + num_seqs - 1] = attention of those rows of q [T, Hq, D]
    over their sequence's keys: the cache (written with this step's K/V already) up to seq_lens, causal within the
    step's own query_lens tokens. k, v [T, Hkv, D]: this step's K/V (read for one-byte caches only)."""
    if num_seqs == 0:
        return
    head_dim, num_heads, kv_heads = q.shape[2], q.shape[1], k.shape[1]
    block_d = max(16, triton.next_power_of_2(head_dim))
    big = block_d > 128
    block_m = block_m or (32 if big else 64)
    block_n = block_n or (32 if big else 64)
    grid = (num_seqs, triton.cdiv(max_query_len, block_m), num_heads)
    _prefill_kernel[grid](
        out, q, k, v, k_cache, v_cache, kv_scales, block_tables, seq_lens, query_start_loc, first_seq, scale,
        window or 0, head_dim, num_heads // kv_heads, k_cache.shape[1], q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), *_cache_strides(k_cache),
        block_tables.stride(0), kv_scales.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=block_d,
        ONE_BYTE=is_one_byte(k_cache.dtype), IEEE=q.dtype == torch.float32, DOT_F32=INTERPRETED,
        num_warps=8 if big else 4)


# Enough programs to fill an H100/H200 (132 SMs) about twice over; more splits only add reduction work.
TARGET_PROGRAMS = 264
MAX_SPLITS = 16


def decode_splits(num_decodes: int, kv_heads: int) -> int:
    """The split count for a decode batch: from its shape alone (never from lengths), so a captured CUDA graph
    stays valid whatever the sequences' lengths when it replays."""
    return max(1, min(MAX_SPLITS, TARGET_PROGRAMS // max(1, num_decodes * kv_heads)))


def decode_attention(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, kv_scales: torch.Tensor, block_tables: torch.Tensor,
                     seq_lens: torch.Tensor, num_decodes: int, scale: float, window: int | None = None,
                     num_splits: int | None = None, block_n: int | None = None) -> None:
    """out[:num_decodes] = attention of the decode rows q[:num_decodes] (one query token per sequence, the first
    num_decodes sequences of the step) over their paged keys, split-K (module docstring)."""
    if num_decodes == 0:
        return
    head_dim, num_heads, kv_heads = q.shape[2], q.shape[1], k.shape[1]
    group = num_heads // kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_n = block_n or (32 if block_d > 128 else 64)
    splits = num_splits or decode_splits(num_decodes, kv_heads)
    mid_o = torch.empty(num_decodes, num_heads, splits, block_d, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(num_decodes, num_heads, splits, dtype=torch.float32, device=q.device)
    _decode_split_kernel[(num_decodes, kv_heads, splits)](
        mid_o, mid_lse, q, k, v, k_cache, v_cache, kv_scales, block_tables, seq_lens, scale, window or 0, head_dim,
        group, k_cache.shape[1], splits, q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0),
        v.stride(1), *_cache_strides(k_cache), block_tables.stride(0), kv_scales.stride(0),
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, BLOCK_D=block_d,
        ONE_BYTE=is_one_byte(k_cache.dtype), IEEE=q.dtype == torch.float32, DOT_F32=INTERPRETED)
    _decode_reduce_kernel[(num_decodes, num_heads)](
        out, mid_o, mid_lse, head_dim, splits, out.stride(0), out.stride(1),
        BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d)
