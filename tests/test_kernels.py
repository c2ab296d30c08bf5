"""Each CPU kernel against a torch reference, over random shapes, block tables and context lengths, in float32
and bfloat16, for every ISA build this CPU can run (AVX-512 machines run the AVX2 build too)."""
from __future__ import annotations

import itertools
import random

import pytest
import torch
import torch.nn.functional as F

from helpers import reference_attention, scattered_tables
from tokenmill.kernels import load_ops, runnable_isas

ISAS = runnable_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="this CPU runs neither kernel build")
TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


@pytest.fixture(params=ISAS, scope="module")
def ops(request):
    return load_ops(request.param)


def to_kernel_layout(k_cache, v_cache):
    """[blocks, block_size, kv_heads, D] → the kernels' K [blocks, kv_heads, D, block_size], V [..., block_size, D]."""
    return k_cache.permute(0, 2, 3, 1).contiguous(), v_cache.permute(0, 2, 1, 3).contiguous()


def from_kernel_layout(k_kernel, v_kernel):
    return k_kernel.permute(0, 3, 1, 2), v_kernel.permute(0, 2, 1, 3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(6))
def test_paged_attention_matches_reference(ops, dtype, seed):
    rng = random.Random(seed)
    head_dim = rng.choice([32, 64, 128, 256])
    kv_heads = rng.choice([1, 2, 3])
    heads = kv_heads * rng.choice([1, 3, 4])
    block_size = rng.choice([16, 32, 64])
    num_blocks = 300
    # decode rows, chunks with cached context, fresh prompts, long contexts that get split
    seqs = []
    for _ in range(rng.randint(1, 7)):
        kind = rng.choice(["decode", "chunk", "prompt", "long"])
        ctx = {"decode": rng.randint(1, 200), "chunk": rng.randint(20, 300), "prompt": rng.randint(1, 90),
               "long": rng.randint(1100, 1900)}[kind]
        q_len = {"decode": 1, "chunk": rng.randint(2, min(ctx, 70)), "prompt": ctx, "long": 1}[kind]
        seqs.append((ctx, q_len))
    blocks_needed = sum(-(-c // block_size) for c, _ in seqs)
    if blocks_needed > num_blocks:
        seqs = seqs[:1]
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    width = max(-(-c // block_size) for c, _ in seqs) + 2
    tables, used = [], 0
    for ctx, _ in seqs:
        n = -(-ctx // block_size)
        tables.append(perm[used:used + n] + [0] * (width - n))
        used += n
    qsl = [0]
    for _, q_len in seqs:
        qsl.append(qsl[-1] + q_len)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(qsl[-1], heads, head_dim, generator=g).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    seq_lens = [c for c, _ in seqs]
    scale = head_dim ** -0.5
    out = torch.full_like(q, float("nan"))
    k_kernel, v_kernel = to_kernel_layout(k_cache, v_cache)
    ops.paged_attention(out, q, k_kernel, v_kernel, torch.tensor(tables, dtype=torch.int32),
                        torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32), scale)
    ref = reference_attention(q, k_cache, v_cache, tables, seq_lens, qsl, scale)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads,group", [(1, 3), (3, 3), (2, 1)])
def test_long_decode_split_across_threads(ops, dtype, kv_heads, group):
    """One or two long decodes: the kernel splits the context into parts and merges them."""
    g = torch.Generator().manual_seed(kv_heads)
    block_size, head_dim, seq_lens = 16, 64, [2000, 777][:3 - kv_heads if kv_heads < 3 else 1]
    num_blocks = sum(-(-c // block_size) for c in seq_lens)
    tables = scattered_tables(seq_lens, block_size, num_blocks, g)
    qsl = list(range(len(seq_lens) + 1))
    q = torch.randn(len(seq_lens), kv_heads * group, head_dim, generator=g).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    out = torch.full_like(q, float("nan"))
    ops.paged_attention(out, q, *to_kernel_layout(k_cache, v_cache), torch.tensor(tables, dtype=torch.int32),
                        torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32), 0.125)
    ref = reference_attention(q, k_cache, v_cache, tables, seq_lens, qsl, 0.125)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [1, 5, 16, 100, 512])
def test_paged_attention_sliding_window(ops, dtype, window):
    """Gemma 3's local layers: each row sees only the last `window` keys up to itself, in decode rows (short,
    and long enough to be split across threads), prefill chunks over cached context, and fresh prompts longer
    than the window; block tables in random order."""
    block_size, head_dim, kv_heads, group = 16, 64, 1, 4
    seqs = [(1, 1), (window, 1), (window + 1, 1), (1500, 1), (700, 40), (300, 300), (window + 3, window + 3)]
    g = torch.Generator().manual_seed(window)
    num_blocks = sum(-(-c // block_size) for c, _ in seqs)
    tables = scattered_tables([c for c, _ in seqs], block_size, num_blocks, g)
    qsl = [0, *itertools.accumulate(q_len for _, q_len in seqs)]
    q = torch.randn(qsl[-1], kv_heads * group, head_dim, generator=g).to(dtype)
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    seq_lens = [c for c, _ in seqs]
    out = torch.full_like(q, float("nan"))
    ops.paged_attention(out, q, *to_kernel_layout(k_cache, v_cache), torch.tensor(tables, dtype=torch.int32),
                        torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32), 0.125, window)
    ref = reference_attention(q, k_cache, v_cache, tables, seq_lens, qsl, 0.125, window)
    torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("path", ["vector", "amx_bf16", "avx512_bf16"])
@pytest.mark.parametrize("head_dim,kv_heads,group,window", [(64, 3, 3, 0), (64, 1, 4, 100), (128, 2, 1, 0),
                                                            (64, 1, 8, 5), (128, 1, 4, 0)])
def test_paged_attention_prefill_paths(ops, path, head_dim, kv_heads, group, window):
    """bf16 prefill tiles on each path: the float32 FMAs, AMX-BF16 tile products and vdpbf16ps pairs (where the
    CPU runs them; attention_select_path forces one). Prompts, chunks over cached context that start and end
    mid-block, decode rows beside them, with and without a window; the pool's slots past each context hold NaN,
    which no path may let through (the pair paths multiply whole tiles and key pairs)."""
    try:
        previous = ops.attention_select_path(path)
    except RuntimeError as e:
        if "does not run" not in str(e):  # an unknown path fails
            raise
        pytest.skip(str(e))
    try:
        g = torch.Generator().manual_seed(head_dim * group + window)
        block_size, dtype = 16, torch.bfloat16
        seqs = [(300, 300), (1003, 37), (700, 64), (90, 1), (17, 17), (1500, 130), (5, 5)]
        num_blocks = sum(-(-c // block_size) for c, _ in seqs) + 4
        tables = scattered_tables([c for c, _ in seqs], block_size, num_blocks, g)
        qsl = [0, *itertools.accumulate(q_len for _, q_len in seqs)]
        q = torch.randn(qsl[-1], kv_heads * group, head_dim, generator=g).to(dtype)
        k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
        v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
        for (ctx, _), table in zip(seqs, tables):
            last = table[(ctx - 1) // block_size]
            k_cache[last, (ctx - 1) % block_size + 1:] = float("nan")
            v_cache[last, (ctx - 1) % block_size + 1:] = float("nan")
        seq_lens = [c for c, _ in seqs]
        out = torch.full_like(q, float("nan"))
        ops.paged_attention(out, q, *to_kernel_layout(k_cache, v_cache), torch.tensor(tables, dtype=torch.int32),
                            torch.tensor(seq_lens, dtype=torch.int32), torch.tensor(qsl, dtype=torch.int32),
                            head_dim ** -0.5, window)
        ref = reference_attention(q, k_cache.nan_to_num(), v_cache.nan_to_num(), tables, seq_lens, qsl,
                                  head_dim ** -0.5, window or None)
        torch.testing.assert_close(out.double(), ref, atol=TOL[dtype], rtol=TOL[dtype])
    finally:
        ops.attention_select_path("vector" if previous == "vector" else "auto")


def reference_rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_cache(ops, dtype, qk_norm):
    g = torch.Generator().manual_seed(1)
    heads, kv_heads, head_dim, tokens, block_size, num_blocks = 6, 2, 64, 37, 16, 10
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 500, (tokens,), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.outer(torch.arange(512).float(), inv)
    cos, sin = torch.cat((freqs, freqs), -1).cos(), torch.cat((freqs, freqs), -1).sin()
    slots = torch.randperm(num_blocks * block_size, generator=g)[:tokens]
    slots[3] = -1  # padding: not written
    k_cache, v_cache = to_kernel_layout(*[torch.zeros(num_blocks, block_size, kv_heads, head_dim, dtype=dtype)] * 2)
    q_out = torch.empty(tokens, heads, head_dim, dtype=dtype)
    q_w = k_w = None
    q, k, v = qkv.float().split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    q, k, v = q.view(tokens, heads, head_dim), k.view(tokens, kv_heads, head_dim), v.view(tokens, kv_heads, head_dim)
    if qk_norm:
        q_w, k_w = torch.rand(head_dim, generator=g).to(dtype), torch.rand(head_dim, generator=g).to(dtype)
        q = q * torch.rsqrt(q.pow(2).mean(-1, keepdim=True) + 1e-6) * q_w.float()
        k = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6) * k_w.float()
    c, s = cos[positions][:, None], sin[positions][:, None]
    ops.rope_and_cache(qkv, positions, cos, sin, k_cache, v_cache, slots, q_out, q_w, k_w, 1e-6)
    tol = TOL[dtype] * 4
    torch.testing.assert_close(q_out.float(), reference_rope(q, c, s), atol=tol, rtol=tol)
    written = slots >= 0
    k_ref, v_ref = from_kernel_layout(k_cache, v_cache)
    flat_k, flat_v = k_ref.reshape(-1, kv_heads, head_dim), v_ref.reshape(-1, kv_heads, head_dim)
    torch.testing.assert_close(flat_k[slots[written]].float(), reference_rope(k, c, s)[written], atol=tol, rtol=tol)
    assert torch.equal(flat_v[slots[written]].float(), v[written])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[written]] = False
    assert not flat_k[untouched].any() and not flat_v[untouched].any()


def reference_rms_norm(x, weight, eps):
    """The model's RMSNorm: float32 statistics, normalized value rounded to the dtype, times the weight."""
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,hidden", [(1, 576), (45, 576), (7, 1000)])
def test_rms_norms(ops, dtype, rows, hidden):
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    residual = torch.randn(rows, hidden, generator=g).to(dtype)
    weight = torch.rand(hidden, generator=g).to(dtype)
    out = torch.empty_like(x)
    ops.rms_norm(out, x, weight, 1e-5)
    exact = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(out, reference_rms_norm(x, weight, 1e-5), **exact)
    summed = x + residual
    x2, r2 = x.clone(), residual.clone()
    ops.fused_add_rms_norm(x2, r2, weight, 1e-5)
    assert torch.equal(r2, summed)
    torch.testing.assert_close(x2, reference_rms_norm(summed, weight, 1e-5), **exact)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_and_mul(ops, dtype):
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(19, 2 * 1536, generator=g) * 4).to(dtype)
    out = torch.empty(19, 1536, dtype=dtype)
    ops.silu_and_mul(out, x)
    gate, up = x.split(1536, -1)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out, F.silu(gate) * up, atol=tol, rtol=tol)


def test_argmax_matches_torch_including_ties(ops):
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(33, 49152, generator=g)
    logits[5, 100] = logits[5, 200] = logits[5].max() + 1  # a tie: the first index wins, as in torch
    assert torch.equal(ops.argmax(logits), logits.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3, 8, 11])
@pytest.mark.parametrize("out_features,in_features,bias", [(960, 576, False), (50, 64, True), (1000, 1536, True)])
def test_small_m_linear(ops, dtype, rows, out_features, in_features, bias):
    if not ops.small_m_supported(dtype):
        pytest.skip(f"no small-M kernel for {dtype} in this build on this CPU")
    g = torch.Generator().manual_seed(rows)
    weight = (torch.randn(out_features, in_features, generator=g) * 0.05).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    got = ops.small_m_linear(x, ops.pack_small_m(weight), b, out_features)
    want = F.linear(x.double(), weight.double(), None if b is None else b.double())
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    assert got.shape == (rows, out_features)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def small_m_paths(ops, dtype: torch.dtype = torch.bfloat16) -> list[str]:
    """The paths for more rows than a decode batch this CPU runs: the 8-row blocks always, and AMX-BF16 (bf16)
    where it has it, or the blocked GEMM (float32)."""
    if dtype == torch.float32:
        return ["vector", "f32_gemm"]
    paths = ["vector"]
    try:
        assert ops.small_m_select_path("amx_bf16") == "auto"
        assert ops.small_m_select_path("auto") == "amx_bf16"
        paths.append("amx_bf16")
    except RuntimeError as e:
        assert "do not run amx_bf16" in str(e)
    return paths


@pytest.mark.parametrize("rows", [9, 16, 17, 32, 33, 100, 257, 512])
@pytest.mark.parametrize("out_features,in_features,bias", [(960, 576, False), (48, 64, True), (1000, 1536, True),
                                                           (37, 96, False), (40, 70, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_small_m_layout_serves_prefill_chunks(ops, rows, out_features, in_features, bias, dtype):
    """A prefill chunk from the small-M layout (its only copy on AMX-BF16 CPUs in bf16 and in the AVX2 build in
    float32: models/linear.py one_layout), on every path this CPU runs: row counts past the register blocks (32
    rows on AMX, 6 in the float32 GEMM), its 126-row chunks and the AMX path's 256-row work item, K past the float32
    GEMM's 256-wide slices, N not a multiple of 32 or of two vectors, and K not a multiple of 32 (which the AMX path
    leaves to the 8-row blocks)."""
    if not ops.small_m_supported(dtype):
        pytest.skip(f"no {dtype} small-M kernel in this build on this CPU")
    g = torch.Generator().manual_seed(rows + in_features)
    weight = (torch.randn(out_features, in_features, generator=g) * 0.05).to(dtype)
    b = torch.randn(out_features, generator=g).to(dtype) if bias else None
    x = torch.randn(rows, in_features, generator=g).to(dtype)
    packed = ops.pack_small_m(weight)
    want = F.linear(x.double(), weight.double(), None if b is None else b.double())
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
    for path in small_m_paths(ops, dtype):
        ops.small_m_select_path(path)
        try:
            assert ops.small_m_large_path(dtype) == path
            got = ops.small_m_linear(x, packed, b, out_features)
        finally:
            ops.small_m_select_path("auto")
        assert got.shape == (rows, out_features) and got.dtype == dtype
        torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol, msg=lambda m: f"{path}: {m}")
