"""CUDA graphs for decode steps (vLLM's --cuda-graph-sizes / --enforce-eager).

A decode step of a small model is mostly kernel-launch overhead: SmolLM2-135M runs ~250 kernels per step, each
a few microseconds on the GPU but ~5-10 us to launch from Python. A CUDA graph records the step's kernels once
and replays them with one launch. A graph replays fixed addresses and fixed shapes, so:
- Capture sizes: graphs are captured for a list of batch sizes (vLLM's rule, `capture_sizes`); a step of n
  decodes runs the graph of the next captured size up (`padded_size`), its extra rows padding; a step larger
  than the largest size, any step with a prefill chunk, LoRA, or speculative drafts runs eagerly.
- Persistent inputs (`DecodeInputBuffers`): input ids, positions, slots, sequence lengths and block tables live
  in tensors allocated once at the largest size; each step copies its rows in, and the graph of size s reads
  their first s rows. The block tables are one [max_size, max_blocks_per_seq] buffer, wide enough for
  max_model_len, so no step reallocates them.
- Padding rows are one-token sequences whose K/V go to a scratch block the KV cache holds beyond the scheduler's
  blocks (its id is the pool's size), so they never touch a real request's cache.
- The attention backend must take nothing from the host that changes between steps: the triton backend reads
  lengths from tensors and takes its split count from the batch size; torch_sdpa's host lengths are set to the
  table width (it then masks by the seq_lens tensor), which keeps it correct under replay too (the CPU tests).

The bookkeeping (sizes, padding, buffer reuse, replay reading the current step's inputs) is device-independent
and tested on the CPU with a stand-in graph (tests/test_cuda_graph.py); the capture itself runs under the
`cuda` marker."""
from __future__ import annotations

import bisect
import functools
import logging
import time
from collections.abc import Callable

import torch

from tokenmill.models.attention import AttentionMetadata

logger = logging.getLogger("tokenmill.cuda_graph")

def capture_sizes(cuda_graph_sizes: list[int], max_num_seqs: int) -> list[int]:
    """The batch sizes to capture, ascending: vLLM's rule (one value N: 1, 2, 4 and the multiples of 8 up to N;
    several values: those), none above max_num_seqs. An empty list: no graphs."""
    if len(cuda_graph_sizes) == 1:
        sizes = [1, 2, 4] + list(range(8, cuda_graph_sizes[0] + 1, 8))
        sizes = [s for s in sizes if s <= cuda_graph_sizes[0]]
    else:
        sizes = list(cuda_graph_sizes)
    if any(s < 1 for s in sizes):
        raise ValueError(f"--cuda-graph-sizes must be positive, got {cuda_graph_sizes}")
    return sorted({s for s in sizes if s <= max_num_seqs})


def padded_size(n: int, sizes: list[int]) -> int | None:
    """The smallest captured size >= n (sizes ascending), or None: n decodes run eagerly."""
    i = bisect.bisect_left(sizes, n)
    return sizes[i] if i < len(sizes) else None


class DecodeInputBuffers:
    """A decode step's inputs at fixed addresses, allocated once for the largest captured size."""

    def __init__(self, max_size: int, max_blocks_per_seq: int, block_size: int, scratch_block: int,
                 device: torch.device):
        self.block_size, self.scratch_block = block_size, scratch_block
        i64, i32 = dict(dtype=torch.int64, device=device), dict(dtype=torch.int32, device=device)
        self.input_ids = torch.zeros(max_size, **i64)
        self.positions = torch.zeros(max_size, **i64)
        self.slot_mapping = torch.full((max_size,), scratch_block * block_size, **i64)
        self.seq_lens = torch.ones(max_size, **i32)
        self.query_start_loc = torch.arange(max_size + 1, **i32)  # one query token per row, always
        self.block_tables = torch.full((max_size, max_blocks_per_seq), scratch_block, **i32)

    def fill(self, input_ids: torch.Tensor, meta: AttentionMetadata, size: int) -> None:
        """Copy a step's n decodes into rows :n; rows n:size become padding (a one-token sequence in the scratch
        block). Block-table columns past the step's width keep stale ids: a row reads only up to its length."""
        n, width = input_ids.shape[0], meta.block_tables.shape[1]
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(meta.positions, non_blocking=True)
        self.slot_mapping[:n].copy_(meta.slot_mapping, non_blocking=True)
        self.seq_lens[:n].copy_(meta.seq_lens, non_blocking=True)
        self.block_tables[:n, :width].copy_(meta.block_tables, non_blocking=True)
        self.pad(n, size)

    def pad(self, n: int, size: int) -> None:
        """Rows n:size become padding."""
        if size > n:
            self.input_ids[n:size] = 0
            self.positions[n:size] = 0
            self.slot_mapping[n:size] = self.scratch_block * self.block_size
            self.seq_lens[n:size] = 1
            self.block_tables[n:size, 0] = self.scratch_block

    def metadata(self, size: int) -> AttentionMetadata:
        """Views of the first `size` rows; host lengths at the table width (see the module docstring)."""
        full = self.block_tables.shape[1] * self.block_size
        return AttentionMetadata(self.positions[:size], self.slot_mapping[:size], self.query_start_loc[:size + 1],
                                 self.seq_lens[:size], self.block_tables[:size], num_decodes=size,
                                 query_lens=[1] * size, context_lens=[full] * size)


class TorchCUDAGraph:
    """One captured graph; all of a runner's graphs share one memory pool (largest captured first)."""

    def __init__(self, pool):
        self.graph, self.pool = torch.cuda.CUDAGraph(), pool

    def capture(self, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
        with torch.cuda.graph(self.graph, pool=self.pool):
            out = fn()
        return out

    def replay(self) -> None:
        self.graph.replay()


class DecodeCUDAGraphs:
    """Captures `model(input_ids, kv_caches, meta, backend)` for decode batches of each size and replays them.

    model(...) returns the hidden states [size, hidden]; run() returns the first n rows of the graph's output
    tensor (valid until the next run). make_graph: a factory of objects with capture(fn) -> output and replay()
    (TorchCUDAGraph on CUDA; the tests pass a stand-in that re-runs fn)."""

    def __init__(self, model, kv_caches, backend, sizes: list[int], buffers: DecodeInputBuffers,
                 make_graph: Callable[[], object] | None = None):
        self.model, self.kv_caches, self.backend = model, kv_caches, backend
        self.sizes, self.buffers = sizes, buffers
        self.graphs: dict[int, tuple[object, torch.Tensor]] = {}
        if make_graph is None:
            pool = torch.cuda.graph_pool_handle()
            make_graph = lambda: TorchCUDAGraph(pool)  # noqa: E731
        self.make_graph = make_graph

    def _forward(self, size: int) -> torch.Tensor:
        return self.model(self.buffers.input_ids[:size], self.kv_caches, self.buffers.metadata(size), self.backend)

    def capture(self) -> None:
        """Every size, largest first (the smaller graphs then fit in the pool the largest one reserved), each after
        an eager warm-up run (Triton compiles its kernels on first launch, which a capture cannot contain)."""
        start = time.perf_counter()
        self.buffers.pad(0, self.sizes[-1])
        for size in reversed(self.sizes):
            self._forward(size)
            graph = self.make_graph()
            self.graphs[size] = (graph, graph.capture(functools.partial(self._forward, size)))
        logger.info("CUDA graphs: captured %d decode batch sizes (%d..%d) in %.1f s", len(self.sizes),
                    self.sizes[0], self.sizes[-1], time.perf_counter() - start)

    def run(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor | None:
        """The hidden states of a decode-only step by graph replay, or None when no captured size holds it."""
        n = input_ids.shape[0]
        size = padded_size(n, self.sizes)
        if size is None or size not in self.graphs:
            return None
        self.buffers.fill(input_ids, meta, size)
        graph, out = self.graphs[size]
        graph.replay()
        return out[:n]
