"""Reasoning: splitting `<think>` text into reasoning and content (scripted streams, every split point), the
engine's thinking tracker and budget forcing (scripted token ids), and the same on real generations of the default
model: the budget forces `</think>`, and a grammar applies only after thinking."""
from __future__ import annotations

import pytest

from tokenmill import SamplingParams, StructuredOutputsParams
from tokenmill.reasoning import REASONING_PARSERS, ReasoningSpec, ReasoningSplitter, ThinkingTracker, reasoning_spec
from tokenmill.sampling_params import ParamError

QWEN3, R1 = REASONING_PARSERS["qwen3"], REASONING_PARSERS["deepseek_r1"]


def split(spec: ReasoningSpec, prompt: str, pieces: list[str]) -> tuple[str, str]:
    splitter = ReasoningSplitter(spec, prompt)
    reasoning = content = ""
    for piece in pieces:
        r, c = splitter.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = splitter.finish()
    return reasoning + r, content + c


def every_chunking(text: str):
    """Whole, character by character, and every two-piece split: held-back markup must not depend on chunking."""
    yield [text]
    yield list(text)
    for i in range(1, len(text)):
        yield [text[:i], text[i:]]


@pytest.mark.parametrize("spec, prompt, text, expected", [
    # qwen3: the model opens the block itself
    (QWEN3, "<|im_start|>assistant\n", "<think>\nA plan.\n</think>\n\nThe answer.", ("\nA plan.\n", "\n\nThe answer.")),
    # no block at all: everything is content, including a '<' that only looked like the start string
    (QWEN3, "<|im_start|>assistant\n", "<this> is 1 < 2", ("", "<this> is 1 < 2")),
    # the template prefilled <think>: reasoning from the first token
    (QWEN3, "<|im_start|>assistant\n<think>\n", "plan</think>answer", ("plan", "answer")),
    # an earlier turn's closed block in the prompt does not open this one
    (QWEN3, "<think>old</think>x<|im_start|>assistant\n", "answer", ("", "answer")),
    # DeepSeek-R1: text before </think> is reasoning even without <think>; a redundant <think> is markup
    (R1, "<｜Assistant｜>", "plan</think>answer", ("plan", "answer")),
    (R1, "<｜Assistant｜>", "<think>plan</think>answer", ("plan", "answer")),
    # cut off while thinking (max_tokens): it all stays reasoning, and nothing leaks into content
    (QWEN3, "assistant\n<think>\n", "still thinking </thi", ("still thinking </thi", "")),
    # custom strings
    (reasoning_spec(None, "[[", "]]"), "", "[[a]b]]c", ("a]b", "c")),
])
def test_splitter_on_every_chunking(spec, prompt, text, expected):
    for pieces in every_chunking(text):
        assert split(spec, prompt, pieces) == expected, pieces


def test_reasoning_spec_from_flags():
    assert reasoning_spec(None) is None
    assert reasoning_spec("qwen3") == QWEN3
    assert reasoning_spec("deepseek_r1", end="<|end_think|>") == ReasoningSpec("<think>", "<|end_think|>", True)
    with pytest.raises(ValueError):
        reasoning_spec("nope")


START, END = [1, 2], [3, 4, 5]


def run_tracker(tracker: ThinkingTracker, model_tokens: list[int]) -> tuple[list[int], list[bool]]:
    """Generates with a scripted 'model': the forced token when there is one, else the next scripted token."""
    out, thought = [], []
    scripted = iter(model_tokens)
    while True:
        forced = tracker.forced_token(out)
        token = forced if forced is not None else next(scripted, None)
        if token is None:
            return out, thought
        out.append(token)
        thought.append(tracker.observe(out))


def test_tracker_forces_the_end_string_when_the_budget_is_spent():
    tracker = ThinkingTracker(QWEN3, START, END, prompt_ids=[9, 1, 2], budget=3)
    out, thought = run_tracker(tracker, [7, 7, 7, 7, 8, 8])
    assert out == [7, 7, 7, 3, 4, 5, 7, 8, 8]  # three thinking tokens, then </think> forced, then the answer
    assert thought == [True] * 6 + [False] * 3
    assert tracker.num_thinking_tokens == 3 and not tracker.thinking


def test_tracker_continues_a_partial_end_string():
    tracker = ThinkingTracker(QWEN3, START, END, prompt_ids=[1, 2], budget=2)
    out, _ = run_tracker(tracker, [7, 3, 8])
    assert out == [7, 3, 4, 5, 8]  # the model wrote the first end token itself: only the rest is forced


def test_tracker_follows_natural_ends_and_opens():
    tracker = ThinkingTracker(QWEN3, START, END, prompt_ids=[9], budget=None)
    assert not tracker.thinking
    out, thought = run_tracker(tracker, [6, 1, 2, 7, 7, 3, 4, 5, 8])
    assert thought == [False, False, True, True, True, True, True, True, False]
    assert tracker.num_thinking_tokens == 4  # 7, 7 and the first two end tokens before the end was complete
    budget_zero = ThinkingTracker(R1, START, END, prompt_ids=[9], budget=0)  # R1: open without a start string
    assert run_tracker(budget_zero, [8])[0] == [3, 4, 5, 8]


# ---- real generations of the default model ----

@pytest.fixture(scope="module")
def llm():
    from tokenmill import LLM
    return LLM(dtype="float32", kv_cache_memory="256MiB", max_model_len=1024, reasoning_parser="qwen3")


def thinking_prompt(llm, question: str) -> str:
    """Opens the block after the generation prompt, as Qwen3 or DeepSeek-R1 templates do."""
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                             add_generation_prompt=True) + "<think>\n"


@pytest.mark.slow  # with the model load it needs, ~10 s on 2 cores
def test_budget_forces_end_of_thinking_on_a_real_generation(llm):
    end_ids = llm.tokenizer.encode("</think>", add_special_tokens=False)
    prompt = thinking_prompt(llm, "What is 17 times 23? Think step by step.")
    free = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40), use_tqdm=False)[0].outputs[0]
    assert "</think>" not in free.text  # left alone, this model does not close the block within 40 tokens
    for budget in (0, 5, 12):
        out = llm.generate(prompt, SamplingParams(temperature=0, max_tokens=40, thinking_token_budget=budget),
                           use_tqdm=False)[0].outputs[0]
        assert out.token_ids[:budget] == free.token_ids[:budget]  # thinking as it would have, up to the budget
        assert out.token_ids[budget:budget + len(end_ids)] == end_ids
        assert len(out.token_ids) > budget + len(end_ids)  # and it goes on to answer
    sampled = llm.generate([prompt] * 4, SamplingParams(temperature=1.0, seed=5, max_tokens=30,
                                                         thinking_token_budget=8), use_tqdm=False)
    for r in sampled:
        assert r.outputs[0].token_ids[8:8 + len(end_ids)] == end_ids


@pytest.mark.slow  # loads the real model too
def test_grammar_applies_only_after_thinking(llm):
    prompt = thinking_prompt(llm, "Is the sky green? Answer yes or no.")
    choice = StructuredOutputsParams(choice=["yes", "no"])
    outs = llm.generate([prompt] * 3, SamplingParams(temperature=0.8, seed=11, max_tokens=40,
                                                      thinking_token_budget=6, structured_outputs=choice),
                        use_tqdm=False)
    for r in outs:
        o = r.outputs[0]
        thinking, sep, answer = o.text.partition("</think>")
        assert sep and len(llm.tokenizer.encode(thinking, add_special_tokens=False)) >= 4
        assert answer in ("yes", "no") and o.finish_reason == "stop"
    # without a reasoning block in the prompt, the grammar holds from the first token
    plain = llm.tokenizer.apply_chat_template([{"role": "user", "content": "Is the sky green?"}], tokenize=False,
                                              add_generation_prompt=True)
    out = llm.generate(plain, SamplingParams(temperature=0.8, seed=3, max_tokens=10, structured_outputs=choice),
                       use_tqdm=False)[0].outputs[0]
    assert out.text in ("yes", "no")


def test_negative_budget_is_refused():
    with pytest.raises(ParamError, match="thinking_token_budget"):
        SamplingParams(thinking_token_budget=-1)
