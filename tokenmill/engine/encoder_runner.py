"""The runner of encoder models (BERT and its family): a step is a batch of whole prompts, encoded and pooled.

It stands in for ModelRunner (same constructor, `execute` and attributes the engine reads) but holds no KV
tensors: an encoder attends both ways over its whole input in one step, so nothing is kept between steps. The
scheduler's block bookkeeping still runs (it is what bounds a step), over blocks that exist only as numbers."""
from __future__ import annotations

import logging

import numpy as np
import torch

from tokenmill.config import EngineConfig
from tokenmill.engine.runner import RunnerOutput, runner_device
from tokenmill.engine.scheduler import SchedulerOutput
from tokenmill.models.loader import ModelInfo, checkpoint_dtype, load_model, resolve_dtype
from tokenmill.models.pooler import PoolerConfig

logger = logging.getLogger("tokenmill.runner")


def encoder_dtype(name: str, hf_config, device: torch.device) -> torch.dtype:
    """`auto` is the checkpoint's dtype, float32 when it names none (vLLM's rule): an embedding is compared by
    cosine with ones computed elsewhere, and bf16 on CPU moves it by ~1e-3 for a few percent of speed on a small
    encoder."""
    if name != "auto":
        return resolve_dtype(name, hf_config, device)
    configured = checkpoint_dtype(hf_config)
    return configured if isinstance(configured, torch.dtype) else torch.float32


class EncoderRunner:
    def __init__(self, config: EngineConfig, info: ModelInfo, max_model_len: int):
        device = runner_device(config)
        dtype = encoder_dtype(config.dtype, info.hf_config, device)
        self.config, self.device, self.dtype, self.block_size = config, device, dtype, config.block_size
        self.model = load_model(info, dtype, device, max_model_len)
        self.pooler: PoolerConfig | None = None  # set by the engine
        self.vocab_size = info.hf_config.vocab_size
        self.structured = None  # the engine sets it; encoders never sample
        # bookkeeping only: every sequence at full length
        self.num_blocks = config.max_num_seqs * -(-max_model_len // self.block_size)
        logger.info("encoder %s, dtype %s, no KV cache", info.architecture, self.dtype)

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput, block_tables: dict[str, list[int]]) -> RunnerOutput:
        seq_lens = [len(r.prompt_token_ids) for r in sched.requests]
        input_ids = np.concatenate([np.asarray(r.prompt_token_ids, dtype=np.int64) for r in sched.requests])
        positions = np.concatenate([np.arange(n, dtype=np.int64) for n in seq_lens])
        hidden = self.model(torch.from_numpy(input_ids).to(self.device), torch.from_numpy(positions).to(self.device),
                            seq_lens)
        pooled = self.pooler.pool(hidden, seq_lens, [r.pooling.dimensions for r in sched.requests])
        return RunnerOutput({}, {}, {}, {r.request_id: v for r, v in zip(sched.requests, pooled)})
