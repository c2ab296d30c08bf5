"""KV cache bookkeeping: block hashes, the block pool (LRU, ref counts), the manager, and a property-based
test that drives the real Scheduler + KVCacheManager through random workloads without a model."""
from __future__ import annotations

import os
import random
import subprocess
import sys
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenmill.engine.kv_cache import BlockPool, KVCacheManager, hash_block_tokens, hash_request_blocks
from tokenmill.engine.request import Request, RequestStatus
from tokenmill.engine.scheduler import Scheduler
from tokenmill.sampling_params import SamplingParams

BS = 4


def make_request(rid: str, tokens: list[int], max_tokens: int = 8, priority: int = 0, extra_keys: tuple = (),
                 arrival: float | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(temperature=0.0, max_tokens=max_tokens), None, max_tokens,
                   priority, extra_keys, arrival)


# ---------------------------------------------------------------- hashes

_HASH_SCRIPT = """
from tokenmill.engine.kv_cache import hash_block_tokens, hash_request_blocks
print(hash_block_tokens(None, [1, 2, 3, 4], ("lora", 7)).hex())
print(",".join(h.hex() for h in hash_request_blocks(list(range(100, 113)), 4, ("salt",))))
"""


def test_hash_is_deterministic_across_processes_and_hash_seeds():
    here = [hash_block_tokens(None, [1, 2, 3, 4], ("lora", 7)).hex(),
            ",".join(h.hex() for h in hash_request_blocks(list(range(100, 113)), 4, ("salt",)))]
    for seed in ("1", "12345"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", _HASH_SCRIPT], env=env, capture_output=True, text=True,
                             check=True, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert out.stdout.split() == here


def test_hash_chain_depends_on_parent_tokens_and_extra_keys():
    toks = [5, 6, 7, 8]
    root = hash_block_tokens(None, toks)
    assert root == hash_block_tokens(None, toks)
    assert len(root) == 32
    p1, p2 = hash_block_tokens(None, [1, 1, 1, 1]), hash_block_tokens(None, [2, 2, 2, 2])
    assert hash_block_tokens(p1, toks) != hash_block_tokens(p2, toks)
    assert hash_block_tokens(p1, toks) != root
    assert hash_block_tokens(None, toks, ("a",)) != root
    assert hash_block_tokens(None, toks, ("a",)) != hash_block_tokens(None, toks, ("b",))
    assert hash_block_tokens(None, [5, 6, 7, 9]) != root
    assert hash_block_tokens(None, [8, 7, 6, 5]) != root


def test_hash_request_blocks_chains_full_blocks_only_and_extends_known():
    tokens = list(range(10))
    hashes = hash_request_blocks(tokens, 4)
    assert len(hashes) == 2  # the partial third block has no hash
    assert hashes[0] == hash_block_tokens(None, tokens[0:4])
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[4:8])
    # the same second block after a different first block gets a different key
    other = hash_request_blocks([9, 9, 9, 9] + tokens[4:8], 4)
    assert other[1] != hashes[1]
    known = hashes[:1]
    same = hash_request_blocks(tokens + [10, 11], 4, known=known)
    assert same is known and len(known) == 3 and known[:2] == hashes
    assert hash_request_blocks(tokens, 4, ("k",))[0] != hashes[0]


# ---------------------------------------------------------------- block pool

def test_pool_lru_eviction_order():
    pool = BlockPool(6)
    a, b, c = pool.take_fresh(1), pool.take_fresh(1), pool.take_fresh(1)
    for blocks, h in ((a, b"A"), (b, b"B"), (c, b"C")):
        pool.cache(blocks[0], h)
    plain = pool.take_fresh(1)  # holds nothing reusable
    pool.free(b)
    pool.free(plain)
    pool.free(a)
    pool.free(c)
    # Two never-used blocks first, then the uncached freed block (put at the head), then cached ones by free time.
    order = list(pool.free_queue)
    assert order[0] == plain[0].block_id
    assert order[-3:] == [b[0].block_id, a[0].block_id, c[0].block_id]
    assert pool.num_evictions == 0
    taken = pool.take_fresh(3)
    assert plain[0] in taken and set(pool.cached) == {b"A", b"B", b"C"}
    taken = pool.take_fresh(1)
    assert taken == b and set(pool.cached) == {b"A", b"C"} and b[0].block_hash is None
    assert pool.num_evictions == 1
    assert pool.take_fresh(1) == a and set(pool.cached) == {b"C"}


def test_pool_touch_takes_cached_block_out_of_free_queue_and_double_free_asserts():
    pool = BlockPool(3)
    (blk,) = pool.take_fresh(1)
    pool.cache(blk, b"h")
    pool.free([blk])
    assert blk.block_id in pool.free_queue and pool.cached[b"h"] is blk
    pool.touch([blk])
    assert blk.block_id not in pool.free_queue and blk.ref_cnt == 1
    pool.touch([blk])
    assert blk.ref_cnt == 2
    pool.free([blk])
    assert blk.ref_cnt == 1 and blk.block_id not in pool.free_queue
    pool.free([blk])
    assert blk.ref_cnt == 0 and blk.block_id in pool.free_queue
    with pytest.raises(AssertionError, match="double free"):
        pool.free([blk])


def test_pool_cache_keeps_first_block_for_a_hash():
    pool = BlockPool(2)
    x, y = pool.take_fresh(2)
    pool.cache(x, b"h")
    pool.cache(y, b"h")
    assert pool.cached[b"h"] is x and y.block_hash is None
    pool.cache(x, b"other")  # a block keeps the hash of the data it holds
    assert x.block_hash == b"h" and b"other" not in pool.cached


# ---------------------------------------------------------------- manager

def test_prefix_hits_are_capped_below_prompt_length():
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(8)))  # exactly two full blocks
    assert kv.allocate_slots(a, 8)
    assert len(kv.pool.cached) == 2
    # Same 8 tokens: only one block may hit, the last token must be computed to give logits.
    hits, n = kv.get_computed_blocks(make_request("b", list(range(8))))
    assert n == 4 and hits == kv.block_tables["a"][:1]
    hits, n = kv.get_computed_blocks(make_request("c", list(range(9))))
    assert n == 8 and hits == kv.block_tables["a"][:2]
    hits, n = kv.get_computed_blocks(make_request("d", list(range(7))))
    assert n == 4
    hits, n = kv.get_computed_blocks(make_request("e", [0, 1, 2, 99, 4, 5, 6, 7, 8]))
    assert n == 0 and hits == []
    hits, n = kv.get_computed_blocks(make_request("f", list(range(9)), extra_keys=("salt",)))
    assert n == 0
    off = KVCacheManager(16, BS, enable_prefix_caching=False)
    assert off.allocate_slots(make_request("a", list(range(8))), 8)
    assert off.get_computed_blocks(make_request("c", list(range(9)))) == ([], 0)
    assert not off.pool.cached


def test_shared_blocks_ref_counts_and_release():
    kv = KVCacheManager(10, BS)
    a = make_request("a", list(range(10)))
    assert kv.allocate_slots(a, 10)
    a.num_computed_tokens = 10
    b = make_request("b", list(range(10)) + [50, 51])
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    assert kv.allocate_slots(b, b.num_tokens - n, hits)
    kv.record_admission(b, n)
    ta, tb = kv.block_tables["a"], kv.block_tables["b"]
    assert tb[:2] == ta[:2] and tb[2] is not ta[2]
    assert [blk.ref_cnt for blk in ta] == [2, 2, 1] and tb[2].ref_cnt == 1
    assert kv.prefix_cache_hits == 8 and kv.prefix_cache_queries == 12
    assert kv.pool.num_free_blocks == 10 - 4
    kv.free(a)
    assert [blk.ref_cnt for blk in tb] == [1, 1, 1]
    assert kv.pool.num_free_blocks == 10 - 3
    kv.free(b)
    assert all(blk.ref_cnt == 0 for blk in kv.pool.blocks) and kv.pool.num_free_blocks == 10
    # the full blocks stay findable after release
    hits, n = kv.get_computed_blocks(make_request("c", list(range(10))))
    assert n == 8 and hits == tb[:2]


def test_free_puts_tail_blocks_ahead_for_eviction():
    kv = KVCacheManager(3, BS)
    a = make_request("a", list(range(12)))
    assert kv.allocate_slots(a, 12)
    table = list(kv.block_tables["a"])
    kv.free(a)
    assert list(kv.pool.free_queue) == [b.block_id for b in reversed(table)]
    # one fresh block evicts the sequence's last block; its first two blocks are still a hit
    new = make_request("n", [77] * 4)
    assert kv.allocate_slots(new, 4)
    assert kv.block_tables["n"] == [table[2]]
    hits, n = kv.get_computed_blocks(make_request("c", list(range(12)) + [1]))
    assert hits == table[:2] and n == 8


def test_allocate_failure_changes_nothing_and_counts_reclaimable_hits():
    kv = KVCacheManager(4, BS)
    a = make_request("a", list(range(8)))
    assert kv.allocate_slots(a, 8)
    kv.free(a)  # two cached blocks in the free queue, two never used
    b = make_request("b", list(range(8)) + list(range(100, 110)))  # 18 tokens: 5 blocks, 2 of them hits
    hits, n = kv.get_computed_blocks(b)
    assert n == 8
    before = (list(kv.pool.free_queue), dict(kv.pool.cached))
    # 3 more blocks needed; 4 are in the free queue but 2 of those are the hits themselves
    assert not kv.allocate_slots(b, 10, hits)
    assert (list(kv.pool.free_queue), dict(kv.pool.cached)) == before
    assert "b" not in kv.block_tables and all(blk.ref_cnt == 0 for blk in kv.pool.blocks)
    assert kv.allocate_slots(b, 8, hits)  # 16 tokens: 4 blocks fit
    assert kv.block_tables["b"][:2] == hits and kv.pool.num_free_blocks == 0
    b.num_computed_tokens = 16
    assert not kv.allocate_slots(b, 1)  # 17th token needs a fifth block
    assert len(kv.block_tables["b"]) == 4


def test_usage_and_block_ids():
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(9)))
    assert kv.allocate_slots(a, 9)
    assert kv.usage == pytest.approx(3 / 8)
    assert kv.block_ids("a") == [b.block_id for b in kv.block_tables["a"]]
    assert kv.block_ids("missing") == []


# ---------------------------------------------------------------- property-based: scheduler + KV manager

def check_invariants(sched: Scheduler, kv: KVCacheManager) -> None:
    pool = kv.pool
    counts = Counter()
    for rid, table in kv.block_tables.items():
        assert len({id(b) for b in table}) == len(table), f"block twice in the table of {rid}"
        counts.update(b.block_id for b in table)
    for b in pool.blocks:
        assert b.ref_cnt == counts[b.block_id], f"block {b.block_id}: ref_cnt {b.ref_cnt} != {counts[b.block_id]}"
        if b.ref_cnt > 1:
            assert b.block_hash is not None, "only cached (full, hashed) blocks may be shared"
    assert all(k == b.block_id for k, b in pool.free_queue.items())
    assert set(pool.free_queue) == {b.block_id for b in pool.blocks if b.ref_cnt == 0}
    for h, b in pool.cached.items():
        assert b.block_hash == h
    for b in pool.blocks:
        if b.block_hash is not None:
            assert pool.cached.get(b.block_hash) is b
    assert kv.prefix_cache_hits <= kv.prefix_cache_queries
    running_ids = {r.request_id for r in sched.running}
    assert len(running_ids) == len(sched.running) <= sched.max_num_seqs
    assert set(kv.block_tables) == running_ids
    assert all(r.status == RequestStatus.RUNNING for r in sched.running)
    waiting = list(sched.waiting._fifo) if sched.policy == "fcfs" else [e[-1] for e in sched.waiting._heap]
    assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in waiting)
    assert {r.request_id for r in waiting} | running_ids == set(sched.requests)
    assert len(waiting) + len(sched.running) == len(sched.requests)
    for r in sched.running:
        assert len(kv.block_tables[r.request_id]) * kv.block_size >= r.num_computed_tokens


class Sim:
    """The engine's step loop without a model. `content` plays the KV tensors: every slot remembers which
    (extra_keys, token) was written there, and a request reading its context must find its own tokens."""

    def __init__(self, rng: random.Random, num_blocks: int, budget: int, max_seqs: int, policy: str,
                 block_size: int = BS):
        self.rng = rng
        self.kv = KVCacheManager(num_blocks, block_size)
        self.capacity = num_blocks * block_size
        self.sched = Scheduler(self.kv, max_seqs, budget, self.capacity, policy)
        self.content: dict[int, tuple] = {}
        self.targets: dict[str, int] = {}
        self.prefixes = [[rng.randrange(6) for _ in range(rng.randrange(0, 13))] for _ in range(3)]
        self.next_id = 0
        self.finished = 0

    def add(self) -> None:
        rng = self.rng
        max_out = rng.randint(1, min(6, self.capacity // 2))
        prefix = rng.choice(self.prefixes)
        suffix_len = rng.randint(1 if not prefix else 0, max(1, min(20, self.capacity - max_out - len(prefix))))
        prompt = (prefix + [rng.randrange(6) for _ in range(suffix_len)])[:self.capacity - max_out]
        assert prompt
        extra = ("salt",) if rng.random() < 0.2 else ()
        priority = rng.randrange(3) if self.sched.policy == "priority" else 0
        rid = f"r{self.next_id}"
        self.next_id += 1
        r = make_request(rid, prompt, max_out, priority, extra, arrival=float(self.next_id))
        self.targets[rid] = max_out
        self.sched.add_request(r)

    def abort(self) -> None:
        if self.sched.requests:
            rid = self.rng.choice(sorted(self.sched.requests))
            r = self.sched.requests[rid]
            assert self.sched.abort(rid) is r
            assert r.status == RequestStatus.FINISHED_ABORTED and rid not in self.kv.block_tables
            assert rid not in self.sched.requests and self.sched.abort(rid) is None

    def step(self) -> bool:
        sched, kv = self.sched, self.kv
        had_work = sched.has_unfinished()
        out = sched.schedule()
        check_invariants(sched, kv)
        assert out.total_tokens <= sched.max_num_batched_tokens
        assert len(sched.running) <= sched.max_num_seqs
        ids = [r.request_id for r in out.requests]
        assert len(set(ids)) == len(ids) and set(ids) == set(out.num_scheduled_tokens)
        assert not set(ids) & set(out.preempted)
        for rid in out.preempted:
            r = sched.requests[rid]
            assert r.status == RequestStatus.PREEMPTED and r.num_computed_tokens == 0
        if had_work:
            assert out.requests, "a step with unfinished requests scheduled nothing"
        bs = kv.block_size
        for r in out.requests:  # write K/V of every scheduled token first, as every layer does
            assert r.status == RequestStatus.RUNNING
            n = out.num_scheduled_tokens[r.request_id]
            assert 1 <= n <= r.num_tokens - r.num_computed_tokens
            table = kv.block_tables[r.request_id]
            assert len(table) * bs >= r.num_computed_tokens + n
            for p in range(r.num_computed_tokens, r.num_computed_tokens + n):
                self.content[table[p // bs].block_id * bs + p % bs] = (r.extra_keys, r.all_token_ids[p])
        for r in out.requests:  # then read: the whole context must be this request's own tokens
            n = out.num_scheduled_tokens[r.request_id]
            table = kv.block_tables[r.request_id]
            for p in range(r.num_computed_tokens + n):
                got = self.content.get(table[p // bs].block_id * bs + p % bs)
                assert got == (r.extra_keys, r.all_token_ids[p]), f"{r.request_id} reads wrong KV at {p}"
        for r in out.requests:
            r.num_computed_tokens += out.num_scheduled_tokens[r.request_id]
            if r.num_computed_tokens == r.num_tokens:
                r.append_output_token(self.rng.randrange(6))
                if r.num_output_tokens >= self.targets[r.request_id] or r.num_tokens >= self.capacity:
                    sched.finish(r, RequestStatus.FINISHED_LENGTH)
                    assert r.request_id not in kv.block_tables
                    self.finished += 1
        check_invariants(sched, kv)
        return bool(out.requests)

    def drain(self) -> None:
        for _ in range(5000):
            if not self.sched.has_unfinished():
                break
            self.step()
        assert not self.sched.has_unfinished(), "requests never finished"
        check_invariants(self.sched, self.kv)
        pool = self.kv.pool
        assert not self.kv.block_tables and not self.sched.running and len(self.sched.waiting) == 0
        assert all(b.ref_cnt == 0 for b in pool.blocks)
        assert len(pool.free_queue) == len(pool.blocks)

    def run(self, actions: list[str]) -> None:
        for a in actions:
            getattr(self, a)()
        self.drain()


def run_random(seed: int, num_blocks: int, budget: int, max_seqs: int, policy: str, n_actions: int) -> Sim:
    rng = random.Random(seed)
    sim = Sim(rng, num_blocks, budget, max_seqs, policy)
    actions = rng.choices(["add", "step", "abort"], weights=[3, 6, 1], k=n_actions)
    sim.run(actions)
    return sim


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), num_blocks=st.integers(6, 24), budget=st.integers(1, 48),
       max_seqs=st.integers(1, 8), policy=st.sampled_from(["fcfs", "priority"]),
       block_size=st.sampled_from([1, 2, 4, 8]),
       actions=st.lists(st.sampled_from(["add", "add", "step", "step", "step", "abort"]), max_size=80))
def test_scheduler_and_kv_cache_invariants(seed, num_blocks, budget, max_seqs, policy, block_size, actions):
    sim = Sim(random.Random(seed), num_blocks, budget, max_seqs, policy, block_size)
    sim.run(actions)


def test_random_workloads_exercise_preemption_prefix_hits_and_eviction():
    """The property test above is only as good as what it reaches: these workloads must preempt, hit the
    prefix cache and evict, and still keep every invariant."""
    preemptions = hits = evictions = finished = 0
    for seed in range(12):
        sim = run_random(seed, num_blocks=8, budget=12, max_seqs=4, policy="fcfs" if seed % 2 else "priority",
                         n_actions=120)
        preemptions += sim.sched.num_preemptions
        hits += sim.kv.prefix_cache_hits
        evictions += sim.kv.pool.num_evictions
        finished += sim.finished
    assert preemptions > 0 and hits > 0 and evictions > 0 and finished > 0


def test_reset_prefix_cache_forgets_every_block_and_keeps_running_requests_tables():
    """vLLM's reset_prefix_cache: no prefix is found afterwards, no block keeps a hash, a running request keeps its
    blocks, and the event stream says AllBlocksCleared."""
    from tokenmill.engine.kv_events import AllBlocksCleared
    from tokenmill.engine.request import Request
    from tokenmill.sampling_params import SamplingParams
    kv = KVCacheManager(16, 4)
    kv.enable_events()
    done, running = (Request(rid, list(range(k, k + 12)), SamplingParams(), None, 4) for rid, k in (("a", 0), ("b", 50)))
    for r in (done, running):
        assert kv.allocate_slots(r, 12)
    kv.free(done)
    kv.take_events()
    assert kv.reset_prefix_cache() == 6
    assert kv.take_events() == [AllBlocksCleared()]
    again = Request("a2", list(range(12)), SamplingParams(), None, 4)
    assert kv.get_computed_blocks(again) == ([], 0)
    assert len(kv.block_ids("b")) == 3 and kv.pool.num_free_blocks == 13
    assert all(b.block_hash is None for b in kv.pool.blocks) and not kv.pool.cached
