"""The Triton attention kernels (tokenmill/kernels/triton/attention.py) against the torch reference backend.

On any machine: the kernels run under Triton's interpreter at small shapes with small tiles (so sequences span
several key tiles, query tiles and decode splits). TRITON_INTERPRET is read when a kernel is decorated (at
import), so the interpreter runs in one child process (this file run as a script), which prints each case's
error; the tests here read them, and no other test sees the variable. With CUDA (marker `cuda`): the same cases
at real shapes and tiles on the GPU, in-process."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

# name: (query_lens, context_lens, kv_heads, q heads per kv head, head_dim, block_size, dtype, kv dtype, window)
# Decodes (query length 1) come first, as the runner orders them.
CASES = {
    "prefill": ([5, 19, 33], [5, 19, 33], 2, 3, 32, 4, "float32", "auto", None),
    "prefill_prefix_hits": ([7, 18], [30, 50], 2, 2, 32, 8, "float32", "auto", None),
    "decode": ([1, 1, 1, 1], [1, 9, 40, 77], 2, 3, 32, 4, "float32", "auto", None),
    "mixed": ([1, 1, 6, 21], [12, 45, 26, 21], 1, 4, 24, 8, "float32", "auto", None),
    "sliding_window": ([1, 1, 9, 30], [5, 60, 41, 30], 2, 2, 32, 4, "float32", "auto", 12),
    "fp8_kv": ([1, 1, 5, 17], [9, 50, 37, 17], 2, 2, 32, 8, "float32", "fp8_e4m3", None),
    "fp8_kv_window_bf16": ([1, 10], [40, 33], 2, 2, 32, 8, "bfloat16", "fp8_e4m3", 7),
    "int8_kv": ([1, 12], [30, 28], 1, 2, 32, 4, "float32", "int8", None),
}
INTERPRETER_TILES = dict(block_m=16, block_n=16, num_splits=3)
TOLERANCE = {"float32": 2e-5, "bfloat16": 4e-2}  # bf16: a few ulps of outputs near 1-2


def run_case(name: str, device: str, scale_up: int = 1, **tiles) -> float:
    """Max |triton - torch_sdpa| over one case's attention output; scale_up multiplies the lengths and heads."""
    from tokenmill.models.attention import AttentionMetadata, TorchSDPABackend, TritonBackend
    from tokenmill.models.kv_quant import as_bytes, kv_storage_dtype, quantize
    query_lens, context_lens, kv_heads, group, head_dim, block_size, dtype, kv_dtype, window = CASES[name]
    if scale_up > 1:  # real shapes: longer sequences (decodes stay one token), more heads, 16-token blocks
        context_lens = [c * scale_up for c in context_lens]
        query_lens = [1 if q == 1 else q * scale_up for q in query_lens]
        kv_heads, head_dim, block_size = kv_heads * 2, 64 if head_dim < 64 else head_dim, 16
        window = window and window * scale_up
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    dtype = getattr(torch, dtype)
    cache_dtype = kv_storage_dtype(kv_dtype, dtype)
    num_seqs, tokens = len(query_lens), sum(query_lens)
    widths = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(widths) + 3
    ids = torch.randperm(num_blocks, generator=g)  # each sequence's blocks scattered over the pool
    tables = torch.zeros(num_seqs, max(widths), dtype=torch.int32)
    used = 0
    for s, w in enumerate(widths):
        tables[s, :w] = ids[used:used + w]
        used += w
    positions = torch.cat([torch.arange(c - q, c) for q, c in zip(query_lens, context_lens)])
    seq_of = torch.repeat_interleave(torch.arange(num_seqs), torch.tensor(query_lens))
    slots = tables[seq_of, positions // block_size].long() * block_size + positions % block_size
    q = torch.randn(tokens, kv_heads * group, head_dim, generator=g).to(dtype)
    k = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(tokens, kv_heads, head_dim, generator=g).to(dtype)
    shape = (num_blocks, block_size, kv_heads, head_dim)
    scales = torch.ones(2, kv_heads, head_dim)
    if cache_dtype != dtype:  # one-byte: per-channel scales, the cached prefix stored as codes
        scales = 0.02 + torch.rand(2, kv_heads, head_dim, generator=g) * (0.05 if cache_dtype == torch.int8 else 1.0)
        k_cache = quantize(torch.randn(shape, generator=g), scales[0], cache_dtype)
        v_cache = quantize(torch.randn(shape, generator=g), scales[1], cache_dtype)
        as_bytes(k_cache).view(-1, kv_heads, head_dim)[slots] = as_bytes(quantize(k, scales[0], cache_dtype))
        as_bytes(v_cache).view(-1, kv_heads, head_dim)[slots] = as_bytes(quantize(v, scales[1], cache_dtype))
    else:
        k_cache, v_cache = torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)
        k_cache.view(-1, kv_heads, head_dim)[slots], v_cache.view(-1, kv_heads, head_dim)[slots] = k, v
    qsl = torch.zeros(num_seqs + 1, dtype=torch.int32)
    qsl[1:] = torch.tensor(query_lens).cumsum(0)
    to = dict(device=device)
    q, k, v, k_cache, v_cache, scales = (t.to(**to) for t in (q, k, v, k_cache, v_cache, scales))

    def meta() -> AttentionMetadata:
        return AttentionMetadata(positions.to(**to), slots.to(**to), qsl.to(**to),
                                 torch.tensor(context_lens, dtype=torch.int32, **to), tables.to(**to),
                                 num_decodes=sum(1 for n in query_lens if n == 1), query_lens=list(query_lens),
                                 context_lens=list(context_lens))

    softmax_scale = head_dim ** -0.5
    want = TorchSDPABackend()._attend(q, k, v, k_cache, v_cache, scales, meta(), softmax_scale, window)
    got = TritonBackend(**tiles)._attend(q, k, v, k_cache, v_cache, scales, meta(), softmax_scale, window)
    return (got.float() - want.float()).abs().max().item()


@pytest.fixture(scope="module")
def interpreted_errors() -> dict[str, float]:
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(
        [os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, os.path.abspath(__file__)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", list(CASES))
def test_interpreted_kernel_matches_torch(interpreted_errors, name):
    assert interpreted_errors[name] <= TOLERANCE[CASES[name][6]], interpreted_errors


def test_interpreter_stays_in_the_child():
    assert os.environ.get("TRITON_INTERPRET") in (None, "", "0")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("name", list(CASES))
def test_cuda_kernel_matches_torch(name):
    assert run_case(name, "cuda", scale_up=8) <= 4 * TOLERANCE[CASES[name][6]] + 2e-3 * (CASES[name][6] == "float32")


if __name__ == "__main__":  # the child process of interpreted_errors
    assert os.environ.get("TRITON_INTERPRET") == "1"
    print(json.dumps({name: run_case(name, "cpu", **INTERPRETER_TILES) for name in CASES}))
