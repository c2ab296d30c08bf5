"""Where adapters live while the engine serves them, and which slot each step's tokens read.

Two tiers, as in vLLM:
- the CPU cache: adapters read from disk (adapter.py), at most --max-cpu-loras of them, least recently used out
  first; an adapter that unfinished requests use is never dropped (the cache may hold more for a while), so a
  request never fails because its adapter was pushed out;
- the slots: --max-loras copies inside every LoRA linear (layers.py), what a forward pass computes with. A step
  that needs an adapter not in a slot copies it into a free slot, or into the least recently used one that this
  step does not need. The scheduler admits at most --max-loras distinct adapters among running requests
  (scheduler.py), so a step always finds room.

Unloading an adapter that requests still use (the API's unload_lora_adapter) retires it: it is dropped when the
last of them finishes. Each step, prepare() maps every request's rows to its adapter's slot (LoRABatch); a step
without adapter tokens runs the model exactly as without --enable-lora (the fused CPU kernels get no LoRA
arguments)."""
from __future__ import annotations

import logging
from collections import OrderedDict

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.lora.adapter import LinearShape, LoRAAdapter, LoRAError, load_adapter
from tokenmill.lora.layers import LINEARS, LoRABatch, LoRALinear
from tokenmill.lora.request import LoRARequest

logger = logging.getLogger("tokenmill.lora")


def model_linear_shapes(model) -> dict[str, LinearShape]:
    """The fused linears of a Llama-shaped decoder layer (models/llama.py, models/gemma3.py) that adapters target."""
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    hidden = model.config.hidden_size
    shapes = (LinearShape(hidden, (attn.q_size, attn.kv_size, attn.kv_size)), LinearShape(attn.q_size, (hidden,)),
              LinearShape(hidden, (mlp.intermediate, mlp.intermediate)), LinearShape(mlp.intermediate, (hidden,)))
    return dict(zip(LINEARS, shapes))


class LoRAManager:
    def __init__(self, model, config: EngineConfig, dtype: torch.dtype, device: torch.device, ops=None):
        """ops: tokenmill's CPU kernels when the model runs on them (the deltas use lora_delta), else None."""
        self.max_loras, self.max_rank = config.max_loras, config.max_lora_rank
        self.max_cpu_loras = config.max_cpu_loras or config.max_loras
        self.dtype, self.device, self.ops = dtype, device, ops
        self.shapes = model_linear_shapes(model)
        self.num_layers = len(model.layers)
        self.batch = LoRABatch()
        self.linears: list[tuple[int, LoRALinear]] = []
        for i, layer in enumerate(model.layers):
            for name, shape in self.shapes.items():
                linear = layer.get_submodule(name)
                linear.lora = LoRALinear(name, shape, self.max_loras, self.max_rank, dtype, device, self.batch, ops)
                self.linears.append((i, linear.lora))
        model.lora = self.batch
        self.batch.fused_weights = [t for _, linear in self.linears for t in (linear.a, linear.b_t)]
        self.cache: OrderedDict[int, LoRAAdapter] = OrderedDict()  # lora_int_id → adapter, least recent first
        self.refs: dict[int, int] = {}  # lora_int_id → unfinished requests using it
        self.retiring: set[int] = set()  # unloaded while in use: dropped when its last request finishes
        self.slots: list[int | None] = [None] * self.max_loras
        # per slot: fused linear → the adapter's rank on each shard (0: not targeted)
        self.slot_ranks: list[dict[str, list[int]]] = [{} for _ in range(self.max_loras)]
        self.slot_used = [0] * self.max_loras  # the step that last used each slot, for LRU
        self.num_steps = 0
        self.num_swaps = 0  # adapters copied into a slot
        slot_bytes = sum(lin.a[:, 0].nbytes + lin.b_t[0].nbytes for _, lin in self.linears)
        logger.info("LoRA: %d slots of rank %d (%.1f MiB each), up to %d adapters cached on the CPU",
                    self.max_loras, self.max_rank, slot_bytes / 2**20, self.max_cpu_loras)

    # ---- the CPU cache ----

    def load(self, request: LoRARequest) -> LoRAAdapter:
        """The adapter, from the cache or read from its path (raises LoRAError)."""
        adapter = self.cache.get(request.lora_int_id)
        if adapter is not None:
            self.cache.move_to_end(request.lora_int_id)
            return adapter
        adapter = load_adapter(request, self.shapes, self.num_layers, self.max_rank, self.dtype)
        self.cache[request.lora_int_id] = adapter
        logger.info("loaded LoRA adapter %r (id %d, rank %d, %.1f MiB) from %s", request.lora_name,
                    request.lora_int_id, adapter.rank, adapter.num_bytes / 2**20, request.lora_path)
        for lora_id in [i for i in self.cache if not self.refs.get(i)]:
            if len(self.cache) <= self.max_cpu_loras:
                break
            if lora_id != request.lora_int_id:
                del self.cache[lora_id]  # its slot copy, if any, stays usable
        return adapter

    def acquire(self, request: LoRARequest) -> None:
        """A request that will run with this adapter: it stays cached until release()."""
        if request.lora_int_id in self.retiring:
            raise LoRAError(f"LoRA adapter {request.lora_name!r} (id {request.lora_int_id}) was unloaded")
        self.load(request)
        self.refs[request.lora_int_id] = self.refs.get(request.lora_int_id, 0) + 1

    def release(self, request: LoRARequest) -> None:
        lora_id = request.lora_int_id
        left = self.refs.get(lora_id, 0) - 1
        if left > 0:
            self.refs[lora_id] = left
            return
        self.refs.pop(lora_id, None)
        if lora_id in self.retiring:
            self._drop(lora_id)

    def remove(self, lora_int_id: int) -> bool:
        """Unloads an adapter; one still in use is dropped when its last request finishes. False if unknown."""
        known = lora_int_id in self.cache or lora_int_id in self.refs or lora_int_id in self.slots
        if self.refs.get(lora_int_id):
            self.retiring.add(lora_int_id)
        elif known:
            self._drop(lora_int_id)
        return known

    def _drop(self, lora_id: int) -> None:
        self.retiring.discard(lora_id)
        self.cache.pop(lora_id, None)
        for slot, held in enumerate(self.slots):
            if held == lora_id:
                self.slots[slot], self.slot_ranks[slot] = None, {}

    # ---- the slots, per step ----

    def prepare(self, requests: list, query_lens: list[int]) -> None:
        """Maps this step's tokens (requests in batch order, query_lens tokens each) to their adapters' slots."""
        batch = self.batch
        self.num_steps += 1
        wanted = [r.lora_request for r in requests]
        batch.active = any(wanted)
        if not batch.active:
            batch.segments, batch.ranks, batch.mask = None, {}, None
            return
        needed = {w.lora_int_id for w in wanted if w is not None}
        slot_of = {w.lora_int_id: self._slot_for(w, needed) for w in wanted if w is not None}
        starts = np.cumsum([0, *query_lens[:-1]])
        segments = np.array([(start, n, slot_of[w.lora_int_id]) for w, start, n in zip(wanted, starts, query_lens)
                             if w is not None], dtype=np.int64)
        batch.segments = torch.from_numpy(segments)
        ranks: dict[str, np.ndarray] = {}
        for slot in set(slot_of.values()):
            self.slot_used[slot] = self.num_steps
            for name, shard_ranks in self.slot_ranks[slot].items():
                ranks.setdefault(name, np.zeros((self.max_loras, len(shard_ranks)), dtype=np.int32))[slot] = shard_ranks
        batch.ranks = {name: torch.from_numpy(r) for name, r in ranks.items()}  # read on the host
        if self.ops is None:  # the torch path's one-hot rows
            mask = torch.zeros(sum(query_lens), self.max_loras, dtype=self.dtype, device=self.device)
            for first, count, slot in segments.tolist():
                mask[first:first + count, slot] = 1
            batch.mask = mask

    def _slot_for(self, request: LoRARequest, needed: set[int]) -> int:
        lora_id = request.lora_int_id
        if lora_id in self.slots:
            return self.slots.index(lora_id)
        free = [s for s, held in enumerate(self.slots) if held is None or held not in needed]
        if not free:  # the scheduler admits at most max_loras adapters among running requests
            raise RuntimeError(f"more than --max-loras {self.max_loras} adapters in one step")
        slot = min(free, key=lambda s: (self.slots[s] is not None, self.slot_used[s]))
        adapter = self.load(request)
        for layer, linear in self.linears:
            linear.set_slot(slot, adapter.weights.get((layer, linear.name)))
        ranks: dict[str, list[int]] = {}
        for (_, name), pairs in adapter.weights.items():
            shard_ranks = ranks.setdefault(name, [0] * len(pairs))
            for j, pair in enumerate(pairs):
                if pair is not None:
                    shard_ranks[j] = max(shard_ranks[j], pair[0].shape[0])
        self.slots[slot], self.slot_ranks[slot] = lora_id, ranks
        self.num_swaps += 1
        logger.debug("LoRA adapter %r into slot %d", request.lora_name, slot)
        return slot
