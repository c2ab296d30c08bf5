"""The sampler on synthetic logits: chi-square goodness of fit of every sampling transform, penalties and
biases against hand-computed values, min_tokens masking, greedy rows, seeds and logprobs.

Each distribution test draws many rows of one small vocabulary in a single batched call, from a sampler with
a fixed seed, so the outcome is deterministic; the thresholds still leave a wide margin either way (a correct
sampler gives p-values far above 1e-3, a sampler missing the feature gives p-values far below 1e-9)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tokenmill.engine.request import Request
from tokenmill.engine.sampler import Sampler
from tokenmill.sampling_params import ParamError, SamplingParams

V = 8
N = 20_000
# A spread-out distribution with a clear nucleus boundary, its tokens deliberately not in sorted order.
PROBS = np.array([0.05, 0.40, 0.005, 0.15, 0.25, 0.03, 0.10, 0.015])
LOGITS = torch.tensor(np.log(PROBS), dtype=torch.float32) + 1.7  # an offset changes nothing after softmax

P_OK = 1e-3  # a correct sampler must not be rejected
P_BAD = 1e-9  # a sampler missing the feature must be


def make_request(params: SamplingParams, prompt=(0,), output=(), eos: int | None = None, rid: str = "r") -> Request:
    r = Request(rid, list(prompt), params, eos, max_tokens=64)
    for t in output:
        r.append_output_token(t)
    return r


def draw(params: SamplingParams, logits: torch.Tensor = LOGITS, n: int = N, seed: int = 0, **req_kw) -> np.ndarray:
    """Counts per token of n draws of one request's next token (n rows of the same request in one batch)."""
    sampler = Sampler(logits.shape[-1], torch.device("cpu"), seed=seed)
    req = make_request(params, **req_kw)
    out = sampler(logits.expand(n, -1).clone(), [req] * n)
    return np.bincount(out.token_ids, minlength=logits.shape[-1])


def softmax(x: np.ndarray) -> np.ndarray:
    e = np.exp(x - x.max())
    return e / e.sum()


def pvalue(counts: np.ndarray, expected: np.ndarray) -> float:
    """Chi-square p-value of counts against probabilities; tokens of zero probability must never appear."""
    expected = np.asarray(expected, dtype=np.float64)
    support = expected > 0
    assert counts[~support].sum() == 0, f"drew tokens of zero probability: {np.nonzero(counts * ~support)[0]}"
    if support.sum() == 1:
        return 1.0
    f_exp = expected[support] / expected[support].sum() * counts.sum()
    return chisquare(counts[support], f_exp).pvalue


def reference(logits, temperature=1.0, top_k=0, top_p=1.0, min_p=0.0) -> np.ndarray:
    """The distribution the sampler must draw from: temperature, top-k, top-p (smallest set reaching p), min-p."""
    x = np.asarray(logits, dtype=np.float64) / temperature
    order = np.argsort(-x, kind="stable")
    keep = np.zeros(len(x), dtype=bool)
    keep[order[:top_k or len(x)]] = True
    p = softmax(np.where(keep, x, -np.inf))
    mass_before = np.cumsum(p[order]) - p[order]
    keep[order[mass_before >= top_p]] = False
    p = softmax(np.where(keep, x, -np.inf))
    p[p < min_p * p.max()] = 0.0
    return p / p.sum()


def test_reference_matches_hand_computed_values():
    # The reference itself, checked by hand on PROBS: nucleus 0.75 needs .40+.25+.15; min_p 0.2 keeps p >= 0.08.
    np.testing.assert_allclose(reference(LOGITS, top_p=0.75), [0, .5, 0, .1875, .3125, 0, 0, 0], atol=1e-6)
    np.testing.assert_allclose(reference(LOGITS, top_k=2), [0, .4 / .65, 0, 0, .25 / .65, 0, 0, 0], atol=1e-6)
    np.testing.assert_allclose(reference(LOGITS, min_p=0.2), [0, .4 / .9, 0, .15 / .9, .25 / .9, 0, .1 / .9, 0],
                               atol=1e-6)
    np.testing.assert_allclose(reference(LOGITS, temperature=0.5), PROBS**2 / (PROBS**2).sum(), atol=1e-6)


def test_plain_sampling_draws_softmax():
    counts = draw(SamplingParams(temperature=1.0))
    assert pvalue(counts, PROBS) > P_OK


@pytest.mark.parametrize("temperature", [0.5, 2.0])
def test_temperature_scales_logits(temperature):
    counts = draw(SamplingParams(temperature=temperature), seed=1)
    expected = softmax(LOGITS.double().numpy() / temperature)
    assert pvalue(counts, expected) > P_OK
    # Fails if temperature were ignored: the draws are far from the unscaled softmax.
    assert chisquare(counts, PROBS * N).pvalue < P_BAD


def test_different_temperatures_give_different_distributions():
    cold = draw(SamplingParams(temperature=0.5), seed=2)
    hot = draw(SamplingParams(temperature=2.0), seed=3)
    top = int(np.argmax(PROBS))
    assert cold[top] / N > 0.6 and hot[top] / N < 0.35  # expected 0.66 and 0.26
    table = np.stack([cold, hot])
    from scipy.stats import chi2_contingency
    assert chi2_contingency(table[:, table.sum(0) > 0]).pvalue < P_BAD


@pytest.mark.parametrize("top_k,temperature", [(1, 1.0), (3, 1.0), (3, 0.7), (5, 1.5)])
def test_top_k(top_k, temperature):
    counts = draw(SamplingParams(temperature=temperature, top_k=top_k), seed=4)
    expected = reference(LOGITS, temperature, top_k=top_k)
    assert (expected > 0).sum() == top_k
    assert pvalue(counts, expected) > P_OK


@pytest.mark.parametrize("top_p,temperature", [(0.75, 1.0), (0.5, 1.0), (0.9, 0.6), (0.95, 1.3)])
def test_top_p(top_p, temperature):
    counts = draw(SamplingParams(temperature=temperature, top_p=top_p), seed=5)
    expected = reference(LOGITS, temperature, top_p=top_p)
    assert 1 < (expected > 0).sum() < V
    assert pvalue(counts, expected) > P_OK


def test_top_p_nucleus_hand_computed():
    # Keep the smallest set of most likely tokens whose mass reaches 0.75: {1, 4, 3}, renormalized over 0.8.
    counts = draw(SamplingParams(top_p=0.75), seed=6)
    assert set(np.nonzero(counts)[0]) == {1, 3, 4}
    assert pvalue(counts, [0, .5, 0, .1875, .3125, 0, 0, 0]) > P_OK


@pytest.mark.parametrize("min_p,temperature", [(0.2, 1.0), (0.05, 1.0), (0.3, 1.5)])
def test_min_p(min_p, temperature):
    counts = draw(SamplingParams(temperature=temperature, min_p=min_p), seed=7)
    expected = reference(LOGITS, temperature, min_p=min_p)
    assert 1 < (expected > 0).sum() < V
    assert pvalue(counts, expected) > P_OK


def test_top_k_top_p_min_p_combined():
    params = SamplingParams(temperature=0.9, top_k=5, top_p=0.9, min_p=0.1)
    counts = draw(params, seed=8)
    assert pvalue(counts, reference(LOGITS, 0.9, top_k=5, top_p=0.9, min_p=0.1)) > P_OK


def test_mixed_batch_applies_each_rows_own_params():
    """Rows with different temperature/top-k/top-p/min-p and greedy rows, interleaved in one call."""
    groups = [SamplingParams(temperature=0.5), SamplingParams(top_k=3), SamplingParams(top_p=0.75),
              SamplingParams(min_p=0.2, temperature=2.0), SamplingParams(temperature=0.0),
              SamplingParams(temperature=1.0)]
    per = 8000
    reqs = [make_request(groups[i % len(groups)]) for i in range(len(groups))]
    rows = [reqs[i % len(groups)] for i in range(per * len(groups))]
    sampler = Sampler(V, torch.device("cpu"), seed=9)
    tokens = np.array(sampler(LOGITS.expand(len(rows), -1).clone(), rows).token_ids)
    expected = [reference(LOGITS, 0.5), reference(LOGITS, top_k=3), reference(LOGITS, top_p=0.75),
                reference(LOGITS, 2.0, min_p=0.2), None, reference(LOGITS)]
    for g, exp in enumerate(expected):
        got = tokens[g::len(groups)]
        if exp is None:
            assert (got == int(LOGITS.argmax())).all()
            continue
        assert pvalue(np.bincount(got, minlength=V), exp) > P_OK, groups[g]


def test_greedy_rows_in_mixed_batch_are_argmax():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=gen) * 3
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5),
              SamplingParams(temperature=0.0, top_k=3, top_p=0.5, min_p=0.3), SamplingParams(temperature=0.8, seed=3)]
    reqs = [make_request(params[i % 4], rid=str(i)) for i in range(64)]
    tokens = torch.tensor(Sampler(50, torch.device("cpu"), seed=0)(logits, reqs).token_ids)
    greedy = torch.tensor([r.params.greedy for r in reqs])
    assert torch.equal(tokens[greedy], logits.argmax(-1)[greedy])
    # The sampled rows really sample (with these logits they do not all land on the argmax).
    assert not torch.equal(tokens[~greedy], logits.argmax(-1)[~greedy])


def test_all_greedy_batch_is_argmax():
    logits = torch.randn(16, 50, generator=torch.Generator().manual_seed(1))
    reqs = [make_request(SamplingParams(temperature=0.0), rid=str(i)) for i in range(16)]
    assert Sampler(50, torch.device("cpu"))(logits, reqs).token_ids == logits.argmax(-1).tolist()


def test_logits_beyond_vocab_are_ignored():
    # Padded lm_head rows beyond the vocabulary must never be drawn.
    logits = torch.cat([torch.zeros(N, V), torch.full((N, 4), 50.0)], dim=1)
    req = make_request(SamplingParams(temperature=1.0))
    tokens = Sampler(V, torch.device("cpu"))(logits, [req] * N).token_ids
    assert max(tokens) < V and pvalue(np.bincount(tokens, minlength=V), np.full(V, 1 / V)) > P_OK


# ---- penalties and biases, against hand-computed logits ----

PEN_LOGITS = torch.tensor([2.0, -1.0, 0.5, 3.0, -2.0, 0.0, 1.0, -0.5])
PROMPT = (0, 1)  # prompt tokens: repetition penalty only
OUTPUT = (3, 3, 4)  # output tokens: all three penalties; token 3 twice


def penalized(params: SamplingParams, prompt=PROMPT, output=OUTPUT, logits=PEN_LOGITS) -> torch.Tensor:
    req = make_request(params, prompt=prompt, output=output)
    other = make_request(SamplingParams(), prompt=prompt, output=output, rid="plain")
    batch = torch.stack([logits, logits])
    got = Sampler(V, torch.device("cpu"))._apply_bias_and_penalties(batch.clone(), [other, req])
    torch.testing.assert_close(got[0], logits)  # the row without penalties is untouched
    return got[1]


def test_repetition_penalty_hand_computed():
    # Seen in prompt or output: 0 (2.0 → 1.0), 1 (-1.0 → -2.0), 3 (3.0 → 1.5), 4 (-2.0 → -4.0).
    expected = torch.tensor([1.0, -2.0, 0.5, 1.5, -4.0, 0.0, 1.0, -0.5])
    torch.testing.assert_close(penalized(SamplingParams(repetition_penalty=2.0)), expected)
    # A penalty below one rewards repeats instead.
    expected = torch.tensor([4.0, -0.5, 0.5, 6.0, -1.0, 0.0, 1.0, -0.5])
    torch.testing.assert_close(penalized(SamplingParams(repetition_penalty=0.5)), expected)


def test_presence_penalty_hand_computed():
    # Output tokens only (3 and 4), once each whatever the count; prompt token 0 is not penalized.
    expected = torch.tensor([2.0, -1.0, 0.5, 2.5, -2.5, 0.0, 1.0, -0.5])
    torch.testing.assert_close(penalized(SamplingParams(presence_penalty=0.5)), expected)
    expected = torch.tensor([2.0, -1.0, 0.5, 4.5, -0.5, 0.0, 1.0, -0.5])
    torch.testing.assert_close(penalized(SamplingParams(presence_penalty=-1.5)), expected)


def test_frequency_penalty_hand_computed():
    # Proportional to the count in the output: token 3 twice (-0.5), token 4 once (-0.25).
    expected = torch.tensor([2.0, -1.0, 0.5, 2.5, -2.25, 0.0, 1.0, -0.5])
    torch.testing.assert_close(penalized(SamplingParams(frequency_penalty=0.25)), expected)


def test_all_penalties_combined_hand_computed():
    # Repetition first, then frequency and presence: token 3: 3/2 - 2*0.25 - 0.5 = 0.5; token 4: -4 - 0.25 - 0.5.
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5)
    expected = torch.tensor([1.0, -2.0, 0.5, 0.5, -4.75, 0.0, 1.0, -0.5])
    torch.testing.assert_close(penalized(params), expected)


def test_penalties_without_output_tokens():
    # Nothing generated yet: only the repetition penalty on prompt tokens applies.
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0, presence_penalty=1.0)
    expected = torch.tensor([1.0, -2.0, 0.5, 3.0, -2.0, 0.0, 1.0, -0.5])
    torch.testing.assert_close(penalized(params, output=()), expected)


def test_logit_bias_hand_computed():
    params = SamplingParams(logit_bias={2: 5.0, 3: -100.0, 7: 0.25})
    expected = torch.tensor([2.0, -1.0, 5.5, -97.0, -2.0, 0.0, 1.0, -0.25])
    torch.testing.assert_close(penalized(params, output=()), expected)


def test_penalties_shape_the_sampled_distribution():
    # End to end through __call__: draws follow softmax of the penalized logits, not of the raw ones.
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.25, presence_penalty=0.5,
                            logit_bias={5: 1.0})
    counts = draw(params, logits=PEN_LOGITS, seed=10, prompt=PROMPT, output=OUTPUT)
    expected = softmax(np.array([1.0, -2.0, 0.5, 0.5, -4.75, 1.0, 1.0, -0.5]))
    assert pvalue(counts, expected) > P_OK
    assert chisquare(counts, softmax(PEN_LOGITS.double().numpy()) * N).pvalue < P_BAD


def test_greedy_follows_penalties_and_bias():
    logits = PEN_LOGITS[None].clone()
    sampler = Sampler(V, torch.device("cpu"))

    def pick(**kw):
        return sampler(logits, [make_request(SamplingParams(temperature=0.0, **kw), prompt=PROMPT,
                                             output=OUTPUT)]).token_ids[0]
    assert pick() == 3
    assert pick(repetition_penalty=4.0) == 6  # seen tokens shrink: 0 → 0.5, 3 → 0.75; unseen 6 (1.0) wins
    assert pick(frequency_penalty=1.0) == 0  # 3: 3 - 2 = 1 < 2
    assert pick(logit_bias={7: 10.0}) == 7
    assert pick(logit_bias={3: -100.0}) == 0


# ---- min_tokens ----

EOS, STOP = 3, 5
MT_LOGITS = torch.tensor([0.0, 0.5, -1.0, 3.0, 0.2, 2.5, 1.0, -0.5])  # EOS and the stop token lead


def test_min_tokens_masks_eos_and_stop_token_ids():
    params = SamplingParams(min_tokens=3, stop_token_ids=[STOP])
    counts = draw(params, logits=MT_LOGITS, seed=11, output=(1, 2), eos=EOS)
    assert counts[EOS] == 0 and counts[STOP] == 0
    expected = softmax(MT_LOGITS.double().numpy())
    expected[[EOS, STOP]] = 0
    assert pvalue(counts, expected) > P_OK
    # Greedy too.
    req = make_request(SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[STOP]), output=(1, 2), eos=EOS)
    assert Sampler(V, torch.device("cpu"))(MT_LOGITS[None].clone(), [req]).token_ids == [6]


def test_min_tokens_lifted_once_reached():
    params = SamplingParams(min_tokens=3, stop_token_ids=[STOP])
    counts = draw(params, logits=MT_LOGITS, seed=12, output=(1, 2, 0), eos=EOS)
    assert pvalue(counts, softmax(MT_LOGITS.double().numpy())) > P_OK
    req = make_request(SamplingParams(temperature=0.0, min_tokens=3), output=(1, 2, 0), eos=EOS)
    assert Sampler(V, torch.device("cpu"))(MT_LOGITS[None].clone(), [req]).token_ids == [EOS]


def test_min_tokens_with_ignore_eos_masks_only_stop_tokens():
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[STOP], ignore_eos=True)
    req = make_request(params, eos=EOS)
    assert Sampler(V, torch.device("cpu"))(MT_LOGITS[None].clone(), [req]).token_ids == [EOS]
    params = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[EOS, STOP], ignore_eos=True)
    req = make_request(params, eos=EOS)
    assert Sampler(V, torch.device("cpu"))(MT_LOGITS[None].clone(), [req]).token_ids == [6]


def test_min_tokens_masks_only_its_own_row():
    params = SamplingParams(temperature=0.0, min_tokens=2)
    masked, free = make_request(params, eos=EOS, rid="a"), make_request(SamplingParams(temperature=0.0), eos=EOS,
                                                                         rid="b")
    out = Sampler(V, torch.device("cpu"))(MT_LOGITS.expand(2, -1).clone(), [masked, free]).token_ids
    assert out == [STOP, EOS]


# ---- seeds and logprobs ----

def test_seeded_rows_do_not_depend_on_the_batch():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(2))

    def run(batch_extra: int, seed_sampler: int) -> list[int]:
        sampler = Sampler(50, torch.device("cpu"), seed=seed_sampler)
        seeded = make_request(SamplingParams(temperature=1.0, seed=1234), rid="s")
        others = [make_request(SamplingParams(temperature=1.0, seed=None if i % 2 else i), rid=f"o{i}")
                  for i in range(batch_extra)]
        toks = []
        for _ in range(40):
            batch = others[:batch_extra // 2] + [seeded] + others[batch_extra // 2:]
            toks.append(sampler(logits.expand(len(batch), -1).clone(), batch).token_ids[batch_extra // 2])
        return toks
    alone = run(0, 0)
    assert run(5, 7) == alone and run(12, 3) == alone
    assert len(set(alone)) > 5  # it samples


def test_same_seed_same_draws_different_seed_different_draws():
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(3))

    def run(seed):
        sampler, req = Sampler(50, torch.device("cpu")), make_request(SamplingParams(seed=seed))
        return [sampler(logits.clone(), [req]).token_ids[0] for _ in range(30)]
    assert run(5) == run(5)
    assert run(5) != run(6)


def test_logprobs_are_raw_and_ranked():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(4)) * 2
    reqs = [make_request(SamplingParams(temperature=0.3, logprobs=3, repetition_penalty=1.5), rid="a"),
            make_request(SamplingParams(temperature=0.0), rid="b"),
            make_request(SamplingParams(temperature=2.0, logprobs=0, logit_bias={7: 20.0}), rid="c"),
            make_request(SamplingParams(temperature=1.0, logprobs=5), rid="d")]
    out = Sampler(50, torch.device("cpu"), seed=5)(logits, reqs)
    raw = torch.log_softmax(logits, -1)
    assert out.logprobs[1] is None
    assert out.token_ids[2] == 7
    for i, k in ((0, 3), (2, 0), (3, 5)):
        tok, lp, rank, top_ids, top_lps = out.logprobs[i]
        assert tok == out.token_ids[i]
        assert lp == pytest.approx(raw[i, tok].item(), abs=1e-6)  # of the model output, before bias/penalties
        assert rank == int((raw[i] > raw[i, tok]).sum()) + 1
        assert top_ids == raw[i].topk(k).indices.tolist() if k else top_ids == []
        assert top_lps == sorted(top_lps, reverse=True) and len(top_lps) == k
        np.testing.assert_allclose(top_lps, raw[i, top_ids].numpy(), atol=1e-6)


@pytest.mark.parametrize("spread", [0.5, 3.0, 30.0])  # flat (nucleus beyond the candidates) to peaked
def test_top_k_top_p_without_full_sort_equals_full_sort(spread):
    """The candidate path (top-k of each row) and its fallback give exactly the full sort's mask, for rows with
    top-k, top-p, both and neither in one batch, over a vocabulary larger than the candidates."""
    g = torch.Generator().manual_seed(int(spread * 10))
    vocab = 5000
    logits = torch.randn(8, vocab, generator=g) * spread
    top_k = [0, 0, 50, 3000, 0, 7, 0, 1]
    top_p = [0.9, 0.5, 1.0, 0.95, 1.0, 0.3, 0.999, 0.8]
    got = Sampler._top_k_top_p(logits, top_k, top_p)
    want = Sampler._top_k_top_p_sorted(logits, top_k, top_p)
    # A row with neither is left whole (the full sort's float32 cumsum can reach 1.0 early and cut its tail).
    assert torch.equal(got[4], logits[4])
    rows = [i for i in range(len(top_k)) if i != 4]
    assert torch.equal(torch.isinf(got[rows]), torch.isinf(want[rows]))
    assert torch.equal(got[rows][~torch.isinf(got[rows])], want[rows][~torch.isinf(want[rows])])


def test_allowed_token_ids_restrict_the_draw_and_the_argmax():
    allowed = [0, 3, 5]
    counts = draw(SamplingParams(allowed_token_ids=allowed))
    kept = np.where(np.isin(np.arange(V), allowed), PROBS, 0.0)
    assert pvalue(counts, kept) > P_OK  # the allowed tokens, in their own proportions; no other ever
    greedy = draw(SamplingParams(temperature=0.0, allowed_token_ids=allowed), n=4)
    assert greedy[3] == 4  # the most likely allowed token, though token 1 is the most likely of all
    with pytest.raises(ParamError, match="allowed_token_ids"):
        SamplingParams(allowed_token_ids=[])


def test_bad_words_ban_a_words_last_token_once_its_others_were_generated():
    one_token, two_tokens = [1], [4, 6]
    params = SamplingParams(bad_words=["x"], bad_words_token_ids=[one_token, two_tokens])
    counts = draw(params, output=(2,))  # 4 was not the last token: 6 may come, 1 never
    assert pvalue(counts, np.where(np.arange(V) == 1, 0.0, PROBS)) > P_OK
    after_4 = draw(params, output=(2, 4))  # 4 was: 6 would complete the word
    assert pvalue(after_4, np.where(np.isin(np.arange(V), [1, 6]), 0.0, PROBS)) > P_OK


def test_bad_words_token_ids_as_vllm_tokenizes_them(tokenizer):
    from tokenmill.sampling_params import bad_words_token_ids
    ids = bad_words_token_ids(tokenizer, ["Paris", " hello world"])
    encode = lambda text: tokenizer.encode(text, add_special_tokens=False)  # noqa: E731
    assert encode("Paris") in ids and encode(" Paris") in ids  # as written, and after a space
    assert encode("hello world") in ids and encode(" hello world") in ids  # the word's own leading space dropped
