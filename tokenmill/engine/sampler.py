"""Turns a step's logits into one token per request, batched over the requests.

Order, as in vLLM: allowed_token_ids, bad words, logit_bias and min_tokens masking, repetition/presence/frequency
penalties, then greedy
argmax, or temperature, top-k, top-p, min-p and a draw. Logprobs are of the raw model output.
A seeded request draws its uniform from its own torch.Generator, advanced once per token, so its output does not depend on
what else is in the batch.

On CUDA all of it runs on the device: the per-request parameters and token ids are built on the host and moved
in one transfer, top-k/top-p sorts in full instead of asking the host which rows its shortcut covered, and the
step's one device-to-host copy is of the sampled ids (plus one for the logprobs, when asked)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tokenmill.engine.request import Request
from tokenmill.engine.transfer import to_device
from tokenmill.logprobs import TokenLogprobs


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


def logprob_entries(logprobs: torch.Tensor, token_ids: torch.Tensor, ks: list[int]) -> list[TokenLogprobs]:
    """logprobs [N, V] (already log-softmaxed), the chosen token of each row, and how many alternatives."""
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(1, keepdim=True) + 1
    kmax = max(ks)
    top_vals, top_ids = logprobs.topk(kmax, dim=1) if kmax else (logprobs[:, :0], token_ids[:, None][:, :0])
    # one device-to-host copy for all of it: float64 holds the float32 values and the ids exactly. A row is
    # [token, rank, logprob, top ids (k), top logprobs (k)]
    k = top_ids.shape[1]
    rows = torch.cat([t.double() for t in (token_ids[:, None], ranks, chosen, top_ids, top_vals)], 1).tolist()
    return [TokenLogprobs(int(r[0]), r[2], int(r[1]), [int(t) for t in r[3:3 + n]], r[3 + k:3 + k + n])
            for r, n in zip(rows, ks)]


def sample_inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """The first token whose cumulative probability exceeds u * total, per row (float64 keeps the tail exact).
    A token of probability 0 is never returned: its CDF equals its predecessor's."""
    cdf = probs.double().cumsum(dim=-1)
    targets = (uniforms * cdf[:, -1])[:, None]
    picked = torch.searchsorted(cdf, targets, right=True).squeeze(1)
    # Rounding can put a target at the very top; fall back to the last token that has any probability.
    last_possible = probs.shape[1] - 1 - (probs.flip(-1) > 0).int().argmax(dim=-1)
    return torch.minimum(picked, last_possible)


def banned_tokens(r: Request) -> list[int]:
    """bad_words: the last token of each bad word whose other tokens the output ends with (a one-token word, always)."""
    words = r.params.bad_words_token_ids
    if not words:
        return []
    out = r.output_token_ids
    return [w[-1] for w in words if len(w) == 1 or (len(w) - 1 <= len(out) and out[len(out) - len(w) + 1:] == w[:-1])]


class Sampler:
    def __init__(self, vocab_size: int, device: torch.device, seed: int = 0, ops=None):
        self.vocab_size = vocab_size
        self.device = device
        self.ops = ops  # tokenmill's CPU kernels (argmax), or None
        self.generator = torch.Generator(device=device)
        self.generator.manual_seed(seed)

    def __call__(self, logits: torch.Tensor, requests: list[Request],
                 constrain: Callable[[torch.Tensor], None] | None = None) -> SamplerOutput:
        """constrain masks logits in place (structured output); logprobs stay those of the raw model output."""
        logits = logits[:, :self.vocab_size]
        want_logprobs = [r.params.logprobs is not None for r in requests]
        raw_logprobs = torch.log_softmax(logits, dim=-1) if any(want_logprobs) else None
        logits = self._apply_bias_and_penalties(logits, requests)
        if constrain is not None:
            constrain(logits)

        greedy = [r.params.greedy for r in requests]
        if all(greedy):
            tokens = self._argmax(logits)
        else:
            tokens = self._draw(logits, requests, greedy)

        entries: list[TokenLogprobs | None] = [None] * len(requests)
        if raw_logprobs is not None:
            rows = [i for i, w in enumerate(want_logprobs) if w]
            got = logprob_entries(raw_logprobs[rows], tokens[rows], [requests[i].params.logprobs for i in rows])
            for i, e in zip(rows, got):
                entries[i] = e
        return SamplerOutput(tokens.tolist(), entries)

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        # The kernel splits rows across threads; torch's argmax runs a row on one.
        if self.ops is not None and logits.dtype == torch.float32 and logits.stride(-1) == 1:
            return self.ops.argmax(logits)
        return logits.argmax(dim=-1)

    def _apply_bias_and_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        edited = False
        for i, r in enumerate(requests):
            p = r.params
            banned = banned_tokens(r)
            if p.allowed_token_ids is not None or banned:
                if not edited:
                    logits, edited = logits.clone(), True
                if p.allowed_token_ids is not None:
                    allowed = torch.tensor(p.allowed_token_ids, device=logits.device)
                    kept = logits[i, allowed]
                    logits[i] = float("-inf")
                    logits[i, allowed] = kept
                if banned:
                    logits[i, banned] = float("-inf")
            if p.logit_bias:
                if not edited:
                    logits, edited = logits.clone(), True
                ids = torch.tensor(list(p.logit_bias), device=logits.device)
                vals = torch.tensor(list(p.logit_bias.values()), device=logits.device, dtype=logits.dtype)
                logits[i].index_add_(0, ids, vals)
            forced = r.thinking.forced_token(r.output_token_ids) if r.thinking is not None else None
            if forced is not None:  # a spent thinking budget: only the end-of-thinking string may come next
                if not edited:
                    logits, edited = logits.clone(), True
                logits[i] = float("-inf")
                logits[i, forced] = 0.0
                continue
            if r.num_output_tokens < p.min_tokens:
                banned = list(p.stop_token_ids) + ([] if p.ignore_eos else list(r.eos_token_ids))
                if banned:
                    if not edited:
                        logits, edited = logits.clone(), True
                    logits[i, banned] = float("-inf")
        rows = [i for i, r in enumerate(requests) if r.params.repetition_penalty != 1.0
                or r.params.presence_penalty or r.params.frequency_penalty]
        if rows:
            if not edited:
                logits = logits.clone()
            self._apply_penalties(logits, [requests[i] for i in rows], rows)
        return logits

    def _apply_penalties(self, logits: torch.Tensor, requests: list[Request], rows: list[int]) -> None:
        dev = logits.device
        # the token ids and the penalties built on the host, moved in one transfer (engine/transfer.py)
        out_ids = [r.output_token_ids for r in requests]
        prompt_ids = [r.prompt_token_ids for r in requests]
        out_rows, out_ids, prompt_rows, prompt_ids, penalties = to_device([
            np.repeat(np.arange(len(requests)), [len(t) for t in out_ids]),
            np.fromiter((t for ids in out_ids for t in ids), dtype=np.int64),
            np.repeat(np.arange(len(requests)), [len(t) for t in prompt_ids]),
            np.fromiter((t for ids in prompt_ids for t in ids), dtype=np.int64),
            np.array([[r.params.repetition_penalty, r.params.frequency_penalty, r.params.presence_penalty]
                      for r in requests], dtype=np.float32)], dev)
        counts = torch.zeros(len(rows), self.vocab_size, device=dev)
        counts.index_put_((out_rows, out_ids), torch.ones(out_ids.shape[0], device=dev), accumulate=True)
        seen = torch.zeros(len(rows), self.vocab_size, dtype=torch.bool, device=dev)
        seen[prompt_rows, prompt_ids] = True
        seen |= counts > 0
        rep, freq, pres = penalties[:, 0:1], penalties[:, 1:2], penalties[:, 2:3]
        sub = logits[rows]
        # Repetition penalty (CTRL): shrink positive and grow negative logits of tokens seen in prompt or output.
        sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        sub = sub - freq * counts - pres * (counts > 0)
        logits[rows] = sub

    def target_probs(self, logits: torch.Tensor, requests: list[Request], greedy: list[bool]) -> torch.Tensor:
        """What each sampled row draws from: logits / temperature, top-k, top-p, then min-p (not renormalised
        after min-p; sample_inverse_cdf scales by the total). Greedy rows are left at temperature 1. Speculative
        verification (spec_decode/rejection_sampler.py) draws from the same distributions."""
        dev = logits.device
        temps = torch.tensor([1.0 if g else r.params.temperature for r, g in zip(requests, greedy)],
                             device=dev)[:, None]
        scaled = logits / temps
        top_k = [r.params.top_k for r in requests]
        top_p = [r.params.top_p for r in requests]
        min_p = [r.params.min_p for r in requests]
        if any(k > 0 for k in top_k) or any(p < 1.0 for p in top_p):
            scaled = self._top_k_top_p(scaled, top_k, top_p)
        probs = torch.softmax(scaled, dim=-1)
        if any(m > 0 for m in min_p):
            floor = torch.tensor(min_p, device=dev)[:, None] * probs.max(dim=-1, keepdim=True).values
            probs = torch.where(probs < floor, 0.0, probs)
        return probs

    def _draw(self, logits: torch.Tensor, requests: list[Request], greedy: list[bool]) -> torch.Tensor:
        dev = logits.device
        probs = self.target_probs(logits, requests, greedy)
        # Inverse CDF: one uniform per row, from the request's own generator when it is seeded. Drawing a noise
        # value per vocabulary entry instead cost 80 ms per step for 64 rows on the CPU.
        uniforms = torch.empty(len(requests), dtype=torch.float64, device=dev)
        unseeded = [i for i, r in enumerate(requests) if r.params.seed is None]
        if unseeded:
            uniforms[unseeded] = torch.rand(len(unseeded), dtype=torch.float64, device=dev,
                                            generator=self.generator)
        for i, r in enumerate(requests):
            if r.params.seed is not None:
                if r.generator is None:
                    r.generator = torch.Generator(device=dev)
                    r.generator.manual_seed(r.params.seed)
                uniforms[i] = torch.rand(1, dtype=torch.float64, device=dev, generator=r.generator)[0]
        sampled = sample_inverse_cdf(probs, uniforms)
        if any(greedy):
            sampled = torch.where(torch.tensor(greedy, device=dev), self._argmax(logits), sampled)
        return sampled

    # Rows with top-p but no top-k look for their nucleus among this many best tokens first.
    TOP_P_CANDIDATES = 1024

    @classmethod
    def _top_k_top_p(cls, logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        """Masks (with -inf) the tokens outside each row's top-k, then outside its top-p nucleus. Without a
        full-vocabulary sort: the candidates are the K best tokens of each row (K: the largest top-k, or
        TOP_P_CANDIDATES), which is exact when a row's nucleus lies inside them; a row whose nucleus does not
        (a flat distribution) is sorted in full. Same result as the full sort (_top_k_top_p_sorted)."""
        dev, vocab = logits.device, logits.shape[1]
        ks = [min(t, vocab) if t > 0 else vocab for t in top_k]
        num = min(vocab, max(k if k < vocab else cls.TOP_P_CANDIDATES for k in ks))
        # On CUDA the full sort costs tens of microseconds and asks the host nothing; the candidates' path below
        # asks which rows it covered (two device-to-host syncs)
        if num >= vocab or logits.is_cuda:
            return cls._top_k_top_p_sorted(logits, top_k, top_p)
        values, order = logits.topk(num, dim=-1)
        k = torch.tensor(ks, device=dev)[:, None]
        values = values.masked_fill(torch.arange(num, device=dev)[None, :] >= k, float("-inf"))
        # A row with top-k keeps nothing outside its candidates: normalize over them. A row without top-k
        # normalizes over the whole vocabulary.
        full_row = k >= vocab
        log_norm = torch.where(full_row, logits.logsumexp(-1, keepdim=True), values.logsumexp(-1, keepdim=True))
        probs = (values - log_norm).exp()
        cumulative = probs.cumsum(dim=-1)
        p = torch.tensor(top_p, device=dev)[:, None]
        values = values.masked_fill(cumulative - probs >= p, float("-inf"))
        out = torch.full_like(logits, float("-inf")).scatter(1, order, values)
        untouched = (full_row & (p >= 1.0)).squeeze(1)  # neither top-k nor top-p: nothing is masked
        if untouched.any():
            out[untouched] = logits[untouched]
        # The nucleus is inside the candidates once their mass reaches top_p.
        uncovered = (full_row & (p < 1.0) & (cumulative[:, -1:] < p)).squeeze(1)
        if uncovered.any():
            rows = uncovered.nonzero().squeeze(1)
            out[rows] = cls._top_k_top_p_sorted(logits[rows], [top_k[i] for i in rows.tolist()],
                                                 [top_p[i] for i in rows.tolist()])
        return out

    @staticmethod
    def _top_k_top_p_sorted(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
        dev = logits.device
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        vocab = logits.shape[1]
        k = torch.tensor([min(t, vocab) if t > 0 else vocab for t in top_k], device=dev)[:, None]
        ranks = torch.arange(vocab, device=dev)[None, :]
        sorted_logits = sorted_logits.masked_fill(ranks >= k, float("-inf"))
        p = torch.tensor(top_p, device=dev)[:, None]
        probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token once the mass before it already reaches top_p; the first token always stays.
        mass_before = probs.cumsum(dim=-1) - probs
        sorted_logits = sorted_logits.masked_fill(mass_before >= p, float("-inf"))
        return torch.full_like(logits, float("-inf")).scatter(1, order, sorted_logits)
