"""Stall-free steps (--max-step-latency-ms): the step-cost model's fit and bound, and the scheduler's use of it."""
from __future__ import annotations

import numpy as np
import pytest

from tokenmill.config import EngineConfig
from tokenmill.engine.engine import step_cost_model
from tokenmill.engine.request import RequestStatus
from tokenmill.engine.step_cost import FIRST_FIT, MIN_CHUNK, UNFITTED_CHUNK, StepCostModel
from test_scheduler import complete, make_request, make_scheduler

# seconds = a + b * prefill tokens + c * decode rows + d * pairs/1024 + e * decode context/1024
TRUE = np.array([0.004, 0.0003, 0.0008, 0.0002, 0.0001])


def fitted(target_s=None, noise=0.0, seed=0) -> StepCostModel:
    model, rng = StepCostModel(target_s), np.random.default_rng(seed)
    for _ in range(FIRST_FIT * 2):
        tokens = int(rng.integers(0, 512)) if rng.random() < 0.6 else 0
        ctx = int(rng.integers(0, 2048))
        rows, dctx = int(rng.integers(0, 16)), int(rng.integers(0, 16 * 1024))
        pairs = tokens * ctx + tokens * (tokens + 1) // 2
        seconds = StepCostModel.features(tokens, pairs, rows, dctx) @ TRUE
        model.record(tokens, pairs, rows, dctx, seconds * (1 + noise * rng.standard_normal()))
    return model


def test_the_fit_recovers_a_linear_step_cost():
    model = fitted()
    np.testing.assert_allclose(model.coef, TRUE, rtol=1e-6, atol=1e-9)
    noisy = fitted(noise=0.05)
    assert noisy.coef is not None
    assert noisy.predict(256, 256 * 1000, 8, 8000) == pytest.approx(
        StepCostModel.features(256, 256 * 1000, 8, 8000) @ TRUE, rel=0.1)


def test_the_bound_is_the_largest_chunk_within_the_target():
    model = fitted(target_s=0.050)
    budget = model.prefill_budget(decode_rows=8, decode_context=8000, context=300, budget=512)
    cost = lambda n: model.predict(n, n * 300 + n * (n + 1) // 2, 8, 8000)  # noqa: E731
    assert budget % MIN_CHUNK == 0 and MIN_CHUNK <= budget < 512
    assert cost(budget) <= 0.050 < cost(budget + MIN_CHUNK)
    # a longer context makes each token dearer: a smaller chunk
    assert model.prefill_budget(8, 8000, 1800, 512) < budget
    # no decode to protect: the token budget; decodes but no fit yet: a small chunk, whatever the target
    assert model.prefill_budget(0, 0, 300, 512) == 512
    for unfitted in (StepCostModel(0.050), StepCostModel(None)):
        assert unfitted.prefill_budget(8, 8000, 300, 512) == UNFITTED_CHUNK
        assert unfitted.prefill_budget(8, 8000, 300, 32) == 32
        assert unfitted.prefill_budget(0, 0, 300, 512) == 512
    # a target no chunk meets still moves the prompt, one MIN_CHUNK a step
    assert fitted(target_s=0.001).prefill_budget(8, 8000, 300, 512) == MIN_CHUNK


def test_before_the_fit_the_steps_seen_so_far_shrink_the_chunk():
    """Before the fit, the chunk beside decodes is UNFITTED_CHUNK at most, and what the latest prefill-only step's
    cost per token says fits in the target beside the decodes' latest cost (a decode-only step's, or a mixed
    step's less its prefill): on a slow CPU, less."""
    for target_s in (None, 0.080):
        model = StepCostModel(target_s)
        model.record(128, 128 * 129 // 2, 0, 0, 0.256)  # a prefill alone: 2 ms a token
        assert model.prefill_budget(8, 8000, 300, 512) == UNFITTED_CHUNK  # no decode step seen yet
        model.record(0, 0, 8, 8000, 0.040)  # decodes alone: 40 ms
        assert model.coef is None
        # the derived target is twice the decode step: 40 ms left, 20 tokens, MIN_CHUNK; the set one leaves 40 too
        assert model.prefill_budget(8, 8000, 300, 512) == MIN_CHUNK
        # a fast machine's steps (0.1 ms a token, 4 ms decodes): the cap, not the estimate
        model.record(128, 128 * 129 // 2, 0, 0, 0.0128)
        model.record(0, 0, 8, 8000, 0.004)
        assert model.prefill_budget(8, 8000, 300, 512) == UNFITTED_CHUNK
        assert model.prefill_budget(8, 8000, 300, 32) == 32
        assert model.prefill_budget(0, 0, 300, 512) == 512
    # a closed loop: no decode-only step before the fit, the decodes' cost read off a mixed step (64 tokens at
    # 2 ms and 40 ms of decodes): 20 tokens fit beside them, MIN_CHUNK
    model = StepCostModel(None)
    model.record(128, 128 * 129 // 2, 0, 0, 0.256)
    assert model.prefill_budget(8, 8000, 300, 512) == UNFITTED_CHUNK
    model.record(64, 64 * 364, 8, 8000, 0.168)
    assert model.prefill_budget(8, 8000, 300, 512) == MIN_CHUNK


def test_the_derived_target_is_twice_the_decodes_alone():
    model = fitted(target_s=None)
    rows, dctx = 15, 15 * 1024
    decode_only = model.predict(0, 0, rows, dctx)
    target = max(StepCostModel.DECODE_FACTOR * decode_only, StepCostModel.MIN_TARGET_S)
    n = model.prefill_budget(rows, dctx, 0, 4096)
    assert model.predict(n, n * (n + 1) // 2, rows, dctx) <= target
    assert model.predict(n + MIN_CHUNK, (n + MIN_CHUNK) * (n + MIN_CHUNK + 1) // 2, rows, dctx) > target


def test_prompts_that_outnumber_the_streams_loosen_the_derived_target():
    """The derived target weighs the prompts still to compute against the streams it protects: unchanged while
    streams outnumber them, proportional past that; a target the user set is kept whatever waits."""
    model = fitted(target_s=None)
    rows, dctx = 2, 2 * 1024
    decode_only = model.predict(0, 0, rows, dctx)
    base = StepCostModel.DECODE_FACTOR * decode_only
    assert model.derived_target(decode_only, rows, 1) == pytest.approx(max(base, StepCostModel.MIN_TARGET_S))
    assert model.derived_target(decode_only, rows, 2) == model.derived_target(decode_only, rows, 1)
    assert model.derived_target(decode_only, rows, 6) == pytest.approx(max(3 * base, StepCostModel.MIN_TARGET_S))
    alone, queued = model.prefill_budget(rows, dctx, 500, 4096), model.prefill_budget(rows, dctx, 500, 4096, 6)
    assert queued > alone
    fixed = fitted(target_s=0.040)
    assert fixed.prefill_budget(rows, dctx, 500, 4096, 6) == fixed.prefill_budget(rows, dctx, 500, 4096, 1)


def test_the_scheduler_counts_waiting_and_part_computed_prompts():
    s = make_scheduler(num_blocks=256, budget=64, max_model_len=512)
    s.step_cost = bound = FixedBound(8)
    s.add_request(make_request("a", 4))
    complete(s.schedule())
    for name in "bcd":
        s.add_request(make_request(name, 100))
    complete(s.schedule())  # a decodes; b starts its prompt, c and d wait
    assert bound.calls[-1][-1] == 3
    complete(s.schedule())
    assert bound.calls[-1][-1] == 3  # b part-way, c and d waiting


class FixedBound:
    """A step-cost model whose bound is a constant: the scheduler's side alone."""
    def __init__(self, tokens: int):
        self.tokens, self.calls = tokens, []

    def prefill_budget(self, decode_rows, decode_context, context, budget, pending=1):
        self.calls.append((decode_rows, decode_context, context, budget, pending))
        return min(self.tokens, budget)


def test_prefill_chunks_are_bounded_only_while_decodes_run():
    s = make_scheduler(num_blocks=256, budget=64, max_model_len=512)
    s.step_cost = bound = FixedBound(8)
    s.add_request(make_request("a", 40))
    out = s.schedule()  # nothing decodes yet: the whole budget
    assert out.num_scheduled_tokens == {"a": 40} and bound.calls == []
    complete(out)
    s.add_request(make_request("b", 100, first_token=50))
    for step in range(3):  # a decodes; b's prompt moves 8 tokens a step beside it
        out = s.schedule()
        assert out.num_scheduled_tokens == {"a": 1, "b": 8}
        complete(out)
    assert bound.calls[0] == (1, 40, 0, 64, 1)
    assert bound.calls[1] == (1, 41, 8, 64, 1)  # b's chunk starts past what it computed
    s.finish(s.requests["a"], RequestStatus.FINISHED_STOPPED)
    out = s.schedule()  # a finished: b alone takes the whole budget again
    assert out.num_scheduled_tokens == {"b": 64}


def test_two_prompts_share_the_bound():
    s = make_scheduler(num_blocks=256, budget=64, max_model_len=512)
    s.step_cost = FixedBound(12)
    s.add_request(make_request("a", 4))
    complete(s.schedule())
    s.add_request(make_request("b", 30, first_token=20))
    s.add_request(make_request("c", 30, first_token=60))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 12}  # c waits: the bound is spent
    complete(out)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 12}
    complete(out)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 1, "b": 6, "c": 6}


@pytest.mark.parametrize("flags, expected", [
    ({}, "derived"), ({"max_step_latency_ms": 40}, 0.040), ({"max_step_latency_ms": 0}, None),
    ({"max_num_batched_tokens": 256}, None), ({"max_num_batched_tokens": 256, "max_step_latency_ms": 25}, 0.025)])
def test_the_flags_choose_the_bound(flags, expected):
    model = step_cost_model(EngineConfig(**flags), "generate")
    if expected is None:
        assert model is None
    else:
        assert model.target_s == (None if expected == "derived" else pytest.approx(expected))
    assert step_cost_model(EngineConfig(**flags), "pooling") is None


def test_a_negative_target_is_refused():
    with pytest.raises(ValueError, match="--max-step-latency-ms"):
        EngineConfig(max_step_latency_ms=-1)
