"""W8A8 linear layers (`--quantization w8a8`: tokenmill/kernels/csrc/w8a8.cpp, models/quantization.py W8A8Weight).

Kernels, on every path this CPU runs (the AVX-512 build's AMX-INT8 path on AMX CPUs and its VNNI path on AVX512-VNNI
ones, both selected in turn with w8a8_select_path; the AVX2 build's vpmaddubsw path, forced here on AVX-512
machines), for row counts from a decode step to a prefill chunk and K, N with tails (K not a multiple of 4 or of
the vector width, N not a multiple of 16):
- the activations' quantization (per token and 64 K) equals torch's formula bit for bit;
- the int32 sums of each 64-K block equal the exact integer product of the two int8 matrices, also at the
  extremes where an int16 pair sum of vpmaddubsw could saturate (activations -128, weights +-127);
- the float output equals the quantize-dequantize reference (the dequantized activations and weights multiplied
  in float64, from the exact integer sums) within float32's rounding of the block sums and the epilogue, and
  bf16's of the output.

Engine: the default model with --quantization w8a8 against the same model dense (float32 both): teacher-forced
agreement by the project's tie-aware criterion (helpers.teacher_forced_gaps) at >= 99% of positions, and
perplexity on a held-out English text (tests/data/heldout_text.txt: written for this test, used to tune
nothing) within 2% of the dense model's."""
from __future__ import annotations

import math
import os

import pytest
import torch

from helpers import DATA, NEAR_TIE, llm_sharing_weights, teacher_forced_gaps
from tokenmill.kernels import cpu_flags, load_ops, runnable_isas
from tokenmill.models.quantization import W8A8_BLOCK as BLOCK
from tokenmill.models.quantization import W8A8Weight

ISAS = runnable_isas()
pytestmark = pytest.mark.skipif(not ISAS, reason="this CPU runs neither kernel build")
ROWS = [1, 3, 16, 100, 257, 481]
# (N, K): N below, at and above a group of 16 with tails; K from 6 to SmolLM2's widest, with tails not a multiple
# of 4 (one 4-byte lane), 32 (AVX2's vector) or 64 (AVX-512's, and the activations' block)
SHAPES = [(37, 30), (16, 6), (100, 96), (129, 577), (33, 1536), (48, 200)]



def best_path(isa: str, flags: set[str]) -> str:
    if isa == "avx512" and {"amx_tile", "amx_int8"} <= flags:
        return "amx_int8"
    return "avx512_vnni" if isa == "avx512" and "avx512_vnni" in flags else "avx2"


# (build, path): every path of every build this CPU runs (an AVX-512 build without VNNI runs the AVX2 path)
PATHS = sorted({(isa, p) for isa in ISAS for p in ("amx_int8", "avx512_vnni", "avx2")
                if p == "avx2" or (isa == "avx512" and p in {best_path(isa, cpu_flags()), "avx512_vnni"}
                                   and "avx512_vnni" in cpu_flags())})


@pytest.fixture(params=PATHS, ids=lambda p: f"{p[0]}-{p[1]}", scope="module")
def ops(request):
    isa, path = request.param
    ops = load_ops(isa)
    previous = ops.w8a8_select_path(path)
    assert ops.w8a8_linear_path() == path
    yield ops
    ops.w8a8_select_path("auto")
    assert ops.w8a8_linear_path() == previous


@pytest.mark.parametrize("isa", ISAS)
def test_path_is_the_cpus(isa):
    """The AVX-512 build takes AMX-INT8 where the CPU has it, else VNNI where it has that; the AVX2 build, forced
    here, never does; a path the CPU does not run is refused by name."""
    ops = load_ops(isa)
    assert ops.w8a8_linear_path() == best_path(isa, cpu_flags())
    for path in ("amx_int8", "avx512_vnni"):
        if (isa, path) not in PATHS:
            with pytest.raises(RuntimeError, match=path):
                ops.w8a8_select_path(path)
    with pytest.raises(RuntimeError, match="unknown path 'sse2'"):
        ops.w8a8_select_path("sse2")
    assert ops.w8a8_linear_path() == best_path(isa, cpu_flags())


def reference_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output row: int8 quants in -127..127 and the float32 scale."""
    amax = w.abs().amax(1)
    inv = torch.where(amax > 0, torch.tensor(127.0).div(amax), torch.zeros(()))
    return torch.round(w * inv.unsqueeze(1)).clamp(-127, 127).to(torch.int8), amax / 127


def reference_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row and block of 64 K, symmetric: int8 quants [M, K] and float32 scales [M, K/64]."""
    m, k = x.shape
    blocks = -(-k // BLOCK)
    xb = torch.nn.functional.pad(x.float(), (0, blocks * BLOCK - k)).view(m, blocks, BLOCK)
    amax = xb.abs().amax(-1)
    inv = torch.where(amax > 0, torch.tensor(127.0).div(amax), torch.zeros(()))
    q = torch.round(xb * inv.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
    return q.view(m, -1)[:, :k], amax / 127


def block_sums(xq: torch.Tensor, wq: torch.Tensor) -> torch.Tensor:
    """The exact integer sums per 64-K block: [M, K/64, N] int64."""
    k = xq.shape[1]
    pad = -(-k // BLOCK) * BLOCK - k
    xb = torch.nn.functional.pad(xq.long(), (0, pad)).view(xq.shape[0], -1, BLOCK)
    wb = torch.nn.functional.pad(wq.long(), (0, pad)).view(wq.shape[0], -1, BLOCK)
    return torch.einsum("mbk,nbk->mbn", xb, wb)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w8a8_matches_quantize_dequantize_reference(ops, dtype):
    for i, (n, k) in enumerate(SHAPES):
        g = torch.Generator().manual_seed(i)
        w = torch.randn(n, k, generator=g) * 0.05
        packed = W8A8Weight(w)
        wq, sw = reference_weight(w)
        assert torch.equal(packed.int8_rows(), wq)  # the packed layout round-trips
        assert torch.equal(packed.scales, sw)
        bias = torch.randn(n, generator=g) if i % 2 else None
        for m in ROWS:
            # outliers in a few channels (as LLM activations have), one row all zero
            x = torch.randn(m, k, generator=g) * (1 + i)
            x[:, ::17] *= 8
            x = x.to(dtype)
            x[m // 2] = 0
            xq, sx = ops.w8a8_quantize(x)
            rq, rs = reference_activations(x)
            assert torch.equal(xq, rq) and torch.equal(sx, rs), (n, k, m)
            # the int32 sums of every block: exactly the integer product
            exact = block_sums(xq, wq)
            sums = ops.w8a8_int_gemm(xq.contiguous(), packed.qweight, packed.meta)
            assert sums.dtype == torch.int32 and torch.equal(sums[..., :n].long(), exact), (n, k, m)
            # the output: the quantize-dequantize product, sum_b sx_b (xq . wq)_b sw, computed in float64 from the
            # exact sums, within float32's rounding (each block's product and the running sum: blocks + 1
            # roundings of 2^-24 of the sum of magnitudes; the scale and the bias: 2 more) and bf16's of the output
            y = ops.w8a8_linear(x, packed.qweight, packed.meta, bias, n)
            assert y.dtype == dtype and y.shape == (m, n)
            terms = exact.double() * sx.double().unsqueeze(-1) * sw.double()  # [M, blocks, N]
            b64 = 0 if bias is None else bias.double()
            ref = terms.sum(1) + b64
            tol = (exact.shape[1] + 3) * 2 ** -24 * (terms.abs().sum(1) + (0 if bias is None else b64.abs())) + 1e-30
            if dtype == torch.bfloat16:
                tol = tol + 2 ** -8 * ref.abs()
            assert ((y.double() - ref).abs() <= tol).all(), (n, k, m, (y.double() - ref).abs().max().item())


def test_no_rows(ops):
    """An empty batch gives an empty output on every path (the rows' split has no chunk to hand out)."""
    packed = W8A8Weight(torch.randn(40, 96, generator=torch.Generator().manual_seed(3)))
    for dtype in (torch.float32, torch.bfloat16):
        y = ops.w8a8_linear(torch.zeros(0, 96, dtype=dtype), packed.qweight, packed.meta, None, 40)
        assert y.shape == (0, 40) and y.dtype == dtype


def test_int_sums_at_the_saturation_extremes(ops):
    """Activations -128 and 127 against weights -127 and 127: every vpmaddubsw pair of the AVX2 path at its
    largest magnitude (2 * 128 * 127 = 32512, below int16's 32767; the plain u8 form xq + 128 would reach
    2 * 255 * 127 and saturate), every VNNI lane at 4 * 255 * 127."""
    n, k = 48, 1030
    g = torch.Generator().manual_seed(7)
    sign = torch.where(torch.rand(n, k, generator=g) < 0.5, -1.0, 1.0)
    packed = W8A8Weight(sign * 0.01)  # every quant +-127
    wq = packed.int8_rows()
    assert wq.abs().min() == 127
    xq = torch.full((13, k), -128, dtype=torch.int8)
    xq[1::2] = 127
    xq[2, ::3] = -127
    sums = ops.w8a8_int_gemm(xq, packed.qweight, packed.meta)
    assert torch.equal(sums[..., :n].long(), block_sums(xq, wq))


def test_w8a8_refused_where_the_kernels_cannot_run(monkeypatch):
    from tokenmill import kernels
    from tokenmill.models.quantization import quantization_kernels
    with pytest.raises(ValueError, match=r"--quantization w8a8: .* on cuda in bfloat16 \(the quantized kernels are "
                                         r"CPU kernels\).*--quantization none"):
        quantization_kernels("w8a8", True, torch.bfloat16, torch.device("cuda"))
    with pytest.raises(ValueError, match=r"--quantization w8a8: .* on cpu in float16"):
        quantization_kernels("w8a8", False, torch.float16, torch.device("cpu"))
    monkeypatch.setattr(kernels, "cpu_ops", lambda: None)  # TOKENMILL_CPU_ISA=none, or a failed build
    with pytest.raises(ValueError, match=r"--quantization w8a8: .*the CPU kernels are off"):
        quantization_kernels("w8a8", False, torch.float32, torch.device("cpu"))


def test_w8a8_quantizes_a_dense_checkpoint_at_load(tokenizer, tmp_path):
    """A safetensors checkpoint (an untied lm_head, down_proj's K = 100: a tail of the 64-K blocks): every decoder
    linear becomes a W8A8Weight, the embedding and the lm_head stay dense, and the logprobs follow the dense
    model's (a tiny random model: measured within 0.13 at logprobs near -12; a wrong layout is off by units)."""
    from helpers import save_tiny_llama

    from tokenmill import LLM, SamplingParams
    from tokenmill.models.linear import Linear
    save_tiny_llama(tmp_path, vocab_size=len(tokenizer), intermediate_size=100, initializer_range=0.15,
                    tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                    eos_token_id=tokenizer.eos_token_id)
    tokenizer.save_pretrained(tmp_path)
    llms = {q: LLM(str(tmp_path), dtype="float32", device="cpu", quantization=q, max_model_len=128,
                   kv_cache_memory="16MiB") for q in ("none", "w8a8")}
    model = llms["w8a8"].engine.runner.model
    linears = {name: m for name, m in model.named_modules() if isinstance(m, Linear)}
    assert model.lm_head.quant is None and isinstance(model.embed_tokens.weight, torch.Tensor)
    assert all(isinstance(m.quant, W8A8Weight) for name, m in linears.items() if name != "lm_head")
    assert model.layers[0].mlp.down_proj.quant.in_features == 100
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    prompt = list(range(1000, 1060))
    logprobs = {q: torch.tensor([e.logprob for e in llm.generate([prompt], params, use_tqdm=False)[0]
                                 .prompt_logprobs[1:]]) for q, llm in llms.items()}
    assert (logprobs["w8a8"] - logprobs["none"]).abs().max() <= 0.5


# ---- engine level: the default model, float32, w8a8 against dense ----

WINDOW = 500  # tokens per perplexity window (the engines' max_model_len is 512)


@pytest.fixture(scope="module")
def engines():
    return {q: llm_sharing_weights(dtype="float32", quantization=q) for q in ("none", "w8a8")}


def perplexity(llm, ids: list[int]) -> float:
    from tokenmill import SamplingParams
    windows = [ids[i:i + WINDOW] for i in range(0, len(ids), WINDOW)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)
    outs = llm.generate(windows, params, use_tqdm=False)
    nll = [-e.logprob for o in outs for e in o.prompt_logprobs[1:]]
    return math.exp(sum(nll) / len(nll))


@pytest.mark.slow
def test_w8a8_model_agrees_with_dense_and_keeps_perplexity(engines, tokenizer):
    from tokenmill import SamplingParams
    dense, w8a8 = engines["none"], engines["w8a8"]
    model = w8a8.engine.runner.model
    assert isinstance(model.layers[0].mlp.down_proj.quant, W8A8Weight)
    assert model.fused_ops is not None  # the decoder stack in one call, its linears on w8a8_linear
    assert dense.engine.runner.model.layers[0].mlp.down_proj.quant is None
    with open(os.path.join(DATA, "heldout_text.txt")) as f:
        ids = tokenizer.encode(f.read(), add_special_tokens=False)
    # agreement: 8 prompts cut from the text, the dense model's greedy continuations teacher-forced into w8a8
    prompts = [ids[250 * i:250 * i + 20 + 9 * i] for i in range(8)]
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=64)
    refs = [o.outputs[0].token_ids for o in dense.generate(prompts, greedy, use_tqdm=False)]
    gaps = [g for case, _ in teacher_forced_gaps(w8a8, prompts, refs) for g in case]
    agree = sum(g <= NEAR_TIE for g in gaps) / len(gaps)
    ppl = {name: perplexity(llm, ids) for name, llm in engines.items()}
    print(f"\nw8a8 vs dense float32: tie-aware agreement {agree:.4f} of {len(gaps)} positions (top-1 equal at "
          f"{sum(g <= 0 for g in gaps)}; largest gap {max(gaps):.3f}); perplexity over {len(ids)} tokens: dense "
          f"{ppl['none']:.3f}, w8a8 {ppl['w8a8']:.3f} ({ppl['w8a8'] / ppl['none'] - 1:+.2%})")
    assert agree >= 0.99
    assert ppl["w8a8"] <= 1.02 * ppl["none"]
