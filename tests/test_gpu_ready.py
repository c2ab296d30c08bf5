"""The GPU-ready engine loop's host-side pieces: --dtype auto on CUDA, the one-transfer step inputs
(tokenmill/engine/transfer.py); on CUDA (marker `cuda`) the transfer itself and a sampler step without syncs."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from transformers import LlamaConfig

from tokenmill.engine.transfer import to_device
from tokenmill.models.loader import resolve_dtype


@pytest.mark.parametrize("checkpoint", [None, "float32", "float16", "bfloat16"])
def test_dtype_auto_is_bfloat16_on_cuda(checkpoint):
    config = LlamaConfig(dtype=checkpoint) if checkpoint else LlamaConfig()
    assert resolve_dtype("auto", config, torch.device("cuda")) == torch.bfloat16
    assert resolve_dtype("float16", config, torch.device("cuda")) == torch.float16


@pytest.mark.parametrize("fast_bf16", [True, False])
@pytest.mark.parametrize("checkpoint", [None, "float32", "float16", "bfloat16"])
def test_dtype_auto_on_cpu_follows_the_cpu_not_the_checkpoint(checkpoint, fast_bf16, monkeypatch):
    """The README's --dtype row: on the CPU, auto is bfloat16 where the CPU has AMX/AVX512-BF16, float32 elsewhere,
    whatever the checkpoint says; vLLM's aliases half and float name float16 and float32."""
    from tokenmill.models import loader
    monkeypatch.setattr(loader, "cpu_has_fast_bf16", lambda: fast_bf16)
    config = LlamaConfig(dtype=checkpoint) if checkpoint else LlamaConfig()
    assert resolve_dtype("auto", config, torch.device("cpu")) == (torch.bfloat16 if fast_bf16 else torch.float32)
    assert resolve_dtype("half", config, torch.device("cpu")) == torch.float16
    assert resolve_dtype("float", config, torch.device("cuda")) == torch.float32


def arrays():
    return [np.arange(5, dtype=np.int64), np.array([3, 1], dtype=np.int32), np.ones((3, 7), dtype=np.int32),
            np.array([[0.5, 1.5]], dtype=np.float32), np.arange(0, dtype=np.int64)]


def test_to_device_on_cpu_shares_the_arrays():
    host = arrays()
    out = to_device(host, torch.device("cpu"))
    for a, t in zip(host, out):
        assert t.data_ptr() == torch.from_numpy(a).data_ptr() or a.size == 0
        assert np.array_equal(t.numpy(), a)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_to_device_on_cuda_is_one_buffer():
    host = arrays()
    out = to_device(host, torch.device("cuda"))
    for a, t in zip(host, out):
        assert t.is_cuda and t.dtype == torch.from_numpy(a).dtype and np.array_equal(t.cpu().numpy(), a)
    assert len({t.untyped_storage().data_ptr() for t in out}) == 1
