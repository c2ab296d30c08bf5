"""One copy of the linear weights (issue 41, item 4): where the small-M kernel also serves prefill chunks from its
layout (AMX-BF16 CPUs in bf16, and the AVX2 build in float32: kernels/csrc/gemm_small_m.cpp), the model keeps that
layout alone and drops oneDNN's (models/linear.py one_layout), which was a second copy of every linear weight
(+257 MiB of RSS for the default model in bf16, +512 MiB in float32: benchmarks/results/one-copy.md).

Against the same model with both copies (the 8-row path selected, so one_layout declines): the same prompt
logprobs from prompts long enough for the prefill path and greedy continuations through decode batches; sleep
level 1 frees no weights there (there is no second copy) and a wake changes nothing; the kernels turned off
(use_cpu_kernels(None)) rebuild a layout torch serves from the single copy, with the same outputs."""
from __future__ import annotations

import pytest
import torch

from tokenmill.kernels import cpu_ops

OPS = cpu_ops()


def one_layout_here(dtype: torch.dtype) -> bool:
    from tokenmill.models.linear import one_layout
    return (OPS is not None and OPS.small_m_supported(dtype)
            and one_layout(OPS, torch.empty(1, dtype=dtype), 64))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_copy_matches_two_copies_through_prefill_decode_and_sleep(tokenizer, tmp_path, dtype):
    if not one_layout_here(dtype):
        pytest.skip(f"the single layout serves {dtype} prefill chunks only on AMX-BF16 CPUs (bf16) and in the "
                    "AVX2 build (float32)")
    from helpers import save_tiny_llama

    from tokenmill import LLM, SamplingParams
    from tokenmill.models.linear import Linear, has_second_copies
    save_tiny_llama(tmp_path, vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256,
                    initializer_range=0.15, tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    tokenizer.save_pretrained(tmp_path)
    kw = dict(dtype=str(dtype).removeprefix("torch."), device="cpu", quantization="none", max_model_len=512, kv_cache_memory="16MiB",
              enable_sleep_mode=True, enable_prefix_caching=False)
    previous = OPS.small_m_select_path("vector")
    try:
        two = LLM(str(tmp_path), **kw)
    finally:
        OPS.small_m_select_path(previous)
    one = LLM(str(tmp_path), **kw)
    models = {"one": one.engine.runner.model, "two": two.engine.runner.model}
    assert all(m.single_copy for m in models["one"].modules() if isinstance(m, Linear))
    # the tied lm_head too: the embedding's dense weight (for lookups) and the small-M layout, no oneDNN copy
    assert models["one"].lm_head is None and models["one"].tied_lm_head_small_m is not None
    assert models["one"].tied_lm_head_packed is None and models["two"].tied_lm_head_packed is not None
    assert models["one"].fused_weights is not None
    assert not any(m.single_copy for m in models["two"].modules() if isinstance(m, Linear))
    assert not has_second_copies(models["one"]) and has_second_copies(models["two"])

    prompts = [list(range(1000, 1000 + n)) for n in (5, 40, 300)]  # a decode-sized prompt, then prefill chunks
    params = SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=0, ignore_eos=True)

    def run(llm):
        outs = llm.generate(prompts, params, use_tqdm=False)
        return ([o.outputs[0].token_ids for o in outs],
                [torch.tensor([e.logprob for e in o.prompt_logprobs[1:]]) for o in outs])

    want_tokens, want_logprobs = run(two)
    for state in ("awake", "after sleep and wake", "kernels off"):
        if state == "after sleep and wake":
            one.sleep(1)
            assert all(m.single_copy for m in models["one"].modules() if isinstance(m, Linear))
            one.wake_up()
        elif state == "kernels off":
            one.engine.runner.model.use_cpu_kernels(None)
            assert not any(m.small_m is not None for m in models["one"].modules() if isinstance(m, Linear))
        tokens, logprobs = run(one)
        # GEMMs that sum in another order: logprobs within the dtype's rounding, the same greedy tokens
        for got, want in zip(logprobs, want_logprobs):
            assert (got - want).abs().max() <= (0.1 if dtype == torch.bfloat16 else 1e-3), state
        assert tokens == want_tokens, state
