"""Verification of drafts: which of them the target model accepts, and the token that follows them, such that
the output is distributed exactly as plain sampling from the target (Leviathan et al. 2023, Chen et al. 2023).

Position j of a request with k drafts has p_j, the target's distribution there after temperature, top-k, top-p and
min-p (the sampler's own processing, Sampler.target_probs). For a draft x_j drawn from q_j: accept it with
probability min(1, p_j(x_j) / q_j(x_j)); at the first rejection emit a token drawn from max(p_j - q_j, 0),
renormalised, and stop; if all k are accepted, emit a bonus token drawn from p_k. Every emitted token is then
distributed as p: general_rejection_sample.

The n-gram and suffix proposers, and a draft model for greedy and seeded requests (its argmax), are
deterministic: q_j is one-hot on x_j. Then "accept with probability
p(x), else draw from p without x" is the same as drawing y from p by inverse CDF and accepting x iff y == x, and
emitting y otherwise (P(y == x) = p(x); given y != x, y is distributed as p without x, renormalised). So
verify() draws each position exactly as the sampler draws a token: the same processing, one uniform per
position, from the request's own generator when it is seeded, consumed only for the positions that emit a token
(the generator is rewound past the others). A seeded request thus gets the very tokens it gets without
speculation, and greedy requests (argmax at every position) likewise.

A draft model's drafts for other sampled requests are drawn from its own q_j (request.spec_draft_probs): those
are verified by general_rejection_sample, with the k + 1 uniforms drawn for the request's positions (k for the
acceptance tests, the last for the one token drawn after them, from the residual or, all accepted, from p_k)."""
from __future__ import annotations

import torch

from tokenmill.engine.request import Request
from tokenmill.engine.sampler import Sampler, sample_inverse_cdf


def accepted_length(targets: list[int], drafts: list[int]) -> int:
    """How many drafts, from the first, equal the target's token at their position."""
    n = 0
    while n < len(drafts) and drafts[n] == targets[n]:
        n += 1
    return n


def verify(sampler: Sampler, logits: torch.Tensor, requests: list[Request]) -> list[list[int]]:
    """logits: k_i + 1 rows per request (its last token's and each draft's, drafts in request.spec_token_ids);
    returns each request's emitted tokens: its accepted drafts and the target's token after them."""
    logits = logits[:, :sampler.vocab_size]
    row_requests = [r for r in requests for _ in range(len(r.spec_token_ids) + 1)]
    greedy = [r.params.greedy for r in row_requests]
    if all(greedy):
        targets = sampler._argmax(logits).tolist()
    else:
        targets, probs, uniforms = _draw_positions(sampler, logits, requests, row_requests, greedy)
    out, row = [], 0
    for r in requests:
        k = len(r.spec_token_ids)
        if r.spec_draft_probs is not None:  # drawn from the draft's q (never for greedy requests)
            rows = slice(row, row + k + 1)
            out.append(general_rejection_sample(probs[rows], r.spec_draft_probs[:k], r.spec_token_ids,
                                                uniforms[rows]))
        else:
            mine = targets[row:row + k + 1]
            n = accepted_length(mine, r.spec_token_ids)
            out.append(r.spec_token_ids[:n] + [mine[n]])
        row += k + 1
    if not all(greedy):
        _rewind_seeded(requests, out)
    return out


def _draw_positions(sampler: Sampler, logits: torch.Tensor, requests: list[Request], row_requests: list[Request],
                    greedy: list[bool]) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """Each position's token drawn as the sampler draws; also the distributions and uniforms it used."""
    dev = logits.device
    probs = sampler.target_probs(logits, row_requests, greedy)
    uniforms = torch.empty(len(row_requests), dtype=torch.float64, device=dev)
    row = 0
    for r in requests:
        n = len(r.spec_token_ids) + 1
        if r.params.seed is not None:
            if r.generator is None:
                r.generator = torch.Generator(device=dev)
                r.generator.manual_seed(r.params.seed)
            r.spec_generator_state = r.generator.get_state()
            uniforms[row:row + n] = torch.rand(n, dtype=torch.float64, device=dev, generator=r.generator)
        else:  # the engine's generator: its order is no request's concern
            uniforms[row:row + n] = torch.rand(n, dtype=torch.float64, device=dev, generator=sampler.generator)
        row += n
    tokens = sample_inverse_cdf(probs, uniforms)
    if any(greedy):
        tokens = torch.where(torch.tensor(greedy, device=dev), sampler._argmax(logits), tokens)
    return tokens.tolist(), probs, uniforms


def _rewind_seeded(requests: list[Request], emitted: list[list[int]]) -> None:
    """A seeded request's generator advances by one uniform per emitted token, as without speculation (one draw
    of n uniforms equals n draws of one: checked in tests/test_spec_decode.py)."""
    for r, tokens in zip(requests, emitted):
        if r.params.seed is not None and not r.params.greedy:
            r.generator.set_state(r.spec_generator_state)
            torch.rand(len(tokens), dtype=torch.float64, device=r.generator.device, generator=r.generator)
            r.spec_generator_state = None


def general_rejection_sample(target_probs: torch.Tensor, draft_probs: torch.Tensor, draft_token_ids: list[int],
                             uniforms: torch.Tensor) -> list[int]:
    """One request's verification against a draft distribution q (a draft model's): target_probs [k+1, V] (not
    necessarily normalised: min-p is not renormalised) and draft_probs [k, V], normalised, from which
    draft_token_ids were drawn; uniforms [k+1] in [0, 1). Returns the accepted drafts and the token after them."""
    k = len(draft_token_ids)
    dev = target_probs.device
    p = target_probs.double()
    p = p / p.sum(dim=-1, keepdim=True)
    q = draft_probs.double()
    positions, drafts = torch.arange(k, device=dev), torch.tensor(draft_token_ids, dtype=torch.long, device=dev)
    # accept x_j with probability min(1, p/q): u q < p (q(x_j) > 0, as x_j was drawn from q)
    accepted = (uniforms[:k] * q[positions, drafts] < p[positions, drafts]).tolist()
    n = accepted.index(False) if False in accepted else k
    if n == k:  # all accepted: the bonus token, from p_k
        dist = p[k]
    else:
        dist = (p[n] - q[n]).clamp_min(0.0)
        if dist.sum() <= 0:  # p == q: a rejection has probability 0; rounding only
            dist = p[n]
    return draft_token_ids[:n] + [int(sample_inverse_cdf(dist[None], uniforms[k:k + 1])[0])]
