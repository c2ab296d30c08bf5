"""vLLM's torch profiler (VLLM_TORCH_PROFILER_DIR): POST /start_profile and /stop_profile, or LLM.start_profile and
stop_profile, record everything the engine process runs in between (each step's ops, kernels and Python frames,
on the CPU and on CUDA when there is one) and write one Chrome trace per recording into the directory, for
chrome://tracing, Perfetto or TensorBoard."""
from __future__ import annotations

import logging
import os

import torch

from tokenmill import envs

logger = logging.getLogger("tokenmill.engine")


class TorchProfiler:
    def __init__(self) -> None:
        self.profile: torch.profiler.profile | None = None
        self.directory: str | None = None

    def start(self) -> None:
        directory = envs.VLLM_TORCH_PROFILER_DIR
        if directory is None:
            raise ValueError("profiling is off: set VLLM_TORCH_PROFILER_DIR to the directory for its traces")
        if self.profile is not None:
            raise ValueError("the profiler is already running: stop it first")
        os.makedirs(directory, exist_ok=True)
        self.directory = directory
        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.profile = torch.profiler.profile(
            activities=activities, record_shapes=envs.VLLM_TORCH_PROFILER_RECORD_SHAPES,
            with_stack=envs.VLLM_TORCH_PROFILER_WITH_STACK,
            profile_memory=envs.VLLM_TORCH_PROFILER_WITH_PROFILE_MEMORY,
            with_flops=envs.VLLM_TORCH_PROFILER_WITH_FLOPS,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(directory, worker_name="engine", use_gzip=True))
        self.profile.start()
        logger.info("profiling the engine into %s", directory)

    def stop(self) -> None:
        if self.profile is None:
            raise ValueError("the profiler is not running: start it first")
        profile, self.profile = self.profile, None
        profile.stop()  # writes the trace (on_trace_ready)
        logger.info("profile written to %s", self.directory)
