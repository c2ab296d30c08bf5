"""Attention over the paged KV cache.

The batch is flat: decodes (one query token each) come first, then prefill chunks. New K/V of every token are
written into their slots before any sequence reads, so a chunk or a request admitted in the same step can read
blocks another request is writing in this very step. A backend implements `forward`; the runner builds the
metadata once per step and every layer reuses it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillChunk:
    query_start: int
    query_end: int
    context_len: int  # tokens in the cache after this step, this chunk's included
    block_ids: torch.Tensor  # the blocks that hold those context_len tokens


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] flat slot = block_id * block_size + offset
    num_decodes: int = 0
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks], padded with block 0
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_blocks * block_size], True = attend
    prefills: list[PrefillChunk] = field(default_factory=list)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """cache[block_ids] as whole-block row copies: on the CPU, index_select of flat rows moves the bytes about
    twice as fast as advanced indexing, and this gather is most of decode attention's time."""
    return cache.view(cache.shape[0], -1).index_select(0, block_ids).view(-1, *cache.shape[1:])


class TorchSDPABackend:
    """Gathers each sequence's blocks and calls torch's scaled_dot_product_attention; runs on CPU and CUDA."""

    name = "torch_sdpa"

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 meta: AttentionMetadata) -> None:
        num_heads, head_dim = k.shape[1], k.shape[2]
        k_cache.view(-1, num_heads, head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, num_heads, head_dim).index_copy_(0, meta.slot_mapping, v)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        """q: [T, Hq, D]; k, v: [T, Hkv, D]; caches: [num_blocks, block_size, Hkv, D]. Returns [T, Hq, D]."""
        self.write_kv(k, v, k_cache, v_cache, meta)
        out = torch.empty_like(q)
        gqa = q.shape[1] != k.shape[1]
        d = meta.num_decodes
        if d:
            num_blocks = meta.decode_block_tables.shape[1]
            kv_shape = (d, num_blocks * k_cache.shape[1], k_cache.shape[2], k_cache.shape[3])
            flat_table = meta.decode_block_tables.flatten()
            keys = gather_blocks(k_cache, flat_table).view(kv_shape).transpose(1, 2)
            values = gather_blocks(v_cache, flat_table).view(kv_shape).transpose(1, 2)
            o = F.scaled_dot_product_attention(q[:d].unsqueeze(2), keys, values, attn_mask=meta.decode_mask,
                                               scale=scale, enable_gqa=gqa)
            out[:d] = o.squeeze(2)
        for chunk in meta.prefills:
            s, e = chunk.query_start, chunk.query_end
            qs = q[s:e].transpose(0, 1)
            if chunk.context_len == e - s:  # nothing cached before this chunk: plain causal attention
                ks, vs, mask, causal = k[s:e].transpose(0, 1), v[s:e].transpose(0, 1), None, True
            else:
                ks = gather_blocks(k_cache, chunk.block_ids).flatten(0, 1)[:chunk.context_len].transpose(0, 1)
                vs = gather_blocks(v_cache, chunk.block_ids).flatten(0, 1)[:chunk.context_len].transpose(0, 1)
                first_pos = chunk.context_len - (e - s)
                qpos = torch.arange(first_pos, chunk.context_len, device=q.device)
                kpos = torch.arange(chunk.context_len, device=q.device)
                mask, causal = kpos[None, :] <= qpos[:, None], False
            o = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, is_causal=causal, scale=scale,
                                               enable_gqa=gqa)
            out[s:e] = o.transpose(0, 1)
        return out


ATTENTION_BACKENDS = {TorchSDPABackend.name: TorchSDPABackend}


def get_attention_backend(name: str = "torch_sdpa"):
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(ATTENTION_BACKENDS)}")
    return ATTENTION_BACKENDS[name]()
