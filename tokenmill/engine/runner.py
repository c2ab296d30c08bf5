"""Owns the model and the KV tensors; turns a SchedulerOutput into one forward pass and sampled tokens."""
from __future__ import annotations

import gc
import logging
import math
import mmap
from dataclasses import dataclass, field

import numpy as np
import psutil
import torch

from tokenmill.config import EngineConfig, parse_memory
from tokenmill.engine.cuda_graph import DecodeCUDAGraphs, DecodeInputBuffers, capture_sizes
from tokenmill.engine.host_memory import discard_pages, keep_freed_memory_in_process, release_freed_memory
from tokenmill.engine.kv_blocks import BlockLayout, model_fingerprint
from tokenmill.engine.request import Request
from tokenmill.engine.sampler import Sampler, logprob_entries
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.engine.spec_decode.rejection_sampler import verify
from tokenmill.engine.transfer import to_device
from tokenmill.logprobs import TokenLogprobs
from tokenmill.lora.manager import LoRAManager
from tokenmill.models.attention import AttentionMetadata, CPUKernelBackend, TritonBackend, get_attention_backend
from tokenmill.models.kv_quant import is_one_byte, kv_storage_dtype, needs_calibration
from tokenmill.models.linear import has_second_copies, second_copy_bytes
from tokenmill.models.loader import ModelInfo, load_model, resolve_dtype

logger = logging.getLogger("tokenmill.runner")

CPU_DEFAULT_KV_BYTES = 4 * 1024**3  # vLLM-CPU's default KV space


@dataclass
class RunnerOutput:
    sampled: dict[str, int]  # request_id → token, for requests whose step reached the end of their tokens
    logprobs: dict[str, TokenLogprobs]
    prompt_logprobs: dict[str, list[TokenLogprobs | None]]
    pooled: dict[str, list[float]] = field(default_factory=dict)  # request_id → vector, for pooling requests
    # request_id → its accepted drafts and the token after them, for requests scheduled with drafts
    verified: dict[str, list[int]] = field(default_factory=dict)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def runner_device(config: EngineConfig) -> torch.device:
    """The device a runner computes on; on the CPU, with the allocator set up for steps (above)."""
    device = resolve_device(config.device)
    if config.gpu_memory_utilization is not None and device.type != "cuda":
        raise ValueError("--gpu-memory-utilization sizes the KV cache on CUDA; on the CPU use --kv-cache-memory")
    if device.type == "cpu":
        keep_freed_memory_in_process()
    return device


def kv_budget(config: EngineConfig, device_type: str, free: int, total: int) -> int:
    """The KV pool's bytes, with free and total memory measured after the weights loaded. --gpu-memory-utilization
    (vLLM's meaning): the pool takes what is left of that fraction of the GPU's total memory once everything already
    resident is counted."""
    if config.gpu_memory_utilization is not None:  # CUDA only: runner_device refuses it elsewhere
        budget = int(config.gpu_memory_utilization * total) - (total - free)
        if budget <= 0:
            raise ValueError(f"--gpu-memory-utilization {config.gpu_memory_utilization}: {(total - free) / 2**30:.2f} "
                             f"GiB of the GPU's {total / 2**30:.2f} GiB are already in use, which leaves no room for "
                             "the KV cache; raise it")
        return budget
    if config.kv_cache_memory == "auto":
        return int(0.8 * free) if device_type == "cuda" else min(CPU_DEFAULT_KV_BYTES, int(0.3 * free))
    return parse_memory(config.kv_cache_memory, free)


def zeroed(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """torch.zeros, but on the CPU in an anonymous mapping of its own, whose pages the kernel maps in zeroed on
    first touch: torch.zeros writes every byte, 4.3 s for the default 4 GiB pool on 2 cores (most of the
    start-up), where untouched pages cost nothing until a block is used. Same contents, so a block never written
    reads as zeros either way; and sleep (discard_pages) can give the pages back with every view kept valid."""
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    # the tensor keeps the mapping alive; the mapping is page-aligned, as discard_pages needs
    # (private: madvise frees a shared mapping's pages from this process only, and they read back unchanged)
    pages = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(pages, dtype=torch.uint8).view(dtype).view(shape)


class ModelRunner:
    def __init__(self, config: EngineConfig, info: ModelInfo, max_model_len: int):
        self.config = config
        self.device = runner_device(config)
        self.dtype = resolve_dtype(config.dtype, info.hf_config, self.device)
        self.block_size = config.block_size
        self._load_model = lambda: load_model(info, self.dtype, self.device, max_model_len, config.quantization)
        self.model = self._load_model()
        self.backend = get_attention_backend(config.attention_backend, self.device, self.dtype, self.block_size,
                                             self.model.head_dim)
        kernels = self.kernels = self.backend.ops if isinstance(self.backend, CPUKernelBackend) else None
        self.model.use_cpu_kernels(kernels)
        release_freed_memory()  # the load's transient copies (a oneDNN layout dropped for the single one, above)
        self.vocab_size = info.hf_config.vocab_size
        self.sampler = Sampler(self.vocab_size, self.device, config.seed, kernels)
        self.structured = None  # the engine's StructuredOutputManager
        self.pooler = None  # a PoolerConfig when a decoder runs with --runner pooling (set by the engine)
        self.lora = LoRAManager(self.model, config, self.dtype, self.device, kernels) if config.enable_lora else None
        self.kv_dtype = kv_storage_dtype(config.kv_cache_dtype, self.dtype)
        self.num_blocks = self._num_blocks(max_model_len)
        # CUDA graphs for decode steps (engine/cuda_graph.py): their padding rows write to one scratch block
        # past the scheduler's blocks
        graph_sizes = capture_sizes(config.cuda_graph_sizes, config.max_num_seqs)
        use_graphs = (self.device.type == "cuda" and not config.enforce_eager and not config.enable_lora
                      and isinstance(self.backend, TritonBackend) and bool(graph_sizes))
        layers, kv_heads = len(self.model.layers), self.model.num_kv_heads
        k_shape, v_shape = self.backend.kv_cache_shapes(self.num_blocks + use_graphs, self.block_size, kv_heads,
                                                        self.model.head_dim)
        # Per layer: K, V and their scales [2, kv_heads, head_dim] (read only for one-byte dtypes: kv_quant.py).
        self.kv_scales = torch.ones(layers, 2, kv_heads, self.model.head_dim, dtype=torch.float32,
                                    device=self.device)
        self.kv_caches = [(zeroed(k_shape, self.kv_dtype, self.device), zeroed(v_shape, self.kv_dtype, self.device),
                           self.kv_scales[i])
                          for i in range(layers)]
        self.backend.calibrating = needs_calibration(config.kv_cache_dtype, config.calculate_kv_scales)
        self.graphs = None
        self._max_model_len, self._graph_sizes = max_model_len, graph_sizes if use_graphs else []
        self._make_graphs()
        # sleep mode (POST /sleep, --enable-sleep-mode): "awake", "offloaded" (level 1: the caches built from the
        # weights are freed, the weights kept) or "discarded" (level 2: the weights are freed too)
        self.weights_state = "awake"
        self.kv_asleep = False
        logger.info("KV cache: dtype %s (%s), %d bytes per token, %d blocks of %d tokens = %d tokens, %.2f GiB",
                    config.kv_cache_dtype, str(self.kv_dtype).removeprefix("torch."),
                    self._block_bytes() // self.block_size, self.num_blocks, self.block_size,
                    self.num_blocks * self.block_size, self.num_blocks * self._block_bytes() / 1024**3)

    def _make_graphs(self) -> None:
        """CUDA graphs for decode steps (engine/cuda_graph.py), captured at start-up as vLLM does, so that no
        request waits for it; a one-byte KV cache whose scales the first forward pass sets is captured right after
        that pass (execute). Again at wake_up: a graph holds the addresses of the weights and the KV tensors."""
        if not self._graph_sizes:
            return
        buffers = DecodeInputBuffers(self._graph_sizes[-1], -(-self._max_model_len // self.block_size),
                                     self.block_size, self.num_blocks, self.device)
        self.graphs = DecodeCUDAGraphs(self.model, self.kv_caches, self.backend, self._graph_sizes, buffers)
        if not self.backend.calibrating:
            self.graphs.capture()

    # ---- sleep mode (--enable-sleep-mode; the engine's sleep/wake_up) ----

    def kv_cache_bytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for k, v, _ in self.kv_caches for t in (k, v))

    def second_copy_bytes(self) -> int:
        """What sleep level 1 frees of the weights: the small-M copies beside another copy (0 once freed)."""
        return second_copy_bytes(self.model) if self.model is not None else 0

    def sleep(self, level: int) -> None:
        """Frees the KV pool's memory, the CUDA graphs, and the small-M kernel's copies of the weights (rebuilt
        from the weights at wake_up); level 2 also drops the model, loaded again from the checkpoint at wake_up.
        The pool's tensors stay, so the tiers' BlockLayout (numpy views of the pool) and the graphs' references
        stay valid: on the CPU its pages go back to the OS at the same addresses (they read as zeros after), on
        CUDA its storage is resized to nothing. The KV scales (a few bytes per layer, set by a one-byte cache's
        first pass) are kept: wake_up restores the state exactly."""
        self.graphs = None
        if not self.kv_asleep:
            for k, v, _ in self.kv_caches:
                for t in (k, v):
                    if self.device.type == "cpu":  # zeroed()'s mapping: same addresses, pages returned
                        discard_pages(t.data_ptr(), t.untyped_storage().nbytes())
                    else:
                        t.untyped_storage().resize_(0)
            self.kv_asleep = True
        if level >= 2 and self.weights_state != "discarded":
            self.model = None
            from tokenmill.gguf_file import forget_readers
            forget_readers()  # the checkpoint's mapping goes too: its pages count in the process's RSS
            self.weights_state = "discarded"
        elif self.weights_state == "awake":
            if has_second_copies(self.model):  # where the small-M layout is the only copy, it stays
                self.model.use_cpu_kernels(None)  # drops the small-M copies and the fused stack's weight list
            self.weights_state = "offloaded"
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def wake_up(self, tags: set[str]) -> None:
        """Restores what sleep() freed, for the parts named ("weights", "kv_cache"): the KV pool as it was after
        start-up (zeros, empty), the model and its kernels' layouts; the CUDA graphs once both parts are awake."""
        if "weights" in tags and self.weights_state != "awake":
            if self.weights_state == "discarded":
                self.model = self._load_model()
            self.model.use_cpu_kernels(self.kernels)
            self.weights_state = "awake"
        if "kv_cache" in tags and self.kv_asleep:
            if self.device.type != "cpu":  # on the CPU the discarded pages read as zeros already
                for k, v, _ in self.kv_caches:
                    for t in (k, v):
                        t.untyped_storage().resize_(t.numel() * t.element_size())
                        t.zero_()
            self.kv_asleep = False
        if self.weights_state == "awake" and not self.kv_asleep and self.graphs is None:
            self._make_graphs()

    def block_layout(self, info: ModelInfo) -> BlockLayout:
        """The pool's blocks as bytes (engine/kv_blocks.py), named by everything that gives those bytes their
        meaning: the checkpoint, the dtypes, the weights' quantization, the attention backend's layout."""
        identity = {"model": model_fingerprint(info.path), "architecture": info.architecture,
                    "dtype": str(self.dtype), "kv_dtype": str(self.kv_dtype), "quantization": self.config.quantization,
                    "backend": type(self.backend).__name__, "block_size": self.block_size}
        return BlockLayout(self.kv_caches, identity, self.kv_scales if is_one_byte(self.kv_dtype) else None,
                           lambda: not self.backend.calibrating)

    def _block_bytes(self) -> int:
        per_token = 2 * len(self.model.layers) * self.model.num_kv_heads * self.model.head_dim
        return per_token * self.block_size * torch.tensor([], dtype=self.kv_dtype).element_size()

    def _num_blocks(self, max_model_len: int) -> int:
        if self.config.num_gpu_blocks_override:
            return self.config.num_gpu_blocks_override
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
        else:
            free, total = psutil.virtual_memory().available, psutil.virtual_memory().total
        num_blocks = kv_budget(self.config, self.device.type, free, total) // self._block_bytes()
        # More than every sequence at full length can never be used.
        useful = self.config.max_num_seqs * -(-max_model_len // self.block_size)
        num_blocks = min(num_blocks, useful)
        if num_blocks < -(-max_model_len // self.block_size):
            raise ValueError(f"the KV cache ({num_blocks} blocks of {self.block_size}) cannot hold one sequence "
                             f"of max_model_len={max_model_len}; raise --kv-cache-memory or lower --max-model-len")
        return int(num_blocks)

    def _metadata(self, order: list[Request], query_lens: list[int],
                  block_tables: dict[str, list[int]]) -> tuple[torch.Tensor, AttentionMetadata]:
        """The step's input ids and attention metadata, built in numpy and handed to torch without copies (on
        the CPU) or in one transfer (engine/transfer.py)."""
        bs = self.block_size
        starts = [r.num_computed_tokens for r in order]
        context_lens = [s + n for s, n in zip(starts, query_lens)]
        num_tokens = sum(query_lens)
        input_ids = np.empty(num_tokens, dtype=np.int64)
        positions = np.empty(num_tokens, dtype=np.int64)
        seq_of_token = np.empty(num_tokens, dtype=np.int64)
        tables = np.zeros((len(order), -(-max(context_lens) // bs)), dtype=np.int32)
        query_start_loc = np.zeros(len(order) + 1, dtype=np.int32)
        offset = 0
        for i, (r, start, ctx) in enumerate(zip(order, starts, context_lens)):
            end = offset + ctx - start
            if ctx - start == 1:
                input_ids[offset] = r.all_token_ids[start]
                positions[offset] = start
            else:
                # drafts follow the request's tokens; only this step's slice is copied, not the whole context
                input_ids[offset:end] = (r.all_token_ids[start:ctx] + r.spec_token_ids)[:ctx - start]
                positions[offset:end] = np.arange(start, ctx)
            seq_of_token[offset:end] = i
            num_blocks = -(-ctx // bs)
            tables[i, :num_blocks] = block_tables[r.request_id][:num_blocks]
            offset = query_start_loc[i + 1] = end
        slots = tables[seq_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        ids, positions, slots, query_start_loc, seq_lens, tables = to_device(
            [input_ids, positions, slots, query_start_loc, np.array(context_lens, dtype=np.int32), tables],
            self.device)
        meta = AttentionMetadata(
            positions=positions, slot_mapping=slots, query_start_loc=query_start_loc, seq_lens=seq_lens,
            block_tables=tables, num_decodes=sum(1 for n in query_lens if n == 1), query_lens=query_lens,
            context_lens=context_lens)
        return ids, meta

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_tables: dict[str, list[int]]) -> RunnerOutput:
        # Decodes first: the torch backend batches them into one call.
        order = sorted(sched.requests, key=lambda r: sched.num_scheduled_tokens[r.request_id] != 1)
        query_lens = [sched.num_scheduled_tokens[r.request_id] for r in order]
        logits_rows: list[int] = []
        sampling: list[Request] = []
        prompt_lp: list[tuple[Request, int, int]] = []  # (request, first flat index, count)
        pool_rows: list[tuple[Request, int, int]] = []  # the same, for pooling requests
        verifying: list[Request] = []  # requests with drafts: logits at their last token and every draft
        verify_rows: list[int] = []
        flat_start = 0
        for r, n in zip(order, query_lens):
            start, end = r.num_computed_tokens, r.num_computed_tokens + n
            if r.params.prompt_logprobs is not None and start < r.num_prompt_tokens:
                prompt_lp.append((r, flat_start, min(end, r.num_prompt_tokens) - start))
            if r.pooling is not None:  # scheduled whole (scheduler.py): its last row is its last token
                pool_rows.append((r, flat_start, n))
            elif r.spec_token_ids:
                verifying.append(r)
                verify_rows.extend(range(flat_start, flat_start + n))
            elif end == r.num_tokens:
                logits_rows.append(flat_start + n - 1)
                sampling.append(r)
            flat_start += n

        input_ids, meta = self._metadata(order, query_lens, block_tables)
        if self.lora is not None:  # which slot each token's adapter is in; none: the model's base path
            self.lora.prepare(order, query_lens)
        hidden = None
        if self.graphs is not None and self.graphs.graphs and meta.num_decodes == len(order) and not verifying:
            hidden = self.graphs.run(input_ids, meta)  # None: no captured size holds the batch
        if hidden is None:
            hidden = self.model(input_ids, self.kv_caches, meta, self.backend)
        if self.backend.calibrating:  # that was the first forward pass: the KV scales are set for good
            self.backend.calibrating = False
            logger.info("KV cache scales from the first step's %d tokens: K %.3g..%.3g, V %.3g..%.3g",
                        input_ids.shape[0], *self.kv_scales[:, 0].aminmax(), *self.kv_scales[:, 1].aminmax())
            if self.graphs is not None:
                self.graphs.capture()
        out = RunnerOutput({}, {}, {})
        if sampling or verifying:  # one lm_head call for the sampled rows and the verified ones
            rows = logits_rows + verify_rows
            all_logits = self.model.compute_logits(hidden[rows] if len(rows) < hidden.shape[0] else hidden)
            logits = all_logits[:len(logits_rows)]
        if verifying:
            for r, tokens in zip(verifying, verify(self.sampler, all_logits[len(logits_rows):], verifying)):
                out.verified[r.request_id] = tokens
        if sampling:
            constrain = None
            if self.structured is not None and self.structured.matchers:
                ids = [None if r.is_thinking else r.request_id for r in sampling]
                constrain = lambda lg: self.structured.apply_bitmask(lg, ids)  # noqa: E731
            result = self.sampler(logits, sampling, constrain)
            for r, tok, lp in zip(sampling, result.token_ids, result.logprobs):
                out.sampled[r.request_id] = tok
                if lp is not None:
                    out.logprobs[r.request_id] = lp
        for r, first, count in prompt_lp:
            out.prompt_logprobs[r.request_id] = self._prompt_logprobs(r, hidden[first:first + count])
        for r, first, count in pool_rows:
            out.pooled[r.request_id] = self.pooler.pool(hidden[first:first + count], [count],
                                                        [r.pooling.dimensions])[0]
        return out

    def _prompt_logprobs(self, r: Request, hidden: torch.Tensor) -> list[TokenLogprobs | None]:
        """Logprobs of prompt tokens start+1 .. start+count, given the hidden states at start .. start+count-1;
        the very first prompt token has none. Only the entries not yet returned: a request preempted in the middle
        of its prefill recomputes its prompt from the start, and its list continues where it stopped."""
        start, done = r.num_computed_tokens, r.num_prompt_logprobs
        first = max(start + 1, done)  # the first prompt token whose logprob is due
        targets = r.prompt_token_ids[first:start + 1 + hidden.shape[0]]
        entries: list[TokenLogprobs | None] = [None] if start == 0 == done else []
        if targets:
            rows = hidden[first - start - 1:first - start - 1 + len(targets)]
            logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
            ids = torch.tensor(targets, device=self.device)
            entries.extend(logprob_entries(logprobs, ids, [r.params.prompt_logprobs] * len(targets)))
        r.num_prompt_logprobs = done + len(entries)
        return entries
