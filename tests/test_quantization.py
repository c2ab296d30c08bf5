"""Weights kept quantized (tokenmill/models/quantization.py, kernels/csrc/quant_linear.cpp).

Kernels: every format (GGUF Q4_0, Q4_1, Q8_0 from the gguf package's own quantizer; int8 and int4 quantized at
load) against a dequantize-then-matmul reference with float activations, on every ISA build this CPU runs (the
AVX-512 build uses VNNI where the CPU has it; the AVX2 build is the fallback path), in float32 and bfloat16, on
each of the kernel's paths: up to DENSE_MIN_ROWS rows (int16 activations per 32-block: the error is bounded by
half a step per element, computed from the data), above (the weight dequantized, then oneDNN: bit-equal to oneDNN
on the dequantized weight, i.e. to `--quantization none`), and bfloat16 above TILED_MIN_ROWS on CPUs with
AVX512-BF16 (the dequantized bf16 weights multiplied in registers: the dequantized model's products, float32
sums in another order, one bf16 rounding of the output).

Engine: the Q4_1 default model kept quantized agrees with the same file dequantized (teacher-forced top-1, with
prefill-sized steps and with steps small enough for the int16 kernel), int8 weights agree with the float32 model,
and greedy ids equal llama.cpp's on the same GGUF (stored ids: tests/data/make_llamacpp_greedy.py)."""
from __future__ import annotations

import json
import os

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from helpers import NEAR_TIE, teacher_forced_agreement, teacher_forced_gaps
from tokenmill.kernels import load_ops, runnable_isas
from tokenmill.models.linear import linear, pack_weight
from tokenmill.models.quantization import QuantizedTensor, QuantizedWeight, from_gguf, quantize

ISAS = runnable_isas()
FORMATS = ["Q4_0", "Q4_1", "Q8_0", "int8", "int4"]
# (N, K): odd N, K from one block to SmolLM2's widest; groups of 16 outputs odd and even in number
SHAPES = [(37, 32), (100, 96), (129, 576), (16, 1536), (96, 64)]


@pytest.fixture(params=ISAS, scope="module")
def ops(request):
    return load_ops(request.param)


def make_weight(fmt: str, n: int, k: int, seed: int) -> QuantizedTensor:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05
    if fmt in ("int8", "int4"):
        return quantize(w, fmt)
    raw = gguf_quantize(w.numpy(), GGMLQuantizationType[fmt])
    t = from_gguf(raw, fmt, (n, k))
    # the repacked blocks hold exactly the values the gguf package dequantizes
    assert torch.equal(t.dequantize(), torch.from_numpy(gguf_dequantize(raw, GGMLQuantizationType[fmt])))
    return t


DENSE_MIN_ROWS = 96  # quant_linear.cpp's kDenseMinRows: more rows than this take the dequantize + oneDNN path
TILED_MIN_ROWS = 24  # its kTiledMinRows: more bf16 rows than this take the tiled path, where the CPU has it


def int16_rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The most the int16 activation quantization can move each output: half a step (amax / 65534 of the x
    block) times |w|, summed over K. [M, N] float64."""
    m, k = x.shape
    amax = x.double().view(m, k // 32, 32).abs().amax(-1, keepdim=True)
    half_step = (amax / 65534).expand(m, k // 32, 32).reshape(m, k)
    return half_step @ w.double().abs().T


@pytest.mark.parametrize("tiles", ["auto", "bf16_tiles"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_linear_matches_dequantized_reference(ops, fmt, dtype, tiles):
    """Every path by rows: the int16 kernel, dequantize + oneDNN, and for bf16 the tiles: AMX-BF16 blocks of 16 and
    32 rows beside vdpbf16ps ones where the CPU runs AMX (auto), and vdpbf16ps alone (forced there by
    quant_linear_select_path); on shapes whose outputs end mid-tile and mid-group."""
    if tiles != "auto" and (dtype == torch.float32 or "amx_bf16_tiles" not in ops.quant_linear_path()):
        pytest.skip("the same path as auto on this CPU and build")
    previous = ops.quant_linear_select_path(tiles)
    try:
        check_quant_linear(ops, fmt, dtype)
    finally:
        ops.quant_linear_select_path("auto")
    assert previous == ops.quant_linear_path()


def check_quant_linear(ops, fmt, dtype):
    for i, (n, k) in enumerate(SHAPES):
        t = make_weight(fmt, n, k, seed=i)
        packed = QuantizedWeight(t)
        w = t.dequantize()
        assert torch.equal(packed.dequantize(), w)  # the packed layout round-trips
        # the dense path's weight: exactly the dequantized model's (d q + m in float32, rounded to dtype)
        dense = ops.quant_dequantize(packed.qweight, packed.meta, n, dtype)
        assert torch.equal(dense, w.to(dtype))
        bias = torch.randn(n) if i % 2 else None
        tiled = dtype == torch.bfloat16 and "bf16_tiles" in ops.quant_linear_path()
        for m in [*range(1, 10), TILED_MIN_ROWS, TILED_MIN_ROWS + 1, 33, DENSE_MIN_ROWS, DENSE_MIN_ROWS + 1, 130]:
            x = (torch.randn(m, k, generator=torch.Generator().manual_seed(m)) * (1 + 3 * (i % 3))).to(dtype)
            y = ops.quant_linear(x, packed.qweight, packed.meta, bias, n)
            assert y.dtype == dtype and y.shape == (m, n)
            if tiled and m > TILED_MIN_ROWS:
                # exact products of the bf16 values (those of `--quantization none`), float32 sums (K * 2^-24 of
                # the sum of |products|, plus the bias's float32 add), and the output's rounding to bf16: half a
                # unit in y's last place (bf16: 8 significant bits)
                exact = x.double() @ dense.double().T + (0 if bias is None else bias.double())
                sums = x.double().abs() @ dense.double().abs().T + (0 if bias is None else bias.double().abs())
                half_ulp = torch.exp2(y.double().abs().log2().floor() - 8)
                tol = (k + 1) * 2 ** -24 * sums + half_ulp
                assert ((y.double() - exact).abs() <= tol).all(), (fmt, n, k, m)
                continue
            if m > DENSE_MIN_ROWS:  # the same call the dense model makes (oneDNN, or F.linear where it has none)
                b = None if bias is None else bias.to(dtype)
                assert torch.equal(y, linear(x, dense, b, packed=pack_weight(dense))), (fmt, n, k, m)
                continue
            exact = x.double() @ w.double().T + (0 if bias is None else bias.double())
            # int16 rounding of x (bounded per output), float32 accumulation (1e-6 of the largest output covers
            # K <= 1536 sums of float32-rounded block partials), and bfloat16's rounding of the output (half a
            # unit in the last place: at most 2^-8 of the value)
            tol = int16_rounding_bound(x, w) + 1e-6 * exact.abs().max().item()
            if dtype == torch.bfloat16:
                tol = tol + 2 ** -8 * exact.abs()
            assert ((y.double() - exact).abs() <= tol).all(), (fmt, n, k, m)


def test_quantize_at_load_error_is_half_a_step():
    w = torch.randn(64, 96) * 0.1
    for kind, largest_quant in (("int8", 128), ("int4", 16)):
        t = quantize(w, kind)
        step = t.d.float().repeat_interleave(32, dim=1)
        offset = t.m.float().abs().repeat_interleave(32, dim=1)
        # half a step, plus float16's rounding of the scale times the largest quant and of the offset
        bound = step * (0.5 + largest_quant * 2 ** -11) + offset * 2 ** -11 + 1e-6
        assert ((t.dequantize() - w).abs() <= bound).all(), kind


@pytest.mark.parametrize("fmt", ["Q8_0", "int4"])
def test_embedding_rows_and_row_reorder(fmt):
    t = make_weight(fmt, 70, 64, seed=3)
    packed = QuantizedWeight(t)
    ids = torch.tensor([[0, 69, 17], [16, 15, 33]])
    assert torch.equal(packed.dequantize_rows(ids), t.dequantize()[ids])
    order = torch.randperm(70)
    assert torch.equal(t.rows(order).dequantize(), t.dequantize()[order])
    assert torch.equal(QuantizedTensor.cat([t, t.rows(order)]).dequantize(),
                       torch.cat([t.dequantize(), t.dequantize()[order]]))


def test_gguf_flag_refuses_a_non_gguf_model():
    from tokenmill.models.quantization import quantization_kernels
    with pytest.raises(ValueError, match="needs a GGUF"):
        quantization_kernels("gguf", False, torch.float32, torch.device("cpu"))


# ---- engine level (slow: three engines of the default model) ----

LLAMACPP = os.path.join(os.path.dirname(__file__), "data", "llamacpp_q4_1_greedy.json")
TEXT = ("The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the one hundred and "
        "twelve steps as his father had done before him. In computer science, a hash table is a data structure "
        "that maps keys to values. Photosynthesis is the process by which green plants turn light into chemical "
        "energy. def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    middle = len(items) // 2\n"
        "The recipe for the bread is simple: flour, water, salt and a little yeast. Dear Ms. Alvarez, thank you "
        "for your letter of the fourteenth. The river rises in the mountains, four hundred kilometres from the sea.")


@pytest.fixture(scope="module")
def engines():
    """float32 engines of the default Q4_1 GGUF: dequantized (none), kept quantized (auto), int8 at load, the last
    two also with steps of at most DENSE_MIN_ROWS tokens (auto_small, int8_small: every linear then runs the
    int16 kernel, as decoding does); and the kept-quantized one in bfloat16 (auto_bf16), the serving dtype on
    CPUs with AVX512-BF16."""
    from tokenmill import LLM
    made = {q: LLM(dtype="float32", device="cpu", quantization=q, max_model_len=512, kv_cache_memory="64MiB")
            for q in ("none", "auto", "int8")}
    for q in ("auto", "int8"):
        made[f"{q}_small"] = LLM(dtype="float32", device="cpu", quantization=q, max_model_len=512,
                                 kv_cache_memory="64MiB", max_num_batched_tokens=DENSE_MIN_ROWS)
    made["auto_bf16"] = LLM(dtype="bfloat16", device="cpu", max_model_len=512, kv_cache_memory="64MiB")
    return made


@pytest.mark.slow
def test_kept_quantized_agrees_with_dequantized_and_int8_with_float32(engines, tokenizer):
    from tokenmill import SamplingParams
    kept = engines["auto"].engine.runner.model
    assert kept.layers[0].mlp.gate_up_proj.quant.source == "Q4_1" and kept.embed_tokens.quant.source == "Q8_0"
    assert engines["int8"].engine.runner.model.layers[0].mlp.gate_up_proj.quant.source == "int8"
    assert engines["none"].engine.runner.model.layers[0].mlp.gate_up_proj.quant is None
    stream = tokenizer.encode(TEXT, add_special_tokens=False)
    prompts = [stream[i * 16:i * 16 + n] for i, n in enumerate([5, 9, 12, 20, 31, 47, 64, 90])]
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=32)
    refs = [o.outputs[0].token_ids for o in engines["none"].generate(prompts, greedy, use_tqdm=False)]
    figures = {name: teacher_forced_agreement(engines[name], prompts, refs)[0]
               for name in ("auto", "int8", "auto_small", "int8_small")}
    print("\nteacher-forced top-1 agreement with the dequantized float32 model: " +
          ", ".join(f"{name} {value:.3f}" for name, value in figures.items()))
    # Issue 15's lines: the same Q4_1 weights kept quantized >= 0.99 (measured 1.000 through both paths; the int8
    # activations of the first kernels gave 0.980); int8 weights >= 0.98 (measured 0.996 through both paths with
    # asymmetric blocks; symmetric int8 blocks gave 0.961, from the weights' rounding alone).
    assert figures["auto"] >= 0.99 and figures["auto_small"] >= 0.99
    assert figures["int8"] >= 0.98 and figures["int8_small"] >= 0.98


def _llamacpp_cases() -> tuple[list[dict], int]:
    if not os.path.exists(LLAMACPP):
        pytest.skip("no stored llama.cpp ids: run tests/data/make_llamacpp_greedy.py (its docstring says how)")
    with open(LLAMACPP) as f:
        stored = json.load(f)
    return stored["cases"], stored["new_tokens"]


def _teacher_forced_on_llamacpp(llm, cases: list[dict]) -> list[tuple[list[float], list[float]]]:
    """Per case, fed llama.cpp's continuation: at each of its positions, (gap, margin): our top logprob minus
    our logprob of llama.cpp's token (0 where our top token is theirs), and our top logprob minus our second."""
    return teacher_forced_gaps(llm, [c["prompt_ids"] for c in cases], [c["output_ids"] for c in cases])


@pytest.mark.slow
def test_kept_quantized_greedy_matches_llamacpp(engines):
    """Agreement with another engine's numerics (llama.cpp on the same Q4_1 GGUF, its greedy continuations stored
    in tests/data/llamacpp_q4_1_greedy.json), by the criterion this project adopts for it:
    1. teacher-forced on the other engine's continuation, at every position our top token equals theirs or is
       within 0.25 logits of it (our top logit minus our logit of their token <= 0.25);
    2. greedy continuations are equal wherever no near-tie (our top two logits less than 0.25 apart) occurs
       before the divergence: a continuation that diverges at position d has a near-tie at some position <= d
       (teacher-forced, the contexts up to d are the greedy run's own).
    Counting equal continuations ("N of 8") measures where near-ties fall, not agreement: llama.cpp's own
    numerics (int8 activations, f16 KV cache) fork these continuations at near-ties, and emulating them in torch
    (benchmarks/llamacpp_numerics.py, benchmarks/results/quantization.md) moved the forks without removing them.

    Checked in float32: on the kept-quantized path (auto, the same Q4_1 kernels that serve) and on the file
    dequantized (none). In bfloat16 (auto_bf16) logits are rounded to bf16, whose step is 0.125 at these logits'
    magnitude (16..32), so a gap is a multiple of 1/32..1/8 and a 0.25 bound falls on a representable gap: there
    part 1 holds (gap <= 0.25), and part 2 is not applied (measured on Sapphire Rapids: one divergence at a top-two
    gap of exactly 0.25, two bf16 steps)."""
    from tokenmill import SamplingParams
    cases, new_tokens = _llamacpp_cases()
    greedy = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=new_tokens)
    for name in ("auto", "none"):
        got = [o.outputs[0].token_ids for o in engines[name].generate([c["prompt_ids"] for c in cases], greedy,
                                                                      use_tqdm=False)]
        forced = _teacher_forced_on_llamacpp(engines[name], cases)
        first = [next((j for j, (a, b) in enumerate(zip(g, c["output_ids"])) if a != b), new_tokens)
                 for g, c in zip(got, cases)]
        print(f"\n{name}: first divergence from llama.cpp per prompt {first}; largest teacher-forced gap "
              f"{max(max(gaps) for gaps, _ in forced):.3f}")
        for i, (d, (gaps, margins)) in enumerate(zip(first, forced)):
            assert max(gaps) <= NEAR_TIE, (name, i, gaps)
            if d < new_tokens:
                assert min(margins[:d + 1]) < NEAR_TIE, (name, i, d, margins[:d + 1])
    # Measured (Sapphire Rapids, float32): divergences [5, 13, 32, 30, 1, 21, 31, 17] for both paths, each at a
    # near-tie (top-two gaps 0.007..0.22 at the divergence); largest teacher-forced gap 0.22.


@pytest.mark.slow
def test_llamacpp_choices_are_near_ties_teacher_forced(engines):
    """Part 1 of the criterion above on every path, the bf16 one that serves on this CPU included: fed llama.cpp's
    own continuation, our top token is llama.cpp's or within 0.25 logits of it."""
    cases, _ = _llamacpp_cases()
    gaps = {name: [g for g, _ in _teacher_forced_on_llamacpp(engines[name], cases)]
            for name in ("auto_bf16", "auto", "none")}
    for name, per_case in gaps.items():
        flat = [g for case in per_case for g in case]
        print(f"\n{name}: llama.cpp's token ranked first at {sum(g <= 0 for g in flat)} of {len(flat)} positions; "
              f"largest gap {max(flat):.3f} (per prompt {[round(max(case), 3) for case in per_case]})")
    # Measured (Zen 5): llama.cpp's token first at 250 of 256 positions in bf16 (largest gap 0.250), 248 in float32
    # kept quantized (0.219) and dequantized (0.220; the torch emulation finds 0.22 too); Sapphire Rapids: the same
    # in float32, and in bf16 249 of 256 with a largest gap of 0.3125 on the AMX-BF16 tiles, the very gaps of the
    # file dequantized to a dense bf16 model on the same CPU (0.250 on the vdpbf16ps tiles: the sums' order moves
    # a bf16 logit by a step). bf16 logits at these magnitudes (< 32) are 0.125 apart at most, so in bf16 the bound
    # is the near-tie plus one such step.
    for name, per_case in gaps.items():
        bound = NEAR_TIE + (0.125 if name == "auto_bf16" else 0)
        assert all(g <= bound for case in per_case for g in case), (name, bound)


def test_quantized_flag_that_cannot_be_served_fails_the_start(monkeypatch):
    """Where the quantized kernels cannot run, a quantized --quantization is a start-up error naming the dense path
    that would run, instead of dense weights and a log line; --quantization none asks for that path."""
    from tokenmill import kernels
    from tokenmill.models.quantization import quantization_kernels
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    with pytest.raises(ValueError, match=r"--quantization int8: .* on cuda in bfloat16 \(the quantized kernels are "
                                         r"CPU kernels\); what would run is dense bfloat16 weights.*--quantization none"):
        quantization_kernels("int8", False, torch.bfloat16, cuda)
    with pytest.raises(ValueError, match=r"--quantization int4: .* on cpu in float16 \(they run in float32"):
        quantization_kernels("int4", False, torch.float16, cpu)
    # auto, the default, is "quantized where the kernels serve it": the default GGUF starts on a GPU, dequantized
    assert quantization_kernels("auto", True, torch.bfloat16, cuda, gguf_has_quantized=True) is None
    monkeypatch.setattr(kernels, "cpu_ops", lambda: None)  # TOKENMILL_CPU_ISA=none, or a failed build
    with pytest.raises(ValueError, match=r"--quantization gguf: .*the CPU kernels are off"):
        quantization_kernels("gguf", True, torch.float32, cpu)
    assert quantization_kernels("none", True, torch.float32, cpu) is None
    assert quantization_kernels("auto", True, torch.float32, cpu, gguf_has_quantized=False) is None  # nothing to keep
    assert quantization_kernels("auto", False, torch.bfloat16, cuda) is None  # an HF model stays as it is


def test_quantized_flag_on_float16_fails_the_engine_start(tmp_path):
    from helpers import save_tiny_llama

    from tokenmill import LLM
    save_tiny_llama(tmp_path, vocab_size=256)
    with pytest.raises(ValueError, match="--quantization int8: .*pass --quantization none"):
        LLM(str(tmp_path), device="cpu", dtype="float16", quantization="int8", kv_cache_memory="16MiB",
            max_model_len=64)
