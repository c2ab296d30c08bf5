"""Speculative decoding (--speculative-config, tokenmill/engine/spec_decode/).

Against the engine without speculation, with drafts really accepted (asserted from the counters): greedy token
ids are equal with ngram and suffix proposers (the default model, copy-heavy prompts) and with a draft model (a
tiny random target and a draft made from it by perturbing its weights and halving its logits), under chunked
prefill, prefix hits and preemption, and seeded sampling gives the same tokens too; a stop token, EOS or
max_tokens inside an accepted run ends the request at that token; only blocks of real (accepted) tokens enter the
prefix cache. The draft model's KV follows the accepted tokens: every draft equals HF's greedy continuation by the
draft of the request's tokens at that step. Sampled drafts from the draft model: chi-square tests that every
emitted position is distributed as the target's (temperature, top-k, top-p), where the same test rejects the
draft's distribution. The rejection sampler alone: chi-square tests that its output is distributed as the target
(temperature, top-k, top-p), for a one-hot draft and for a draft distribution that differs from the target."""
from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass

import httpx
import pytest
import torch

from tokenmill import LLM, SamplingParams
from tokenmill.config import SpeculativeConfig
from tokenmill.engine.block_hash import hash_request_blocks
from tokenmill.engine.request import Request
from tokenmill.engine.sampler import Sampler
from tokenmill.engine.spec_decode import adaptive
from tokenmill.engine.spec_decode.ngram_proposer import NgramProposer
from tokenmill.engine.spec_decode.rejection_sampler import general_rejection_sample, verify
from tokenmill.engine.spec_decode.suffix_proposer import SuffixProposer
from helpers import MODEL, RemoteServer, llm_sharing_weights, metric_value, scrape_metrics

PASSAGES = [
    "The lighthouse keeper climbed the spiral stairs every evening at dusk, counting the one hundred and twelve "
    "steps as his father had done before him. From the lantern room he could see the whole bay.",
    "def merge_sort(items):\n    if len(items) <= 1:\n        return items\n    middle = len(items) // 2\n"
    "    left = merge_sort(items[:middle])\n    right = merge_sort(items[middle:])\n    return merge(left, right)\n",
    "Dear Ms. Alvarez, thank you for your letter of the fourteenth. I am sorry to hear that the parcel arrived "
    "damaged. We have sent a replacement by express courier, and it should reach you by Thursday.",
]
PROMPTS = [f"Repeat the following text exactly.\n\nText: {p}\n\nRepeated text:" for p in PASSAGES]
MAX_TOKENS = 40
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=MAX_TOKENS)
# draft_model runs on the tiny pair (tiny_models); its "model" is filled in by setup_for. Three requests decode at
# once: max_verify_tokens 16 leaves drafts to each (the default, 4, would give them none).
METHODS = [pytest.param({"method": "ngram", "num_speculative_tokens": 4, "max_verify_tokens": 16},
                        marks=pytest.mark.slow, id="ngram"),
           pytest.param({"method": "suffix", "max_verify_tokens": 16}, marks=pytest.mark.slow, id="suffix"),
           pytest.param({"method": "draft_model", "num_speculative_tokens": 4, "max_verify_tokens": 16},
                        id="draft_model")]


def make_llm(**kw) -> LLM:
    """A fresh engine per configuration on the default model as it ships (quantization auto), the weights loaded
    once (helpers.llm_sharing_weights)."""
    return llm_sharing_weights(dtype="float32", quantization="auto", **kw)


@pytest.fixture(scope="module")
def prompt_ids(tokenizer) -> list[list[int]]:
    return [tokenizer.encode(p) for p in PROMPTS]


@pytest.fixture(scope="module")
def plain(prompt_ids):
    """Greedy ids without speculation (whole prompts in one step), the reference of every greedy test."""
    llm = make_llm()
    return [o.outputs[0].token_ids for o in llm.generate(prompt_ids, GREEDY, use_tqdm=False)]


TINY_VOCAB = 64


def tiny_tokenizer(prefix: str = "t"):
    """A word-level tokenizer of TINY_VOCAB words (prefix0, prefix1, ...): another prefix, another vocabulary."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"{prefix}{i}": i for i in range(TINY_VOCAB)}, unk_token=f"{prefix}0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token=f"{prefix}0", eos_token=f"{prefix}1")


def build_tiny(out_dir, like=None, vocab: int = TINY_VOCAB, prefix: str = "t"):
    """A random 2-layer Llama with its own tokenizer; like: a model whose weights it copies, perturbed by 2% of
    each tensor's spread, with the final norm halved (logits halved: a flatter distribution, same argmax mostly).
    Returns the HF model (float32)."""
    import transformers
    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                      num_attention_heads=2, num_key_value_heads=1, vocab_size=vocab,
                                      max_position_embeddings=512, initializer_range=0.3, tie_word_embeddings=True,
                                      bos_token_id=None, eos_token_id=None)  # every id an ordinary token
    torch.manual_seed(0 if like is None else 1)
    model = transformers.LlamaForCausalLM(config).eval()
    if like is not None:
        with torch.no_grad():
            for (name, p), ref in zip(model.named_parameters(), like.parameters()):
                p.copy_(ref + 0.02 * ref.std() * torch.randn_like(ref))
            model.model.norm.weight.mul_(0.5)
    model.save_pretrained(out_dir, safe_serialization=True)
    tiny_tokenizer(prefix).save_pretrained(out_dir)
    return model


@pytest.fixture(scope="module")
def tiny_models(tmp_path_factory):
    """(target dir, draft dir, HF target, HF draft): greedy agreement ~80%, total variation ~0.38."""
    target_dir, draft_dir = tmp_path_factory.mktemp("target"), tmp_path_factory.mktemp("draft")
    target = build_tiny(target_dir)
    draft = build_tiny(draft_dir, like=target)
    return str(target_dir), str(draft_dir), target, draft


def make_tiny_llm(target_dir: str, **kw) -> LLM:
    return LLM(target_dir, device="cpu", dtype="float32", max_model_len=512, kv_cache_memory="16MiB", **kw)


@dataclass
class Setup:
    """An engine to test a method on: make(**engine args), its prompts and their plain greedy ids; a KV pool
    size (blocks of 16) that holds one sequence but not all at once."""
    make: Callable[..., LLM]
    prompt_ids: list[list[int]]
    plain: list[list[int]]
    preemption_blocks: int


@pytest.fixture(scope="module")
def default_setup(prompt_ids, plain) -> Setup:
    return Setup(make_llm, prompt_ids, plain, 12)  # ~110 tokens a sequence: 12 blocks hold one, not three


@pytest.fixture(scope="module")
def tiny_setup(tiny_models) -> Setup:
    make = lambda **kw: make_tiny_llm(tiny_models[0], **kw)  # noqa: E731
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, TINY_VOCAB, (n,), generator=generator).tolist() for n in (70, 56, 63)]
    plain = [o.outputs[0].token_ids for o in make().generate(prompts, GREEDY, use_tqdm=False)]
    # 9 blocks: the first two prompts fill them, and the first new block either needs preempts the other
    return Setup(make, prompts, plain, 9)


def setup_for(request, config: dict) -> tuple[Setup, dict]:
    """ngram and suffix on the default model; a draft model on the tiny pair, the draft as its "model"."""
    if config["method"] != "draft_model":
        return request.getfixturevalue("default_setup"), config
    return request.getfixturevalue("tiny_setup"), {**config, "model": request.getfixturevalue("tiny_models")[1]}


def spec_stats(llm: LLM) -> dict:
    return {k: v for k, v in llm.engine.stats().items() if k.startswith("spec_")}


def assert_accepted(llm: LLM, per_verification: float = 1.0) -> dict:
    """Drafts were verified, and more than per_verification of them accepted per verification on average."""
    stats = spec_stats(llm)
    assert stats["spec_num_drafts"] > 0, stats
    assert stats["spec_num_accepted_tokens"] > per_verification * stats["spec_num_drafts"], stats
    assert sum(stats["spec_accepted_per_pos"]) == stats["spec_num_accepted_tokens"]
    return stats


# ---- the server ----

@pytest.mark.slow
def test_server_counts_drafts_in_vllm_metrics(server):
    """A server with n-gram speculation answers a copy prompt as the plain (shared) server does, and counts its
    drafts in vLLM's spec-decode counters, which agree with each other."""
    config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    spec = RemoteServer(["--speculative-config", json.dumps(config)])
    try:
        body = {"model": MODEL, "prompt": PROMPTS[0], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        plain_text, spec_text = (
            httpx.post(s.url_for("/v1/completions"), headers=s.headers(), json=body, timeout=120).json()
            ["choices"][0]["text"] for s in (server, spec))
        assert spec_text == plain_text
        m = scrape_metrics(spec)
    finally:
        spec.stop()
    drafts, draft_tokens, accepted = (metric_value(m, f"vllm:spec_decode_num_{n}", f"vllm:spec_decode_num_{n}_total")
                                      for n in ("drafts", "draft_tokens", "accepted_tokens"))
    per_pos = {int(dict(labels)["position"]): v
               for (name, labels), v in m["vllm:spec_decode_num_accepted_tokens_per_pos"]["samples"].items()
               if name.endswith("_total")}
    assert drafts > 0 and drafts <= draft_tokens <= 4 * drafts
    assert 0 < accepted <= draft_tokens
    assert accepted > drafts  # a copy: more than one accepted draft per verification on average
    assert sum(per_pos.values()) == accepted and set(per_pos) <= {0, 1, 2, 3}
    assert per_pos[0] == max(per_pos.values())  # a later position is reached only through the earlier ones


# ---- the engine ----

@pytest.mark.parametrize("config", METHODS)
def test_greedy_equals_plain_chunked_and_prefix_hits(config, request):
    setup, config = setup_for(request, config)
    prompt_ids, plain = setup.prompt_ids, setup.plain
    # budget 48: every prompt is prefilled in chunks, and the chunks share steps with verified drafts
    llm = setup.make(speculative_config=config, max_num_batched_tokens=48)
    steps = []
    schedule = llm.engine.scheduler.schedule

    def recording():
        out = schedule()
        steps.append({r.request_id: (out.num_scheduled_tokens[r.request_id], len(r.spec_token_ids))
                      for r in out.requests})
        return out

    llm.engine.scheduler.schedule = recording
    outs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert_accepted(llm)
    assert max(len(p) for p in prompt_ids) > 48
    assert all(sum(n for n, _ in s.values()) <= 48 for s in steps)
    assert any(any(d for _, d in s.values()) and any(n > 1 and not d for n, d in s.values()) for s in steps), \
        "no step verified drafts beside a prefill chunk"
    # Only real tokens' blocks are cached: every cached key is on the chain of some prompt + output, and every
    # full block of the computed tokens (all but the last output token) is cached, those filled by accepted
    # drafts included.
    pool, bs = llm.engine.kv_cache.pool, llm.engine.kv_cache.block_size
    chains = [hash_request_blocks(p + o.outputs[0].token_ids, bs) for p, o in zip(prompt_ids, outs)]
    real = {h for chain in chains for h in chain}
    assert set(pool.cached) <= real
    for p, o, chain in zip(prompt_ids, outs, chains):
        computed = len(p) + len(o.outputs[0].token_ids) - 1
        assert all(h in pool.cached for h in chain[:computed // bs])
    # Again, the outputs appended to the prompts: the prefix cache serves prompt and accepted-output blocks.
    hits_before = llm.engine.stats()["prefix_cache_hits"]
    longer = [p + o.outputs[0].token_ids[:24] for p, o in zip(prompt_ids, outs)]
    again = llm.generate(longer, SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=16), use_tqdm=False)
    assert all(o.num_cached_tokens >= (len(p) - 1) // bs * bs for o, p in zip(again, longer))
    assert llm.engine.stats()["prefix_cache_hits"] > hits_before
    for o, p, full in zip(again, prompt_ids, plain):
        assert o.outputs[0].token_ids == full[24:40]


@pytest.mark.parametrize("config", METHODS)
def test_greedy_equals_plain_under_preemption(config, request):
    setup, config = setup_for(request, config)
    prompt_ids, plain = setup.prompt_ids, setup.plain
    llm = setup.make(speculative_config=config, num_gpu_blocks_override=setup.preemption_blocks)
    outs = llm.generate(prompt_ids, GREEDY, use_tqdm=False)
    assert llm.engine.stats()["num_preemptions"] > 0
    assert [o.outputs[0].token_ids for o in outs] == plain
    assert_accepted(llm)
    pool = llm.engine.kv_cache.pool
    assert all(b.ref_cnt == 0 for b in pool.blocks) and pool.num_free_blocks == setup.preemption_blocks


@pytest.mark.parametrize("config", [METHODS[0], METHODS[2]])
def test_seeded_sampling_equals_plain(config, request):
    """Verification draws each position as the sampler does, from the request's generator, rewound past the
    positions that emitted nothing: a seeded request gets the same tokens with and without speculation (a draft
    model proposes its argmax for seeded requests: a deterministic proposer)."""
    setup, config = setup_for(request, config)
    params = [SamplingParams(temperature=t, top_k=k, top_p=p, seed=s, max_tokens=24, ignore_eos=True)
              for t, k, p, s in ((0.3, 20, 1.0, 1), (0.5, 0, 0.9, 2))]
    want = [o.outputs[0].token_ids for o in setup.make().generate(setup.prompt_ids[:2], params, use_tqdm=False)]
    llm = setup.make(speculative_config=config)
    got = [o.outputs[0].token_ids for o in llm.generate(setup.prompt_ids[:2], params, use_tqdm=False)]
    assert got == want
    # the tiny draft's argmax is the target's sample less often at these temperatures
    assert_accepted(llm, 0.5 if config["method"] == "draft_model" else 1.0)


def test_draft_model_kv_follows_the_accepted_tokens(tiny_setup, tiny_models):
    """The draft's cache is rolled back past rejected drafts, catches up on the tokens it has not seen, and is
    rebuilt after its blocks were taken back (preemption and eviction): each step's drafts (greedy)
    are the draft's own greedy continuation of the request's tokens at that step (HF's model, teacher-forced)."""
    _, draft_dir, _, draft = tiny_models
    config = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 4, "max_verify_tokens": 16}
    llm = tiny_setup.make(speculative_config=config, max_num_batched_tokens=48,
                          num_gpu_blocks_override=tiny_setup.preemption_blocks)
    proposer, proposed = llm.engine.speculator.proposer, []
    propose_batch = proposer.propose_batch

    def recording(wanted):
        contexts = [list(r.all_token_ids) for r, _ in wanted]
        propose_batch(wanted)
        proposed.extend((c, list(r.spec_token_ids)) for c, (r, _) in zip(contexts, wanted))

    proposer.propose_batch = recording
    outs = llm.generate(tiny_setup.prompt_ids, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == tiny_setup.plain
    stats = assert_accepted(llm)
    assert stats["spec_num_accepted_tokens"] < stats["spec_num_draft_tokens"]  # some were rejected: rollbacks
    assert llm.engine.stats()["num_preemptions"] > 0
    checked = [(context, drafts) for context, drafts in proposed if drafts]  # none: the draft cache was full
    assert len(checked) > len(proposed) // 2
    with torch.inference_mode():  # greedy: each draft is the draft model's argmax after the ones before it
        for context, drafts in checked:
            logits = draft(torch.tensor([context + drafts[:-1]])).logits[0, len(context) - 1:]
            assert logits.argmax(-1).tolist() == drafts
    assert not proposer.sequences and proposer.kv_cache.pool.num_free_blocks == tiny_setup.preemption_blocks


DRAFT_SAMPLING = {"temperature": SamplingParams(temperature=0.8), "top_k": SamplingParams(top_k=5),
                  "top_p": SamplingParams(top_p=0.8)}
N_DRAWS = 1000


def processed_probs(model, sequences: torch.Tensor, first: int, params: SamplingParams) -> torch.Tensor:
    """[N, positions, V]: the model's distribution (HF, float32) for each token from index first on, given the
    tokens before it, after the request's temperature, top-k and top-p."""
    with torch.inference_mode():
        logits = model(sequences).logits[:, first - 1:-1]
    n, positions, vocab = logits.shape
    rows = [Request("r", [0], params, None, 4)] * (n * positions)
    probs = Sampler(vocab, torch.device("cpu")).target_probs(logits.reshape(-1, vocab), rows, [False] * len(rows))
    return (probs / probs.sum(-1, keepdim=True)).view(n, positions, vocab)


def pearson_p(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of tokens [N], each drawn from its own distribution probs[i] (under the hypothesis): Pearson's
    statistic over the counts against the summed probabilities (cells expecting < 5 merged; conservative, since a
    sum of independent categorical draws varies at most as a multinomial does)."""
    from scipy.stats import chisquare
    expected = probs.double().sum(0)
    counts = torch.bincount(tokens, minlength=probs.shape[1]).double()
    if counts[expected == 0].sum() > 0:  # a token the distribution cannot produce
        return 0.0
    big, small = expected >= 5, (expected > 0) & (expected < 5)
    observed, wanted = counts[big], expected[big]
    if small.any():
        observed, wanted = torch.cat([observed, counts[small].sum()[None]]), torch.cat([wanted, expected[small].sum()[None]])
    return float(chisquare(observed.numpy(), wanted.numpy() * observed.sum().item() / wanted.sum().item()).pvalue)


@pytest.mark.parametrize("name", DRAFT_SAMPLING)
def test_draft_model_sampling_is_distributed_as_target(name, tiny_models):
    """N_DRAWS copies of one prompt, 4 tokens each, 2 drafts drawn from the draft's q: every position (the first
    from the plain sampler, then accepted drafts, residual draws and bonus tokens) is distributed as the target's
    p given the tokens before it; the same test rejects q, the draft's distribution."""
    target_dir, draft_dir, target, draft = tiny_models
    params = SamplingParams(temperature=DRAFT_SAMPLING[name].temperature, top_k=DRAFT_SAMPLING[name].top_k,
                            top_p=DRAFT_SAMPLING[name].top_p, max_tokens=4, ignore_eos=True)
    config = {"method": "draft_model", "model": draft_dir, "num_speculative_tokens": 2, "adaptive": False}
    llm = make_tiny_llm(target_dir, speculative_config=config, max_num_seqs=512, max_num_batched_tokens=4096)
    prompt = [5, 17, 33, 2, 48, 9, 60, 21]
    outs = llm.generate([prompt] * N_DRAWS, params, use_tqdm=False)
    sequences = torch.tensor([prompt + o.outputs[0].token_ids for o in outs])
    stats = spec_stats(llm)
    rate = stats["spec_num_accepted_tokens"] / stats["spec_num_draft_tokens"]
    assert stats["spec_num_drafts"] >= N_DRAWS and 0.2 < rate < 0.9, stats  # both accepted and rejected drafts
    p = processed_probs(target, sequences, len(prompt), params)
    q = processed_probs(draft, sequences, len(prompt), params)
    for i in range(4):
        tokens = sequences[:, len(prompt) + i]
        assert pearson_p(tokens, p[:, i]) > 1e-3, i
        if i:  # the drafted positions follow p, not q
            assert pearson_p(tokens, q[:, i]) < 1e-6, i


def test_draft_with_another_vocabulary_is_refused(tiny_models, tmp_path):
    """vLLM's shape without "method" (a "model" means draft_model); a draft's ids must mean the target's tokens."""
    build_tiny(tmp_path / "words", prefix="w")  # as many tokens, other words
    build_tiny(tmp_path / "wider", vocab=TINY_VOCAB + 1)
    for name, message in (("words", "tokenizer differs"), ("wider", f"vocabulary of {TINY_VOCAB + 1} tokens")):
        with pytest.raises(ValueError, match=message):
            make_tiny_llm(tiny_models[0], speculative_config={"model": str(tmp_path / name),
                                                              "num_speculative_tokens": 2})


def run_engine(llm: LLM, prompt: list[int], params: SamplingParams, eos: int | None = None):
    """The engine's outputs for one request, step by step: [(new token ids, finish reason)]."""
    engine = llm.engine
    engine.add_request("r", prompt, params, eos_token_id=eos)
    chunks = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.new_token_ids:
                chunks.append((list(o.new_token_ids), o.finish_reason))
    return chunks


@pytest.mark.slow
def test_stop_eos_and_max_tokens_inside_an_accepted_run(prompt_ids, plain):
    config = {"method": "ngram", "num_speculative_tokens": 4, "adaptive": False}
    chunks = run_engine(make_llm(speculative_config=config), prompt_ids[0], GREEDY)
    tokens = [t for c, _ in chunks for t in c]
    assert tokens == plain[0]
    # a run of >= 3 tokens whose second token is new to the output: end there, inside the run
    at = 0
    for c, _ in chunks:
        if len(c) >= 3 and c[1] not in tokens[:at + 1]:
            break
        at += len(c)
    else:
        pytest.fail(f"no accepted run of 3 tokens: {chunks}")
    stop = tokens[at + 1]
    want = tokens[:at + 2]
    cases = {"stop_token_ids": (SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop_token_ids=[stop],
                                               ignore_eos=True), None, "stop"),
             "eos": (SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), stop, "stop"),
             "max_tokens": (SamplingParams(temperature=0.0, max_tokens=at + 2, ignore_eos=True), None, "length")}
    for name, (params, eos, reason) in cases.items():
        llm = make_llm(speculative_config=config)
        got = run_engine(llm, prompt_ids[0], params, eos)
        assert [t for c, _ in got for t in c] == want, name
        assert got[-1][1] == reason and len(got[-1][0]) == 2, (name, got[-1])  # cut inside the verified run
        assert llm.engine.kv_cache.pool.num_free_blocks == llm.engine.kv_cache.num_blocks


@pytest.mark.slow
def test_options_without_drafts_behave_as_before(prompt_ids, plain):
    """logprobs, penalties and stop strings get no drafts (speculator.can_speculate): same output, nothing drafted."""
    llm = make_llm(speculative_config={"method": "ngram"})
    params = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=16, logprobs=1)
    outs = llm.generate(prompt_ids[:1], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == plain[0][:16] and len(outs[0].outputs[0].logprobs) == 16
    assert spec_stats(llm)["spec_num_drafts"] == 0


# ---- proposers, adaptive rule, config ----

def test_ngram_proposes_after_the_longest_latest_match():
    proposer = NgramProposer(2, 3)
    tokens = [1, 2, 3, 9, 9, 7, 2, 3, 4, 5, 6, 1, 2, 3]
    # the 3-gram (1, 2, 3) occurred at the start: what followed it there
    assert proposer.propose("a", tokens, 3) == [9, 9, 7]
    # a 2-gram only: (2, 3) last occurred before 4, 5
    assert proposer.propose("b", [2, 3, 4, 5, 8, 8, 2, 3], 2) == [4, 5]
    assert proposer.propose("c", [1, 2, 3, 4], 3) == []
    # incremental: new tokens extend the index
    tokens += [9, 9, 7, 2, 3, 4]
    assert proposer.propose("a", tokens, 2) == [5, 6]


def test_suffix_proposes_from_the_request_and_from_past_outputs():
    proposer = SuffixProposer(max_depth=8, max_cached_requests=2, max_spec_factor=2.0, min_token_prob=0.1)
    prompt = [5, 6, 7, 8]
    proposer.finish("old", prompt + [10, 11, 12, 13, 14, 15], len(prompt))
    # the context's tail (10, 11, 12) matches the past output: its continuation, at most 2 x 3 tokens
    assert proposer.propose("new", [1, 2, 10, 11, 12], 8) == [13, 14, 15]
    # the request's own text: (3, 4) occurred earlier, followed by 5 6 5 6
    assert proposer.propose("own", [3, 4, 5, 6, 5, 6, 0, 3, 4], 3) == [5, 6, 5]
    # bounded: the oldest outputs leave the global index
    proposer.finish("b", [0, 20, 21, 22, 23], 1)
    proposer.finish("c", [0, 30, 31, 32, 33], 1)
    assert proposer.propose("x", [10, 11, 12], 4) == []
    assert proposer.propose("y", [30, 31], 2) == [32, 33]


def test_suffix_prefers_the_most_frequent_continuation():
    proposer = SuffixProposer(max_depth=8, max_cached_requests=10, max_spec_factor=4.0, min_token_prob=0.3)
    for i, tail in enumerate(([7, 8], [7, 8], [7, 9])):
        proposer.finish(str(i), [0, 1, 2] + tail, 1)
    # after (1, 2): 7 always, then 8 two times out of three (path probability 2/3 >= 0.3)
    assert proposer.propose("q", [1, 2], 4) == [7, 8]


def test_adaptive_draft_length():
    assert adaptive.drafts_for_rate(0.9, 8) == 8  # 0.9^8 = 0.43
    assert adaptive.drafts_for_rate(0.5, 8) == 1
    assert adaptive.drafts_for_rate(0.2, 8) == 0
    estimate = adaptive.AcceptanceEstimate()
    for _ in range(10):
        estimate.update(4, 4)
    assert adaptive.draft_length(estimate, 6) == 6
    for _ in range(10):
        estimate.update(4, 0)
    lengths = [adaptive.draft_length(estimate, 6) for _ in range(adaptive.PROBE_INTERVAL)]
    assert lengths == [0] * (adaptive.PROBE_INTERVAL - 1) + [1]  # off, then re-measured with one draft
    for interval in (2 * adaptive.PROBE_INTERVAL, 4 * adaptive.PROBE_INTERVAL):  # each rejected probe: twice as long
        estimate.update(1, 0)
        lengths = [adaptive.draft_length(estimate, 6) for _ in range(interval)]
        assert lengths == [0] * (interval - 1) + [1]
    newcomer = estimate.for_new_request()  # a new request inherits the low rate and the interval: no first draft
    assert newcomer.rate == pytest.approx(estimate.rate) and newcomer.probe_interval == 4 * adaptive.PROBE_INTERVAL
    assert adaptive.draft_length(newcomer, 6) == 0
    estimate.update(1, 1)  # an accepted probe: probing as often as at first
    assert estimate.probe_interval == adaptive.PROBE_INTERVAL
    assert adaptive.AcceptanceEstimate().for_new_request().rate == pytest.approx(0.5)  # nothing measured yet
    assert adaptive.per_request_cap(1, 16) == 15 and adaptive.per_request_cap(8, 16) == 1
    assert adaptive.per_request_cap(16, 16) == 0


def test_config_parse():
    c = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == (3, 4, 4)
    assert SpeculativeConfig.parse({"method": "suffix"}).num_speculative_tokens == 24
    c = SpeculativeConfig.parse('{"model": "/draft", "num_speculative_tokens": 3}')  # vLLM: a model, no method
    assert (c.method, c.model, c.num_speculative_tokens) == ("draft_model", "/draft", 3)
    for bad in ('{"method": "eagle"}', '{"method": "ngram", "nope": 1}', "[1]", "{",
                '{"method": "draft_model", "model": "/draft"}', '{"method": "draft_model", "num_speculative_tokens": 2}',
                '{"method": "ngram", "model": "/draft"}'):
        with pytest.raises(ValueError):
            SpeculativeConfig.parse(bad)


# ---- the rejection sampler ----

VOCAB = 8
N = 4000


def chi_square_p(samples: torch.Tensor, probs: torch.Tensor) -> float:
    """p-value of the samples (token ids) against the distribution probs, over the tokens it can produce."""
    from scipy.stats import chisquare
    support = (probs > 0).nonzero().squeeze(1)
    counts = torch.bincount(samples, minlength=VOCAB).double()
    assert counts[probs == 0].sum() == 0, "a token outside the target's support was emitted"
    expected = probs[support].double() / probs[support].double().sum() * len(samples)
    return float(chisquare(counts[support].numpy(), expected.numpy()).pvalue)


def target(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    sampler = Sampler(VOCAB, torch.device("cpu"))
    r = Request("t", [0], params, None, 4)
    probs = sampler.target_probs(logits[None], [r], [False])[0]
    return probs / probs.sum()


SAMPLING = {"temperature": SamplingParams(temperature=0.7), "top_k": SamplingParams(temperature=1.0, top_k=3),
            "top_p": SamplingParams(temperature=1.0, top_p=0.7)}


@pytest.mark.parametrize("name", SAMPLING)
def test_verify_with_one_hot_drafts_is_distributed_as_target(name):
    """N requests, each with drafts [x0, x1] (x0: a likely token, not the likeliest), verified in one call:
    the first emitted token is distributed as p_0, and the second, among runs that accepted x0, as p_1."""
    torch.manual_seed(0)
    params = SAMPLING[name]
    logits = torch.randn(3, VOCAB) * 1.5
    p0, p1 = target(logits[0], params), target(logits[1], params)
    x0, x1 = int(p0.argsort(descending=True)[1]), int(p1.argmax())
    requests = []
    for i in range(N):
        r = Request(str(i), [0], params, None, 8)
        r.spec_token_ids = [x0, x1]
        requests.append(r)
    sampler = Sampler(VOCAB, torch.device("cpu"), seed=1)
    emitted = verify(sampler, logits.repeat(N, 1), requests)
    first = torch.tensor([e[0] for e in emitted])
    assert chi_square_p(first, p0) > 1e-3
    second = torch.tensor([e[1] for e in emitted if e[0] == x0])
    assert len(second) > N * p0[x0] * 0.8
    assert chi_square_p(second, p1) > 1e-3
    # acceptance really happened, at the rate p0(x0)
    assert abs((first == x0).double().mean() - p0[x0]) < 0.05


@pytest.mark.parametrize("name", SAMPLING)
def test_general_rejection_sampling_is_distributed_as_target(name):
    """A draft distribution q unlike the target p (a draft model's): drafts drawn from q, then verified."""
    torch.manual_seed(1)
    params = SAMPLING[name]
    logits = torch.randn(3, VOCAB) * 1.5
    p = torch.stack([target(row, params) for row in logits])
    q = torch.softmax(torch.randn(2, VOCAB), dim=-1)  # full support, so it proposes tokens p excludes
    generator = torch.Generator().manual_seed(2)
    firsts, seconds = [], []
    for _ in range(N):
        drafts = [int(torch.multinomial(q[j], 1, generator=generator)) for j in range(2)]
        out = general_rejection_sample(p, q, drafts, torch.rand(3, dtype=torch.float64, generator=generator))
        firsts.append(out[0])
        if len(out) > 1:
            seconds.append(out[1])
    assert chi_square_p(torch.tensor(firsts), p[0]) > 1e-3
    assert chi_square_p(torch.tensor(seconds), p[1]) > 1e-3


def test_batched_uniforms_equal_single_draws():
    """The seeded-request rewind relies on it: one draw of n uniforms equals n draws of one."""
    a = torch.Generator().manual_seed(5)
    b = torch.Generator().manual_seed(5)
    many = torch.rand(7, dtype=torch.float64, generator=a)
    ones = torch.cat([torch.rand(1, dtype=torch.float64, generator=b) for _ in range(7)])
    assert torch.equal(many, ones)
