"""The batched LoRA delta of one linear layer: every token's own adapter, in one pass over the batch.

A linear layer keeps --max-loras slots: A^T [shards, slots, in, R] and B^T [slots, R, out], each adapter padded
with zeros to --max-lora-rank R; a fused linear's shards (q/k/v, gate/up) each have their A, and their B^T in
their own output columns. A step says which requests' rows use which slot (LoRABatch) and the rank of each slot
on each shard (0: not targeted). What is added to x @ W^T is never a merged weight and never a loop over
requests in Python:
- on the CPU kernels, `lora_delta` (tokenmill/kernels/csrc/lora.cpp), Punica's two kernels: a prefill chunk of
  one adapter as two GEMMs per shard (SGMV), decode rows each with its own adapter row by row (BGMV), only the
  adapter's own rank and shards computed;
- elsewhere (CUDA, or no kernels), the reference in torch: the step's tokens carry a one-hot row over the slots
  (LoRABatch.mask, all zeros for a base token), and
      xa = x @ A^T                     for every slot and shard (one batched matmul)
      xa *= mask                       a token keeps only its own slot's columns
      out[:, shard j] += xa[j] @ B^T[:, :, shard j]   one matmul per shard that a slot targets
  so base tokens get exactly zero and each adapter token its own (x @ A^T) @ B^T.

The fused decoder stack (llama_forward) calls the same kernel after each linear."""
from __future__ import annotations

import torch

from tokenmill.lora.adapter import LinearShape


# The fused linears of a decoder layer that adapters target, in the order llama_forward takes them
LINEARS = ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj")
_NONE = torch.empty(0, dtype=torch.int32)


class LoRABatch:
    """This step's token → slot map, shared by every LoRA linear of the model (LoRAManager.prepare sets it)."""

    def __init__(self):
        self.active = False  # some token of this step has an adapter
        self.segments: torch.Tensor | None = None  # [K, 3] int64: (first row, rows, slot) per request with an adapter
        self.ranks: dict[str, torch.Tensor] = {}  # fused linear → [slots, shards] int32: each slot's rank on each
        self.mask: torch.Tensor | None = None  # [tokens, slots], one-hot (the torch path only)
        self.fused_weights: list[torch.Tensor] = []  # per layer, A^T and B^T of each of LINEARS

    def fused_args(self) -> tuple:
        """llama_forward's LoRA arguments: the weights, the ranks of each of LINEARS (empty: not targeted this
        step), the segments."""
        return self.fused_weights, [self.ranks.get(name, _NONE) for name in LINEARS], self.segments


class LoRALinear:
    """The slots of one fused linear (qkv_proj, o_proj, gate_up_proj or down_proj of one layer)."""

    def __init__(self, name: str, shape: LinearShape, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, batch: LoRABatch, ops=None):
        self.name, self.shape, self.batch, self.ops = name, shape, batch, ops
        self.num_slots, self.max_rank = num_slots, max_rank
        n = len(shape.shard_out)
        self.a = torch.zeros(n, num_slots, shape.in_features, max_rank, dtype=dtype, device=device)  # A^T
        self.b_t = torch.zeros(num_slots, max_rank, sum(shape.shard_out), dtype=dtype, device=device)
        self.offsets = [sum(shape.shard_out[:j]) for j in range(n)]

    def set_slot(self, slot: int, shards: list[tuple[torch.Tensor, torch.Tensor] | None] | None) -> None:
        """Puts an adapter's (A, scaled B) per shard into a slot (None: the adapter leaves this linear alone)."""
        self.a[:, slot].zero_()
        self.b_t[slot].zero_()
        for j, pair in enumerate(shards or ()):
            if pair is not None:
                a, b = pair
                rank, offset = a.shape[0], self.offsets[j]
                self.a[j, slot, :, :rank].copy_(a.t())
                self.b_t[slot, :rank, offset:offset + b.shape[0]].copy_(b.t())

    def add_delta(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """out (x's base projection) plus each token's adapter delta, in place."""
        ranks = self.batch.ranks.get(self.name)
        if ranks is None:  # no adapter in this step targets this linear
            return out
        x2, out2 = x.reshape(-1, x.shape[-1]), out.view(-1, out.shape[-1])
        if self.ops is not None:
            self.ops.lora_delta(out2, x2, self.a, self.b_t, self.batch.segments, ranks, self.shape.shard_out)
            return out
        tokens, slots, rank, n = x2.shape[0], self.num_slots, self.max_rank, len(self.offsets)
        xa = (x2 @ self.a.view(n * slots, -1, rank)).view(n, slots, tokens, rank)  # every slot and shard
        xa = (xa * self.batch.mask.t().view(1, slots, tokens, 1)).permute(2, 0, 1, 3).reshape(tokens, n, slots * rank)
        b_t = self.b_t.view(slots * rank, -1)
        for j, (offset, cols) in enumerate(zip(self.offsets, self.shape.shard_out)):
            if ranks[:, j].any():
                out2.narrow(1, offset, cols).addmm_(xa[:, j], b_t.narrow(1, offset, cols))
        return out
