"""Scheduler policy: FCFS and priority order, preemption victims, max_model_len checks, aborts, chunked prefill."""
from __future__ import annotations

import pytest

from tokenmill.engine.kv_cache import KVCacheManager
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.sampling_params import ParamError, SamplingParams

BS = 4


def make_request(rid: str, n_prompt: int, priority: int = 0, arrival: float | None = None,
                 first_token: int = 0) -> Request:
    tokens = [(first_token + i) % 97 for i in range(n_prompt)]
    return Request(rid, tokens, SamplingParams(temperature=0.0), None, 16, priority, (), arrival)


def make_scheduler(num_blocks=64, max_num_seqs=8, budget=64, max_model_len=256, policy="fcfs",
                   prefix_caching=True) -> Scheduler:
    return Scheduler(KVCacheManager(num_blocks, BS, prefix_caching), max_num_seqs, budget, max_model_len, policy)


def complete(out) -> None:
    """What the engine does after the forward pass: advance progress, append a token where a row was sampled."""
    for r in out.requests:
        r.num_computed_tokens += out.num_scheduled_tokens[r.request_id]
        if r.num_computed_tokens == r.num_tokens:
            r.append_output_token(1)


def ids(requests) -> list[str]:
    return [r.request_id for r in requests]


# ---------------------------------------------------------------- order

def test_fcfs_admits_in_arrival_order():
    s = make_scheduler(max_num_seqs=2)
    reqs = {rid: make_request(rid, 5, first_token=i * 10) for i, rid in enumerate("abcd")}
    for r in reqs.values():
        s.add_request(r)
    out = s.schedule()
    assert ids(out.requests) == ["a", "b"] and ids(s.running) == ["a", "b"]
    complete(out)
    s.finish(reqs["a"], RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    # running requests go first in the batch, then the next in line; d waits behind c
    assert ids(out.requests) == ["b", "c"]
    assert out.num_scheduled_tokens == {"b": 1, "c": 5}
    assert s.waiting.peek() is reqs["d"]


def test_fcfs_waiting_head_blocks_later_requests():
    # The head does not fit in the pool now: later (smaller) requests do not jump ahead of it.
    s = make_scheduler(num_blocks=4, prefix_caching=False)
    s.add_request(make_request("a", 8))
    out = s.schedule()
    assert ids(out.requests) == ["a"]
    complete(out)
    s.add_request(make_request("big", 12, first_token=50))
    s.add_request(make_request("small", 2, first_token=70))
    out = s.schedule()
    assert "big" not in out.num_scheduled_tokens and "small" not in out.num_scheduled_tokens
    assert s.waiting.peek().request_id == "big"


def test_priority_policy_admits_lowest_value_first_then_earliest():
    s = make_scheduler(max_num_seqs=1, policy="priority")
    order = [("p2", 2), ("p0-late", 0), ("p1", 1), ("p0-later", 0)]
    reqs = {}
    for t, (rid, prio) in enumerate(order):
        reqs[rid] = make_request(rid, 3, prio, arrival=float(t), first_token=t * 10)
        s.add_request(reqs[rid])
    admitted = []
    while s.has_unfinished():
        out = s.schedule()
        new = [r for r in out.requests if r.request_id not in admitted]
        admitted += ids(new)
        complete(out)
        for r in out.requests:
            s.finish(r, RequestStatus.FINISHED_LENGTH)
    assert admitted == ["p0-late", "p0-later", "p1", "p2"]


def _four_running(policy: str, priorities: list[int]) -> tuple[Scheduler, dict[str, Request]]:
    """Four running requests of one full block each in a pool of four blocks: the next decode must preempt."""
    s = make_scheduler(num_blocks=4, policy=policy, prefix_caching=False)
    reqs = {}
    for t, (rid, prio) in enumerate(zip("abcd", priorities)):
        reqs[rid] = make_request(rid, BS, prio, arrival=float(t), first_token=t * 10)
        s.add_request(reqs[rid])
    out = s.schedule()
    admitted = ["a", "b", "c", "d"] if policy == "fcfs" else sorted("abcd", key=lambda r: reqs[r].sort_key())
    assert ids(out.requests) == admitted and s.kv_cache.pool.num_free_blocks == 0
    complete(out)
    return s, reqs


def test_priority_preemption_victim_is_lowest_priority_then_newest():
    s, reqs = _four_running("priority", [0, 2, 2, 1])
    assert ids(s.running) == ["a", "d", "b", "c"]  # admitted by priority
    out = s.schedule()
    # a needs a second block: c (priority 2, newer than b) goes first, then b for d's block
    assert out.preempted == ["c", "b"]
    assert out.num_scheduled_tokens == {"a": 1, "d": 1}
    assert reqs["c"].status == RequestStatus.PREEMPTED and reqs["c"].num_computed_tokens == 0
    assert reqs["c"].num_preemptions == 1 and "c" not in s.kv_cache.block_tables
    assert s.num_preemptions == len(out.preempted)
    assert not set(out.preempted) & set(out.num_scheduled_tokens)


def test_fcfs_preemption_victim_is_newest_and_goes_back_to_the_front():
    s, reqs = _four_running("fcfs", [0, 0, 0, 0])
    late = make_request("late", 2, first_token=90)
    s.add_request(late)
    out = s.schedule()
    assert out.preempted[0] == "d"
    assert out.num_scheduled_tokens.get("a") == 1
    # a preempting step admits no one, and the preempted request is next in line, ahead of `late`
    assert "late" not in out.num_scheduled_tokens
    assert s.waiting.peek().request_id == out.preempted[-1]
    assert [r.request_id for r in s.waiting._fifo][-1] == "late"
    # preempted in newest-first order, they are back in arrival order at the front
    fifo = [r.request_id for r in s.waiting._fifo]
    assert fifo == sorted(out.preempted) + ["late"]


def test_preempted_request_recomputes_prompt_and_outputs():
    s, reqs = _four_running("fcfs", [0, 0, 0, 0])
    d = reqs["d"]
    s.schedule()
    assert d.status == RequestStatus.PREEMPTED and d.num_tokens == BS + 1
    for rid in "abc":
        if reqs[rid].status == RequestStatus.RUNNING:
            s.finish(reqs[rid], RequestStatus.FINISHED_STOPPED)
    out = s.schedule()
    # d comes back with its prompt and its sampled token as one prompt
    assert out.num_scheduled_tokens["d"] == BS + 1 and d.status == RequestStatus.RUNNING
    assert d.num_cached_tokens == 0  # set at first scheduling only


# ---------------------------------------------------------------- aborts

def test_abort_running_frees_blocks_at_once():
    s2 = make_scheduler(num_blocks=5, prefix_caching=False)
    a = make_request("a", 16)
    s2.add_request(a)
    complete(s2.schedule())
    b = make_request("b", 4, first_token=40)
    s2.add_request(b)
    out = s2.schedule()
    assert ids(out.requests) == ["a"]  # the fifth block went to a's decode, b waits
    complete(out)
    assert s2.abort("a") is a
    assert a.status == RequestStatus.FINISHED_ABORTED and a.finish_reason == "abort"
    assert "a" not in s2.kv_cache.block_tables and "a" not in s2.requests and a not in s2.running
    assert s2.kv_cache.pool.num_free_blocks == 5
    assert all(blk.ref_cnt == 0 for blk in s2.kv_cache.pool.blocks)
    assert ids(s2.schedule().requests) == ["b"]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_abort_waiting_and_preempted(policy):
    s = make_scheduler(num_blocks=4, max_num_seqs=1, policy=policy, prefix_caching=False)
    a, b = make_request("a", 3, arrival=0.0), make_request("b", 3, arrival=1.0, first_token=30)
    s.add_request(a)
    s.add_request(b)
    complete(s.schedule())
    assert s.abort("b") is b and b.status == RequestStatus.FINISHED_ABORTED
    assert len(s.waiting) == 0 and "b" not in s.requests
    assert s.abort("b") is None and s.abort("nope") is None
    # a preempted request sits in the waiting queue; aborting it removes it there
    s._preempt(a)
    assert a.status == RequestStatus.PREEMPTED and len(s.waiting) == 1
    s.abort("a")
    assert len(s.waiting) == 0 and not s.has_unfinished()
    assert s.kv_cache.pool.num_free_blocks == 4 and not s.kv_cache.block_tables
    assert s.schedule().requests == []


def test_finish_is_idempotent():
    s = make_scheduler()
    a = make_request("a", 3)
    s.add_request(a)
    complete(s.schedule())
    s.finish(a, RequestStatus.FINISHED_STOPPED)
    s.finish(a, RequestStatus.FINISHED_ABORTED)  # a late abort of a finished request changes nothing
    assert a.status == RequestStatus.FINISHED_STOPPED
    assert s.kv_cache.pool.num_free_blocks == 64


# ---------------------------------------------------------------- chunked prefill

def test_chunked_prefill_never_stalls_decodes():
    budget = 8
    s = make_scheduler(budget=budget)
    d1, d2 = make_request("d1", 3), make_request("d2", 2, first_token=20)
    s.add_request(d1)
    s.add_request(d2)
    complete(s.schedule())
    long = make_request("long", 45, first_token=40)
    s.add_request(long)
    chunks = []
    while long.num_output_tokens == 0:
        out = s.schedule()
        assert out.num_scheduled_tokens["d1"] == 1 and out.num_scheduled_tokens["d2"] == 1
        assert out.total_tokens <= budget
        chunks.append(out.num_scheduled_tokens["long"])
        complete(out)
    assert chunks == [6] * 7 + [3]
    assert long.num_output_tokens == 1 and d1.num_output_tokens == 1 + len(chunks)
    # once its prompt is in, the long request decodes alongside the others
    out = s.schedule()
    assert out.num_scheduled_tokens == {"d1": 1, "d2": 1, "long": 1}


def test_budget_splits_among_new_prompts():
    s = make_scheduler(budget=10)
    for i, n in enumerate([7, 7, 7]):
        s.add_request(make_request(f"r{i}", n, first_token=i * 20))
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r0": 7, "r1": 3}
    complete(out)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"r0": 1, "r1": 4, "r2": 5}


def test_prefix_hit_skips_cached_tokens():
    s = make_scheduler()
    a = make_request("a", 10)
    s.add_request(a)
    complete(s.schedule())
    b = make_request("b", 11)  # same first 10 tokens
    s.add_request(b)
    out = s.schedule()
    assert out.num_scheduled_tokens["b"] == 11 - 8 and b.num_computed_tokens == 8 and b.num_cached_tokens == 8
    assert s.kv_cache.block_tables["b"][:2] == s.kv_cache.block_tables["a"][:2]
    # prompt logprobs need every position's logits: no prefix hit
    c = Request("c", list(range(11)), SamplingParams(temperature=0.0, prompt_logprobs=0), None, 4)
    s.add_request(c)
    out = s.schedule()
    assert out.num_scheduled_tokens["c"] == 11 and c.num_cached_tokens == 0


# ---------------------------------------------------------------- EngineCore: max_model_len and a real model

@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    from helpers import save_tiny_llama
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_llama(path, vocab_size=128, max_position_embeddings=64)
    return str(path)


def make_engine(model_dir: str, **kw):
    from helpers import engine_on
    return engine_on(model_dir, **kw)


def test_add_request_rejects_over_max_model_len(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_model_len=48)
    greedy = SamplingParams(temperature=0.0, max_tokens=20)
    with pytest.raises(ParamError) as e:
        engine.add_request("r", list(range(30)), greedy)
    assert "48" in str(e.value) and "50" in str(e.value)
    assert e.value.param == "max_tokens"
    with pytest.raises(ParamError) as e:
        engine.add_request("r", list(range(60)), SamplingParams(max_tokens=None))
    assert "48" in str(e.value) and "60" in str(e.value)
    with pytest.raises(ParamError) as e:
        engine.add_request("r", list(range(48)), SamplingParams(max_tokens=None))
    assert "48" in str(e.value)
    assert not engine.has_unfinished_requests()
    engine.add_request("ok", list(range(28)), greedy)  # exactly 48 tokens in all
    # max_tokens=None: generate up to max_model_len
    r = engine.add_request("rest", list(range(44)), SamplingParams(temperature=0.0, max_tokens=None))
    assert r.max_tokens == 4
    while engine.has_unfinished_requests():
        engine.step()
    assert r.num_output_tokens == 4 and r.status == RequestStatus.FINISHED_LENGTH
    with pytest.raises(ParamError):
        engine.add_request("p", [1, 2], greedy, priority=1)  # priority needs the priority policy
    with pytest.raises(ParamError):
        engine.add_request("v", [1, 128], greedy)  # out of vocabulary


def test_engine_decodes_every_step_while_a_long_prompt_is_chunked(tiny_model_dir):
    engine = make_engine(tiny_model_dir, max_num_batched_tokens=8)
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    short = engine.add_request("short", [5, 6, 7], params)
    engine.step()
    assert short.num_output_tokens == 1
    long = engine.add_request("long", list(range(40)), params)
    steps = 0
    while long.num_output_tokens == 0:
        outs = {o.request_id: o for o in engine.step()}
        steps += 1
        assert len(outs["short"].new_token_ids) == 1  # a token for the decode in every step
    assert steps == 6  # 40 prompt tokens at 7 per step
    assert short.num_output_tokens == 1 + steps


def test_engine_abort_frees_blocks(tiny_model_dir):
    engine = make_engine(tiny_model_dir)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    engine.add_request("a", list(range(20)), params)
    engine.add_request("b", list(range(30)), params)
    engine.step()
    free_before = engine.kv_cache.pool.num_free_blocks
    assert free_before < engine.kv_cache.num_blocks
    engine.add_request("c", list(range(3)), params)  # waiting
    engine.abort_request("a")
    engine.abort_request("c")
    assert "a" not in engine.kv_cache.block_tables and engine.stats()["num_waiting"] == 0
    engine.abort_request("b")
    assert engine.kv_cache.pool.num_free_blocks == engine.kv_cache.num_blocks
    assert not engine.has_unfinished_requests() and engine.step() == []
