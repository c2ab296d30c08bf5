"""The offline API end to end: seeds, n, stop conditions, metrics and prompt forms on a tiny random model (engine
mechanics, conftest's tiny_llm); logprobs against HF transformers, chat and the sampled distribution of a real
model's next token on the default model."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tokenmill import SamplingParams
from tokenmill.sampling_params import ParamError

PROMPT = "The little robot opened the door and"
OTHER_PROMPTS = ["Once upon a time", "The best way to learn a new language is", "def fibonacci(n):"]


def gen(llm, prompts, params):
    return llm.generate(prompts, params, use_tqdm=False)


def one(llm, prompt, params):
    return gen(llm, prompt, params)[0].outputs[0]


def sampled(max_tokens=32, **kw):
    return SamplingParams(temperature=1.0, max_tokens=max_tokens, ignore_eos=True, **kw)


def greedy(max_tokens=24, **kw):
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def greedy_run(tiny_llm):
    out = one(tiny_llm, PROMPT, greedy())
    assert out.text == tiny_llm.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    return out


# ---- seeds and n ----

def test_same_seed_same_output_alone_and_in_batch(tiny_llm):
    alone = one(tiny_llm, PROMPT, sampled(seed=1234)).token_ids
    assert len(alone) == 32
    params = [sampled(), sampled(seed=1234), sampled(seed=99), SamplingParams(temperature=0.8, max_tokens=20)]
    batch = gen(tiny_llm, [OTHER_PROMPTS[0], PROMPT, OTHER_PROMPTS[1], PROMPT], params)
    assert batch[1].outputs[0].token_ids == alone
    # Again, alone, after the engine's own generator has moved on.
    assert one(tiny_llm, PROMPT, sampled(seed=1234)).token_ids == alone
    # The unseeded request with the same prompt in the same batch is not tied to the seed.
    assert batch[3].outputs[0].token_ids[:20] != alone[:20]


def test_different_seeds_differ(tiny_llm):
    outs = gen(tiny_llm, [PROMPT] * 3, [sampled(12, seed=1), sampled(12, seed=2), sampled(12, seed=3)])
    ids = [tuple(o.outputs[0].token_ids) for o in outs]
    assert len(set(ids)) == 3


def test_unseeded_sampling_varies(tiny_llm):
    outs = gen(tiny_llm, [PROMPT] * 3, sampled(max_tokens=12))
    assert len({tuple(o.outputs[0].token_ids) for o in outs}) == 3


def test_n_samples_and_seeded_n_is_reproducible(tiny_llm):
    params = sampled(max_tokens=12, n=2, seed=77)
    first = gen(tiny_llm, PROMPT, params)
    assert len(first) == 1
    outs = first[0].outputs
    assert [o.index for o in outs] == [0, 1]
    assert all(len(o.token_ids) == 12 and o.finish_reason == "length" for o in outs)
    assert outs[0].token_ids != outs[1].token_ids
    again = gen(tiny_llm, PROMPT, params)[0].outputs
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]
    assert [o.text for o in again] == [o.text for o in outs]
    unseeded = gen(tiny_llm, PROMPT, sampled(max_tokens=12, n=3))[0].outputs
    assert len(unseeded) == 3 and len({tuple(o.token_ids) for o in unseeded}) == 3


# ---- stop conditions ----

def test_max_tokens_finishes_with_length(tiny_llm, greedy_run):
    out = one(tiny_llm, PROMPT, greedy(max_tokens=5))
    assert out.finish_reason == "length" and out.stop_reason is None
    assert out.token_ids == greedy_run.token_ids[:5]
    assert greedy_run.finish_reason == "length" and len(greedy_run.token_ids) == 24


def _stop_string(llm, run, token_index: int) -> tuple[str, int]:
    """A stop string that straddles the boundary before token `token_index` and first occurs there; its offset."""
    start = len(llm.tokenizer.decode(run.token_ids[:token_index]))
    for left, right in ((3, 4), (2, 5), (4, 6)):
        stop = run.text[start - left:start + right]
        if run.text.find(stop) == start - left and stop.strip() == stop and len(stop) == left + right:
            return stop, start - left
    pytest.fail("no unique stop string in the greedy text")


def test_stop_string_cuts_output(tiny_llm, greedy_run):
    stop, at = _stop_string(tiny_llm, greedy_run, 10)
    out = one(tiny_llm, PROMPT, greedy(stop=["never appears here", stop]))
    assert out.text == greedy_run.text[:at]
    assert stop not in out.text
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert len(out.token_ids) < 24
    assert out.token_ids == greedy_run.token_ids[:len(out.token_ids)]


def test_stop_string_included_on_request(tiny_llm, greedy_run):
    stop, at = _stop_string(tiny_llm, greedy_run, 10)
    out = one(tiny_llm, PROMPT, greedy(stop=stop, include_stop_str_in_output=True))
    assert out.text == greedy_run.text[:at + len(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop


def test_stop_string_on_the_last_allowed_token_is_a_stop(tiny_llm, greedy_run):
    # The token that completes the stop string is also the max_tokens-th: the stop string wins, as in vLLM.
    tok = tiny_llm.tokenizer
    for k in range(6, 20):
        text = tok.decode(greedy_run.token_ids[:k])
        piece = text[-3:]
        last_piece = tok.decode(greedy_run.token_ids[k - 1:k])
        if piece.strip() == piece and last_piece and text.find(piece) == len(text) - 3:
            break
    else:
        pytest.fail("no stop string that the greedy text completes on one token")
    out = one(tiny_llm, PROMPT, greedy(max_tokens=k, stop=[piece]))
    assert len(out.token_ids) == k
    assert out.finish_reason == "stop" and out.stop_reason == piece
    assert out.text == text[:-3]


def test_stop_token_ids(tiny_llm, greedy_run):
    ids = greedy_run.token_ids
    i = next(i for i in range(4, len(ids)) if ids[i] not in ids[:i])
    out = one(tiny_llm, PROMPT, greedy(stop_token_ids=[ids[i]]))
    assert out.token_ids == ids[:i + 1]
    assert out.finish_reason == "stop" and out.stop_reason == ids[i]
    # As in vLLM, the stop token's text is left out unless include_stop_str_in_output.
    assert out.text == tiny_llm.tokenizer.decode(ids[:i])
    out = one(tiny_llm, PROMPT, greedy(stop_token_ids=[ids[i]], include_stop_str_in_output=True))
    assert out.text == tiny_llm.tokenizer.decode(ids[:i + 1])


def test_eos_finishes_with_stop(tiny_llm):
    eos = tiny_llm.tokenizer.eos_token_id
    out = one(tiny_llm, PROMPT, SamplingParams(temperature=1.0, max_tokens=8, logit_bias={eos: 100.0}))
    assert out.token_ids == [eos]
    assert out.finish_reason == "stop" and out.stop_reason is None and out.text == ""
    # min_tokens holds EOS back; ignore_eos runs to max_tokens.
    out = one(tiny_llm, PROMPT, SamplingParams(temperature=1.0, max_tokens=8, min_tokens=3, logit_bias={eos: 100.0}))
    assert len(out.token_ids) == 4 and eos not in out.token_ids[:3] and out.token_ids[3] == eos
    assert out.finish_reason == "stop"
    out = one(tiny_llm, PROMPT, SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True, logit_bias={eos: 100.0}))
    assert out.token_ids == [eos] * 5 and out.finish_reason == "length"


# ---- logprobs against HF transformers ----

def _hf_logprobs(hf_reference, ids: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf_reference(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check_entry(entry, hf_row: torch.Tensor, k: int, token: int):
    tok, lp, rank, top_ids, top_lps = entry
    assert tok == token
    assert lp == pytest.approx(hf_row[tok].item(), abs=1e-3)
    assert int((hf_row > lp + 1e-3).sum()) + 1 <= rank <= int((hf_row > lp - 1e-3).sum()) + 1
    assert len(top_ids) == len(top_lps) == k
    assert top_lps == sorted(top_lps, reverse=True)
    np.testing.assert_allclose(top_lps, hf_row.topk(k).values.numpy(), atol=1e-3)
    np.testing.assert_allclose(top_lps, hf_row[top_ids].numpy(), atol=1e-3)


def test_logprobs_match_hf(llm, hf_reference):
    # Temperature 0.8: the logprobs are of the model output, before temperature (vLLM's default).
    res = gen(llm, PROMPT, SamplingParams(temperature=0.8, max_tokens=20, ignore_eos=True, seed=5, logprobs=3))[0]
    out = res.outputs[0]
    assert out.logprobs is not None and len(out.logprobs) == len(out.token_ids) == 20
    hf = _hf_logprobs(hf_reference, res.prompt_token_ids + out.token_ids)[len(res.prompt_token_ids) - 1:-1]
    for j, entry in enumerate(out.logprobs):
        _check_entry(entry, hf[j], 3, out.token_ids[j])
    assert any(e[2] > 1 for e in out.logprobs)  # temperature 1 drew some tokens that were not the top one
    assert out.cumulative_logprob == pytest.approx(sum(hf[j, t].item() for j, t in enumerate(out.token_ids)),
                                                   abs=1e-2)
    assert one(llm, PROMPT, sampled(max_tokens=4)).logprobs is None


def test_prompt_logprobs_match_hf(llm, hf_reference):
    res = gen(llm, PROMPT, SamplingParams(temperature=0.0, max_tokens=2, prompt_logprobs=2))[0]
    ids = res.prompt_token_ids
    assert res.prompt_logprobs is not None and len(res.prompt_logprobs) == len(ids)
    assert res.prompt_logprobs[0] is None
    hf = _hf_logprobs(hf_reference, ids)
    for j in range(1, len(ids)):
        _check_entry(res.prompt_logprobs[j], hf[j - 1], 2, ids[j])


def test_prompt_logprobs_given_once_with_n(tiny_llm):
    res = gen(tiny_llm, PROMPT, SamplingParams(temperature=1.0, max_tokens=2, n=2, prompt_logprobs=1))[0]
    assert len(res.prompt_logprobs) == len(res.prompt_token_ids)


# ---- chat, metrics, prompt forms ----

def test_chat_uses_the_template(llm):
    messages = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
    res = llm.chat(messages, SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
    assert len(res) == 1
    expected_ids = llm.tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(expected_ids, dict) or hasattr(expected_ids, "input_ids"):
        expected_ids = expected_ids["input_ids"]
    assert res[0].prompt_token_ids == list(expected_ids)
    assert res[0].prompt.rstrip().endswith("<|im_start|>assistant")
    out = res[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop" and out.token_ids[-1] == llm.tokenizer.eos_token_id
    assert "<|im_end|>" not in out.text
    # A list of conversations gives one output each.
    two = llm.chat([messages, [{"role": "user", "content": "Say hello."}]],
                   SamplingParams(temperature=0.0, max_tokens=4), use_tqdm=False)
    assert len(two) == 2 and two[0].outputs[0].token_ids == out.token_ids[:4]


def test_outputs_carry_metrics(tiny_llm):
    for res in gen(tiny_llm, [PROMPT, OTHER_PROMPTS[0]], sampled(max_tokens=6)) + \
            gen(tiny_llm, PROMPT, greedy(max_tokens=20, stop=[" "])):
        m = res.metrics
        assert res.finished and m is not None
        for v in (m.queue_time, m.ttft, m.e2e):
            assert v is not None and v >= 0
        assert m.queue_time <= m.ttft <= m.e2e


def test_prompt_forms(tiny_llm):
    params = SamplingParams(temperature=0.0, max_tokens=6)
    ids = tiny_llm.tokenizer.encode(PROMPT)
    other_ids = tiny_llm.tokenizer.encode(OTHER_PROMPTS[1])
    from_str = gen(tiny_llm, PROMPT, params)
    from_strs = gen(tiny_llm, [PROMPT, OTHER_PROMPTS[1]], params)
    from_ids = gen(tiny_llm, ids, params)
    from_id_lists = gen(tiny_llm, [ids, other_ids], params)
    assert len(from_str) == len(from_ids) == 1 and len(from_strs) == len(from_id_lists) == 2
    expected = from_str[0].outputs[0].token_ids
    assert len(expected) == 6
    assert from_ids[0].outputs[0].token_ids == expected
    assert from_strs[0].outputs[0].token_ids == expected == from_id_lists[0].outputs[0].token_ids
    assert from_strs[1].outputs[0].token_ids == from_id_lists[1].outputs[0].token_ids
    assert from_str[0].prompt == PROMPT and from_ids[0].prompt is None
    assert from_str[0].prompt_token_ids == ids == from_ids[0].prompt_token_ids
    assert from_strs[1].outputs[0].text == from_id_lists[1].outputs[0].text != ""
    # One SamplingParams per prompt.
    per = gen(tiny_llm, [PROMPT, PROMPT], [SamplingParams(temperature=0.0, max_tokens=2), params])
    assert [len(r.outputs[0].token_ids) for r in per] == [2, 6]


# ---- the sampled distribution of a real model's next token ----

def test_first_token_distribution_matches_hf(llm, hf_reference):
    """Temperature 0.7 and top_k=5: the first sampled token follows softmax(top5(logits / 0.7)) of HF's logits.

    The prompt is 17 tokens: after the first request, the other requests find its first block in the prefix
    cache and compute one token each, all in one batched decode-style step per 256 requests."""
    ids = llm.tokenizer.encode("When I went to the market this morning I bought some apples, some bread and a")[:17]
    assert len(ids) == 17
    draws = 800
    outs = gen(llm, [ids] * draws, SamplingParams(temperature=0.7, top_k=5, max_tokens=1))
    tokens = np.array([o.outputs[0].token_ids[0] for o in outs])
    with torch.inference_mode():
        logits = hf_reference(torch.tensor([ids])).logits[0, -1].double()
    top = logits.topk(5).indices.numpy()
    assert set(tokens.tolist()) <= set(top.tolist())  # top_k: nothing outside the five (30% of the mass)
    counts = np.array([(tokens == t).sum() for t in top])

    def expected(temperature):
        return torch.softmax(logits[top] / temperature, 0).numpy() * draws
    assert chisquare(counts, expected(0.7)).pvalue > 1e-3
    assert chisquare(counts, expected(1.0)).pvalue < 1e-9  # fails if temperature were ignored


def test_cache_salt_keys_the_prefix_cache_apart(tiny_llm):
    """vLLM's cache_salt: the same prompt is a prefix-cache hit only under the same salt; the router keys a salted
    prompt as the engine does (one block hash: sampling_params.cache_salt_keys)."""
    from tokenmill.engine.block_hash import hash_request_blocks
    from tokenmill.router.kv_index import prompt_block_hashes
    from tokenmill.sampling_params import cache_salt_keys
    prompt = list(range(100, 180))  # five full blocks

    def cached(salt):
        return gen(tiny_llm, [prompt], greedy(max_tokens=1, cache_salt=salt))[0].num_cached_tokens
    assert cached("tenant-a") == 0
    assert cached("tenant-a") >= 64  # the same salt shares
    assert cached("tenant-b") == 0 and cached(None) == 0  # another salt, or none, does not
    request = tiny_llm.engine.add_request("salted", prompt, greedy(max_tokens=1, cache_salt="tenant-a"))
    tiny_llm.engine.abort_request("salted")
    bs = tiny_llm.engine.kv_cache.block_size
    predicted = prompt_block_hashes(prompt, bs, cache_salt_keys("tenant-a"))  # the blocks a hit can cover
    assert len(predicted) >= 4 and predicted == hash_request_blocks(prompt, bs, request.extra_keys)[:len(predicted)]
    assert prompt_block_hashes(prompt, bs, cache_salt_keys("tenant-a")) != prompt_block_hashes(prompt, bs)
    with pytest.raises(ParamError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_allowed_token_ids_and_bad_words_offline(tiny_llm):
    """allowed_token_ids bounds every sampled token; bad_words (tokenized by LLM with its tokenizer, vLLM's rule)
    bans a word the greedy answer has, which the same greedy request then never generates."""
    from tokenmill.sampling_params import bad_words_token_ids
    out = one(tiny_llm, PROMPT, sampled(max_tokens=16, allowed_token_ids=[300, 400, 500]))
    assert set(out.token_ids) <= {300, 400, 500}
    plain = one(tiny_llm, PROMPT, greedy(max_tokens=8)).token_ids
    # a token of the answer that is a whole word as bad_words tokenizes it (" the" is "the" after a space)
    i, word = next((i, tiny_llm.tokenizer.decode([t])) for i, t in enumerate(plain)
                   if [t] in bad_words_token_ids(tiny_llm.tokenizer, [tiny_llm.tokenizer.decode([t])]))
    out = one(tiny_llm, PROMPT, greedy(max_tokens=8, bad_words=[word])).token_ids
    assert plain[i] not in out and out[:i] == plain[:i]  # the same answer up to the banned word
