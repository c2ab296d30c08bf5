"""How many drafts a request gets this step: from its measured acceptance, and from the batch.

Per request: drafts are accepted one after another until the first rejection, so with a per-draft acceptance
rate a the j-th draft is verified usefully with probability a^j. The rate is estimated from the request's own
history, an exponential moving average of (accepted drafts) / (drafts looked at), where a step that accepted n
of k drafts looked at n + 1 of them if one was rejected, n if all were accepted (the maximum-likelihood estimate
of a geometric run). The request gets the largest k with a^k >= MIN_POSITION_PROB (capped by
num_speculative_tokens): a draft that will probably be thrown away costs a row of compute for nothing. A request
whose estimate falls so low that it gets none is re-measured with one draft after PROBE_INTERVAL steps (text
changes: a copy may start later in the answer), and after twice as many each time a probe is rejected (up to
MAX_PROBE_INTERVAL), back to PROBE_INTERVAL once one is accepted: a probe is not free, least of all for a draft
model, which must first run the tokens it has not seen (the whole prompt on a request's first draft: a third of
the target's prefill for a draft of a third of its layers).

Across requests: a new request starts from the method's recent acceptance (the same estimate, over every
request's verifications) and its current probe interval, not from a fixed prior: where drafts have been rejected
for a while (a draft model that does not fit the traffic), a new request does not pay for a first draft, only
for a probe once the interval has passed.

Per batch: a step's cost is flat in its number of tokens while it is bound by reading the weights, and grows in
proportion once it is bound by compute. Below that knee drafts are nearly free; above it every draft costs
about what a decode row costs and earns less (a < 1), so batching beats speculation. A step therefore verifies at
most max_verify_tokens tokens (decode rows + drafts); past that, drafts are cut evenly (each request at most
max_verify_tokens // decode rows - 1), and at high concurrency none are proposed at all.

DEFAULT_MAX_VERIFY_TOKENS is that knee as measured by benchmarks/spec_decode_step_cost.py (the default model,
Q4_1 weights kept, bf16, context 256, 2-core Zen 4 EPYC; indicative, on a shared machine): a step of 1, 2, 4, 8,
16, 32 tokens took 5.3, 6.1, 8.3, 13.4, 23.0, 41.5 ms (an earlier run: 5.8, 8.3, 10.8, 16.0, 26.3, 47.8). A
doubling of the tokens adds 16% and 35% up to 4 tokens, then 63%, 72%, 80%: from there a step costs about a fixed
4.4 ms plus 1.1 ms a token, and a draft pays only if it is accepted with probability > 1.1 B / (4.4 + 1.1 B) at B
decode rows (0.2 at 1 row, 0.5 at 4, 0.67 at 8). So 4: one request gets up to 3 drafts (there, 3 to 7 drafts
give about the same tokens per second at acceptance 0.9), two get 1 each, three or more none."""
from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_VERIFY_TOKENS = 4
MIN_POSITION_PROB = 0.3
EMA_DECAY = 0.7  # weight of the past in the acceptance estimate, per speculative step
PRIOR_ACCEPTED, PRIOR_SEEN = 1.0, 2.0  # a new request starts at a = 0.5, worth about two steps of evidence
PROBE_INTERVAL = 8
MAX_PROBE_INTERVAL = 256


@dataclass
class AcceptanceEstimate:
    accepted: float = PRIOR_ACCEPTED
    seen: float = PRIOR_SEEN
    steps_without_drafts: int = 0
    probe_interval: int = PROBE_INTERVAL
    probing: bool = False  # the drafts being verified are a probe

    @property
    def rate(self) -> float:
        return self.accepted / self.seen

    def update(self, num_drafts: int, num_accepted: int, probe: bool | None = None) -> None:
        """One verification; probe: whether its drafts were a probe (default: whether draft_length made this
        estimate's last draft one)."""
        probe = self.probing if probe is None else probe
        looked_at = num_accepted + (1 if num_accepted < num_drafts else 0)
        self.accepted = EMA_DECAY * self.accepted + num_accepted
        self.seen = EMA_DECAY * self.seen + looked_at
        if num_accepted:
            self.probe_interval = PROBE_INTERVAL
        elif probe:
            self.probe_interval = min(2 * self.probe_interval, MAX_PROBE_INTERVAL)
        self.probing = False

    def for_new_request(self) -> AcceptanceEstimate:
        """A new request's estimate: this (method-wide) one's rate, weighted as the prior is, and probe interval."""
        return AcceptanceEstimate(self.rate * PRIOR_SEEN, PRIOR_SEEN, probe_interval=self.probe_interval)


def drafts_for_rate(rate: float, max_drafts: int) -> int:
    """The largest k <= max_drafts with rate^k >= MIN_POSITION_PROB."""
    k, reach = 0, 1.0
    while k < max_drafts:
        reach *= rate
        if reach < MIN_POSITION_PROB:
            break
        k += 1
    return k


def draft_length(estimate: AcceptanceEstimate, max_drafts: int) -> int:
    """This request's draft length from its acceptance alone (a probe of 1 now and then when that is 0)."""
    k = drafts_for_rate(estimate.rate, max_drafts)
    if k:
        estimate.steps_without_drafts = 0
        return k
    estimate.steps_without_drafts += 1
    if estimate.steps_without_drafts >= estimate.probe_interval:
        estimate.steps_without_drafts = 0
        estimate.probing = max_drafts > 0
        return min(1, max_drafts)
    return 0


def per_request_cap(num_decodes: int, max_verify_tokens: int) -> int:
    """The most drafts each of num_decodes decoding requests may have so the step verifies <= max_verify_tokens."""
    return max(0, max_verify_tokens // max(1, num_decodes) - 1)
