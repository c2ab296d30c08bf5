"""One-byte KV caches (--kv-cache-dtype fp8_e4m3 | fp8_e5m2 | int8, tokenmill/models/kv_quant.py).

Kernels, for every ISA build this CPU runs: rope_and_cache's encode is bit-equal to torch's float8 casts
(saturating) and to round-half-even int8, and the keys it hands back are the model dtype's; paged_attention over
one-byte caches equals a float64 attention over the dequantized caches with this step's own K/V unquantized
(decode rows, prefill chunks over cached context, fresh prompts, split long decodes, GQA, sliding windows, blocks
in random order). Engine (slow): the pool holds >= 1.9x the tokens of bf16 in the same memory; teacher-forced
top-1 agreement with HF float32, by decode steps, >= 0.97 for fp8_e4m3 with --calculate-kv-scales (scale 1.0 and
int8 measured too); chunked prefill, prefix caching and preemption give the tokens of a plain run."""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from helpers import (greedy_generate, llm_sharing_weights, reference_attention, scattered_tables,
                     teacher_forced_agreement)
from tokenmill import SamplingParams
from tokenmill.kernels import load_ops, runnable_isas
from tokenmill.models.kv_quant import dequantize, quantize

ISAS = runnable_isas()
ONE_BYTE = [torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(params=ISAS, scope="module")
def ops(request):
    return load_ops(request.param)


def kernel_layout(k, v):
    """[blocks, block_size, kv_heads, D] → K [blocks, kv_heads, D, block_size], V [blocks, kv_heads, block_size, D]."""
    return k.permute(0, 2, 3, 1).contiguous(), v.permute(0, 2, 1, 3).contiguous()


def encode_inputs(cache_dtype) -> torch.Tensor:
    """Every finite fp8 value, the midpoints between neighbours (ties: round to even), a hair either side of
    them, subnormals, values past the largest (saturation) and random normals over many magnitudes. (No -0.0:
    RoPE's x * cos - y * sin turns it into +0.0 before the encode sees it.)"""
    if cache_dtype == torch.int8:
        grid = torch.arange(-140, 141, dtype=torch.float32)
        special = torch.cat([grid, grid + 0.5, grid + 0.4999, grid - 0.4999])
    else:
        codes = torch.arange(256, dtype=torch.uint8).view(cache_dtype).float()
        finite = codes[codes.isfinite()].unique()
        mids = (finite[1:] + finite[:-1]) / 2
        special = torch.cat([finite, mids, mids.nextafter(torch.tensor(float("inf"))),
                             mids.nextafter(torch.tensor(float("-inf"))), finite.max() * torch.tensor([1.01, 3, 1e6]),
                             -finite.max() * torch.tensor([1.01, 3, 1e6])])
    g = torch.Generator().manual_seed(0)
    spread = torch.randn(4096, generator=g) * torch.exp2(torch.randint(-20, 18, (4096,), generator=g).float())
    x = torch.cat([special, spread])
    return torch.cat([x, torch.zeros(-len(x) % 64)])


@pytest.mark.parametrize("cache_dtype", ONE_BYTE)
@pytest.mark.parametrize("scale", [1.0, 0.37])
def test_encode_is_bit_equal_to_torch(ops, cache_dtype, scale):
    """rope_and_cache with identity RoPE tables writes x / scale as torch casts it: fp8 by torch's own
    float8 cast (round to nearest even, subnormals), clamped to the largest finite value first; int8 by
    round-half-even and clamp to +-127. K (transposed layout) and V (row layout) both."""
    x = encode_inputs(cache_dtype)
    head_dim, tokens = 64, len(x) // 64
    k = x.view(tokens, 1, head_dim)
    v = x.flip(0).view(tokens, 1, head_dim)
    qkv = torch.cat([torch.zeros(tokens, head_dim), k.flatten(1), v.flatten(1)], 1)
    block_size = 16
    blocks = -(-tokens // block_size)
    k_cache, v_cache = kernel_layout(*[torch.zeros(blocks, block_size, 1, head_dim, dtype=cache_dtype)] * 2)
    channel = torch.ones(head_dim) if scale == 1.0 else torch.linspace(0.5, 2.0, head_dim)  # per-channel scales
    scales = torch.stack([scale * channel, 2 * scale * channel]).view(2, 1, head_dim)
    cos, sin = torch.ones(1, head_dim), torch.zeros(1, head_dim)
    ops.rope_and_cache(qkv, torch.zeros(tokens, dtype=torch.long), cos, sin, k_cache, v_cache,
                       torch.arange(tokens), torch.empty(tokens, 1, head_dim), None, None, 1e-6, scales)
    got_k = k_cache.view(torch.uint8).permute(0, 3, 1, 2).reshape(-1, 1, head_dim)[:tokens]
    got_v = v_cache.view(torch.uint8).reshape(-1, 1, head_dim)[:tokens]
    largest = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0, torch.int8: 127.0}[cache_dtype]
    for got, src, s in ((got_k, k, scales[0]), (got_v, v, scales[1])):
        y = src * s.reciprocal()
        if cache_dtype == torch.int8:
            want = y.round().clamp(-127, 127).to(torch.int8)
        else:
            want = y.clamp(-largest, largest).to(cache_dtype)
            inside = y.abs() <= largest  # where no clamp applies: torch's cast of the value itself
            assert torch.equal(got[inside], y[inside].to(cache_dtype).view(torch.uint8))
        mismatch = (got != want.view(torch.uint8)).nonzero()
        assert len(mismatch) == 0, f"{len(mismatch)} codes differ, first for {y[tuple(mismatch[0])]}"
        assert torch.equal(got, quantize(src, s, cache_dtype).view(torch.uint8))  # the torch backend's writer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_and_cache_hands_back_the_keys_it_quantizes(ops, dtype):
    """k_out (paged_attention's `key`): every token's K after the q/k norms and RoPE, bit-equal to what a cache of
    the model's dtype holds, also for tokens whose slot is -1 (not written)."""
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, head_dim, tokens, block_size, num_blocks = 6, 2, 64, 37, 16, 10
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 500, (tokens,), generator=g)
    freqs = torch.outer(torch.arange(512).float(), torch.rand(head_dim // 2, generator=g))
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    q_w, k_w = torch.rand(head_dim, generator=g).to(dtype), torch.rand(head_dim, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[3] = -1
    args = (torch.empty(tokens, heads, head_dim, dtype=dtype), q_w, k_w, 1e-6)
    native = kernel_layout(*[torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)] * 2)
    ops.rope_and_cache(qkv, positions, cos, sin, *native, torch.arange(tokens), *args)  # every token written
    want = native[0].permute(0, 3, 1, 2).reshape(-1, kv_heads, head_dim)[:tokens]
    one_byte = kernel_layout(*[torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=torch.int8)] * 2)
    k_out = torch.full((tokens, kv_heads, head_dim), float("nan"), dtype=dtype)
    ops.rope_and_cache(qkv, positions, cos, sin, *one_byte, slots, *args, torch.ones(2, kv_heads, head_dim), k_out)
    assert torch.equal(k_out, want)


def random_batch(rng: random.Random, block_size: int, kinds: list[str]):
    seqs = []
    for kind in kinds:
        ctx = {"decode": rng.randint(1, 200), "chunk": rng.randint(20, 300), "prompt": rng.randint(1, 90),
               "long": rng.randint(1100, 1900), "boundary": block_size * rng.randint(1, 6)}[kind]
        q_len = {"decode": 1, "chunk": rng.randint(2, min(ctx, 70)), "prompt": ctx, "long": 1,
                 "boundary": rng.choice([1, block_size])}[kind]
        seqs.append((ctx, q_len))
    return seqs


@pytest.mark.parametrize("cache_dtype", ONE_BYTE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_paged_attention_on_one_byte_caches(ops, cache_dtype, dtype, seed):
    rng = random.Random(seed)
    head_dim = rng.choice([64, 128])
    kv_heads = rng.choice([1, 2, 3])
    heads = kv_heads * rng.choice([1, 3, 4])
    block_size = rng.choice([16, 32])
    window = 50 if seed == 1 else None  # Gemma 3's local layers
    kinds = ["decode", "chunk", "prompt", "boundary", "boundary"] + (["long"] if seed == 2 else ["decode"])
    seqs = random_batch(rng, block_size, kinds)
    if seed == 0:
        seqs = seqs[-1:] + [(1500, 1)]  # a long decode alone in its batch: split along its context
    g = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-c // block_size) for c, _ in seqs) + 3
    tables = scattered_tables([c for c, _ in seqs], block_size, num_blocks, g)
    qsl = [0, *itertools.accumulate(q_len for _, q_len in seqs)]
    # heads of different magnitudes and an outlier channel, with per-channel scales
    magnitude = torch.tensor([0.5, 3.0, 12.0])[:kv_heads, None] * torch.ones(head_dim)
    magnitude[:, 5] *= 20
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g) * magnitude
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g) * magnitude
    largest = 127.0 if cache_dtype == torch.int8 else 448.0
    scales = torch.stack([k.abs().amax(dim=(0, 1)), v.abs().amax(dim=(0, 1))]) / largest
    kq, vq = quantize(k, scales[0], cache_dtype), quantize(v, scales[1], cache_dtype)
    q = torch.randn(qsl[-1], heads, head_dim, generator=g).to(dtype)
    seq_lens = [c for c, _ in seqs]
    # this step's own keys (the last q_len of each sequence) are handed in unquantized, in the query's dtype
    slots = torch.tensor([tables[s][p // block_size] * block_size + p % block_size
                          for s, (ctx, q_len) in enumerate(seqs) for p in range(ctx - q_len, ctx)])
    new_k = k.flatten(0, 1)[slots].to(dtype)
    new_v = torch.zeros(len(slots), 3 * kv_heads, head_dim, dtype=dtype)[:, 2 * kv_heads:]  # rows strided, as in qkv
    new_v.copy_(v.flatten(0, 1)[slots])
    out = torch.full_like(q, float("nan"))
    ops.paged_attention(out, q, *kernel_layout(kq, vq), torch.tensor(tables, dtype=torch.int32),
                        torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),
                        head_dim ** -0.5 / 4, window or 0, scales, new_k, new_v)
    stored_k, stored_v = dequantize(kq, scales[0], torch.float32), dequantize(vq, scales[1], torch.float32)
    fresh_k, fresh_v = stored_k.clone(), stored_v.clone()
    fresh_k.view(-1, kv_heads, head_dim)[slots] = new_k.float()
    fresh_v.view(-1, kv_heads, head_dim)[slots] = new_v.float()
    ref = reference_attention(q, fresh_k, fresh_v, tables, seq_lens, qsl, head_dim ** -0.5 / 4, window)
    # tolerance in each output channel's own units (its head's and channel's magnitude)
    tol = TOL[dtype] * (magnitude.repeat_interleave(heads // kv_heads, 0).double() + ref.abs())
    err = (out.double() - ref).abs()
    assert (err <= tol).all(), f"max error {float((err / tol).max()):.2f}x the tolerance"
    # the quantization is really there: the same attention over the unquantized caches differs; and in float32,
    # reading this step's keys from the cache instead (quantized) would miss the tolerance
    exact = reference_attention(q, k, v, tables, seq_lens, qsl, head_dim ** -0.5 / 4, window)
    assert (ref - exact).abs().max() > 1e-3
    stale = reference_attention(q, stored_k, stored_v, tables, seq_lens, qsl, head_dim ** -0.5 / 4, window)
    assert dtype == torch.bfloat16 or ((stale - ref).abs() > tol).any()
    # without the step's K/V every key is read as stored
    ops.paged_attention(out, q, *kernel_layout(kq, vq), torch.tensor(tables, dtype=torch.int32),
                        torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),
                        head_dim ** -0.5 / 4, window or 0, scales)
    assert ((out.double() - stale).abs() <= tol).all()


# ---- engine level (slow: the default model, HF's float32 reference) ----

@pytest.mark.slow
def test_one_byte_pool_holds_twice_the_tokens_of_bf16():
    tokens = {}
    for kv in ("auto", "fp8_e4m3", "int8"):
        llm = llm_sharing_weights(dtype="bfloat16", kv_cache_memory="512MiB", kv_cache_dtype=kv)
        tokens[kv] = llm.engine.kv_cache.num_blocks * llm.engine.kv_cache.block_size
        assert llm.engine.runner.kv_caches[0][0].element_size() == (2 if kv == "auto" else 1)
        del llm
    print(f"\ntokens in 512 MiB: {tokens}")
    assert tokens["fp8_e4m3"] >= 1.9 * tokens["auto"] and tokens["int8"] >= 1.9 * tokens["auto"]


@pytest.mark.parametrize("kv,calculate,floor", [("fp8_e4m3", False, 0.95), ("fp8_e4m3", True, 0.97),
                                                ("int8", False, 0.97)])
def test_agreement_with_hf_float32(prompts, hf_continuations, kv, calculate, floor):
    """The float32 model with a one-byte KV cache against HF float32: only the KV quantization differs. Teacher
    forcing by decode steps (helpers): each continuation token reads every token before it from the cache,
    quantized, as decoding does. (In one prefill a chunk attends its own K/V unquantized, so the single-pass
    measure gives ~1.0 and says little about the cache.) The first step, which sets the scales, is the prompts'
    prefill, as a server's first batch would be. Measured over 512 positions (the 8 continuations decoded in one
    batch; a request at a time gave 0.963, 0.977 and 0.984): fp8_e4m3 0.961 (scale 1.0) and 0.975
    (--calculate-kv-scales), int8 0.980, auto 1.0. e4m3 keeps 3 mantissa bits (a relative error up to 1/16 per
    element, whatever the scale), and this 135M model's top-1 is that sensitive."""
    llm = llm_sharing_weights(dtype="float32", kv_cache_dtype=kv, calculate_kv_scales=calculate)
    assert llm.engine.runner.kv_caches[0][0].element_size() == 1
    llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1), use_tqdm=False)
    top1, strict = teacher_forced_agreement(llm, prompts, hf_continuations, decode_steps=True)
    print(f"\n{kv} KV (calculate_kv_scales={calculate}), float32 model, vs HF fp32: teacher-forced top-1 by decode "
          f"steps {top1:.3f} (strict {strict:.3f}) over {sum(map(len, hf_continuations))} positions")
    assert top1 >= floor


@pytest.mark.slow
def test_chunked_prefill_prefix_caching_and_preemption_on_fp8(prompts, prefix_prompts):
    """Chunks of 32 tokens, prefix hits and recomputation after preemption on an fp8 cache give the tokens of the
    torch_sdpa backend on the same schedule: it gathers the blocks a sequence's table names, dequantizes them and
    puts the step's own K/V in place of their copies, an implementation of the same reads apart from the kernel's.
    (Not those of a plain run any more: a step attends its own keys unquantized, so where a prompt is cut into
    chunks, a chunk reads the earlier chunks' keys quantized, and this 135M model's continuations fork at near-ties
    within a few tokens.) Float noise between the two backends now and then moves a value across an fp8 rounding
    boundary and flips a near-tie late in a continuation; wrong blocks or scales would change them at once."""
    schedule = dict(dtype="float32", kv_cache_dtype="fp8", max_num_batched_tokens=32, num_gpu_blocks_override=40)
    torch_sdpa = llm_sharing_weights(attention_backend="torch_sdpa", **schedule)
    want = [o.outputs[0].token_ids for o in greedy_generate(torch_sdpa, prompts + prefix_prompts)]
    del torch_sdpa
    llm = llm_sharing_weights(attention_backend="cpu", **schedule)
    got = [o.outputs[0].token_ids for o in greedy_generate(llm, prompts + prefix_prompts)]
    stats = llm.engine.stats()
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hits"] > 0
    same = sum(g == w for g, w in zip(got, want))
    print(f"\nfp8 chunked/prefix/preempted, cpu kernels vs torch_sdpa: {same} of {len(want)} continuations identical")
    assert all(g[:8] == w[:8] for g, w in zip(got, want)) and same >= len(want) - 3


def test_cache_config_info_carries_the_kv_dtype():
    """vllm:cache_config_info's cache_dtype label is the flag's value, as vLLM's; the engine sends it at start-up."""
    import msgspec
    from prometheus_client import generate_latest

    from tokenmill.engine.messages import EngineReady
    from tokenmill.server.metrics import ServerMetrics
    ready = EngineReady(512, 49152, 20, "fcfs", 2912, 16, True, cache_dtype="fp8_e4m3")
    ready = msgspec.msgpack.decode(msgspec.msgpack.encode(ready), type=EngineReady)
    metrics = ServerMetrics("m", ready.max_model_len, ready.num_blocks, ready.block_size,
                            ready.enable_prefix_caching, ready.cache_dtype)
    text = generate_latest(metrics.registry).decode()
    line = next(line for line in text.splitlines() if line.startswith("vllm:cache_config_info{"))
    assert 'cache_dtype="fp8_e4m3"' in line and 'num_gpu_blocks="2912"' in line
