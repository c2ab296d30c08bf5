"""The scheduler's side of speculative decoding: which running requests get drafts this step, how many, from
which proposer; and the counters behind vllm:spec_decode_* metrics.

A request gets drafts only while it is decoding (its one uncomputed token is the last one sampled), and only if
its sampling needs nothing per position that verification does not reproduce. It gets none, and runs exactly as
without speculation, when it has: structured output or a thinking tracker (grammar/budget state advanced token
by token), repetition/presence/frequency penalties, logit_bias, allowed_token_ids or bad_words (logits edited,
some from the output so far),
min_tokens not yet reached (EOS masked), logprobs (one entry per token), or stop strings (matched on text by the
front end, which would receive tokens past the stop in the same output). Stop token ids, EOS and max_tokens work
with drafts: the engine ends the request at the first of them in an accepted run (engine.py).

The n-gram and suffix proposers answer one request at a time; a draft model (draft_model.py) proposes for all
the step's speculating requests at once, one forward pass per draft position."""
from __future__ import annotations

from tokenmill.config import SpeculativeConfig
from tokenmill.engine.request import Request
from tokenmill.engine.spec_decode import adaptive
from tokenmill.engine.spec_decode.ngram_proposer import NgramProposer
from tokenmill.engine.spec_decode.suffix_proposer import SuffixProposer


def make_proposer(config: SpeculativeConfig):
    if config.method == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    return SuffixProposer(config.suffix_decoding_max_tree_depth, config.suffix_decoding_max_cached_requests,
                          config.suffix_decoding_max_spec_factor, config.suffix_decoding_min_token_prob)


def can_speculate(r: Request) -> bool:
    p = r.params
    return (r.pooling is None and p.structured_outputs is None and r.thinking is None and p.logprobs is None
            and not p.logit_bias and p.allowed_token_ids is None and not p.bad_words_token_ids
            and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and r.num_output_tokens >= p.min_tokens and not p.stop)


class Speculator:
    def __init__(self, config: SpeculativeConfig, proposer=None):
        """proposer: the draft_model method's DraftModelProposer (the engine builds it: it needs the target)."""
        self.config = config
        self.proposer = proposer or make_proposer(config)
        self.max_verify_tokens = config.max_verify_tokens or adaptive.DEFAULT_MAX_VERIFY_TOKENS
        self.estimates: dict[str, adaptive.AcceptanceEstimate] = {}
        self.overall = adaptive.AcceptanceEstimate()  # every request's verifications: new requests start from it
        # cumulative, for SchedulerStats (vLLM's counters)
        self.num_drafts = 0  # verification steps of a request that had drafts
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * config.num_speculative_tokens

    def plan(self, running: list[Request], token_budget: int, max_model_len: int) -> None:
        """Sets spec_token_ids of the running requests that get drafts this step (every other one's to []).
        Drafts never take a token from the step's normal work: they fit in what the budget leaves over."""
        demand = 0
        decoding = []
        for r in running:
            r.spec_token_ids, r.spec_draft_probs = [], None
            demand += r.num_tokens - r.num_computed_tokens
            if r.num_computed_tokens == r.num_tokens - 1 and r.num_output_tokens and can_speculate(r):
                decoding.append(r)
        room = token_budget - demand
        if not decoding or room <= 0:
            return
        cap = self.config.num_speculative_tokens
        if self.config.adaptive:
            num_decodes = sum(1 for r in running if r.num_computed_tokens == r.num_tokens - 1)
            cap = min(cap, adaptive.per_request_cap(num_decodes, self.max_verify_tokens))
        batched: list[tuple[Request, int]] = []  # draft_model: (request, k), proposed together below
        for r in decoding:
            if room <= 0 or cap <= 0:
                break
            # a run of k accepted drafts emits k + 1 tokens: never past max_tokens or the context
            k = min(cap, room, r.max_tokens - r.num_output_tokens - 1, max_model_len - r.num_tokens)
            if self.config.adaptive and k > 0:
                estimate = self.estimates.get(r.request_id)
                if estimate is None:
                    estimate = self.estimates[r.request_id] = self.overall.for_new_request()
                k = adaptive.draft_length(estimate, k)
            if k <= 0:
                continue
            if self.config.method == "draft_model":  # a draft model always has k drafts to give
                batched.append((r, k))
                room -= k
                continue
            r.spec_token_ids = self.proposer.propose(r.request_id, r.all_token_ids, k)[:k]
            room -= len(r.spec_token_ids)
        if batched:
            self.proposer.propose_batch(batched)

    def record(self, r: Request, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            self.accepted_per_pos[j] += 1
        estimate = self.estimates.get(r.request_id)
        if estimate is not None:
            self.overall.update(num_drafts, num_accepted, estimate.probing)
            estimate.update(num_drafts, num_accepted)

    def finish(self, r: Request) -> None:
        self.estimates.pop(r.request_id, None)
        self.proposer.finish(r.request_id, r.all_token_ids, r.num_prompt_tokens)
