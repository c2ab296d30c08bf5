"""What a step costs on this machine, fitted from the steps the engine has run: the scheduler's bound on prefill
chunks while decodes run (Sarathi-Serve's stall-free batching).

A step that carries a prefill chunk holds every running stream for as long as the chunk takes: with the fixed
512-token budget, a 2-core CPU ran mixed steps of ~150 ms between 17 ms decode steps (c=8), so ITL p99 was 9x
its p50. The scheduler instead gives prefill chunks only the tokens whose predicted cost keeps the step within a
target, so a long prompt still progresses every step and no decode waits more than one bounded step.

The model is linear in what a step computes (least squares over the last WINDOW steps, refitted every REFIT):
    seconds = a + b * prefill tokens + c * decode rows + d * prefill token-context pairs + e * decode context
where a pair is one query token against one key (attention's work grows with the context a chunk attends to).
Until FIRST_FIT steps of both kinds were seen, or when the fit is degenerate, it predicts nothing, and a step
with decodes carries at most UNFITTED_CHUNK prefill tokens: the full token budget there let the first minutes of
a server run 500-token chunks beside running streams (mixed steps of 150-200 ms against 14 ms decode steps on a
2-core Sapphire Rapids, c=8: ITL p99 7x its p50), and small chunks make the mixed steps the fit needs sooner.
Within that cap, a rough bound from the steps seen so far (the seconds per token of the latest prefill-only step;
the latest decode-only step, or the latest mixed step less its prefill at that rate) keeps the chunk within the
target: on two AVX2 cores in float32 a 64-token chunk costs ~110 ms beside 43 ms decode steps, and at c=8 with
prompts always waiting, no step runs decodes alone before the fit (benchmarks/step_fit.py: 127 such steps at the
cap, 214 ms at p99)."""
from __future__ import annotations

import numpy as np

WINDOW = 512
REFIT = 32
FIRST_FIT = 64
MIN_CHUNK = 16  # tokens: a long prompt always moves, one block at a time at least
UNFITTED_CHUNK = 64  # tokens: the prefill a step with decodes carries before the first fit


class StepCostModel:
    def __init__(self, target_s: float | None):
        """target_s: the mixed step's target (--max-step-latency-ms); None derives it from the fit: DECODE_FACTOR
        times what the step's decodes alone cost, and at least MIN_TARGET_S (a lone decode costs a few ms on a
        CPU: twice that would cut prompts into slivers and trade much TTFT for little ITL)."""
        self.target_s = target_s
        self._x = np.zeros((WINDOW, 5))
        self._y = np.zeros(WINDOW)
        self._n = 0  # steps recorded, the ring's write position is n % WINDOW
        self._mixed = 0  # of them, steps with prefill tokens and decode rows both
        self.coef: np.ndarray | None = None
        # before the fit: seconds per token of the latest prefill-only step (its fixed cost included, which
        # errs towards smaller chunks) and the decodes' seconds in the latest step with decodes
        self._token_s: float | None = None
        self._decode_s: float | None = None

    DECODE_FACTOR = 2.0
    MIN_TARGET_S = 0.030

    def derived_target(self, decode_only: float, decode_rows: int, pending: int) -> float:
        """DECODE_FACTOR times the decodes' own step, times the prompts that wait per stream it protects when
        they outnumber the streams. A longer step delays each running stream by what it adds; a bounded chunk
        delays the first token of every prompt still to compute. With few streams and a queue of prompts (a burst
        under Poisson arrivals), a fixed factor spent the queue's TTFT to spare a stream or two a few ms: on a
        2-core Sapphire Rapids, goodput under the mixed long/short workload fell to nothing at 0.5 req/s while
        the fixed token budget reached 1.5 (benchmarks/results/goodput.md). Where streams outnumber the prompts
        (a closed loop of c=8) the factor is unchanged, and so is the ITL it keeps."""
        return max(self.DECODE_FACTOR * decode_only * max(1.0, pending / decode_rows), self.MIN_TARGET_S)

    def target(self, decode_s: float, decode_rows: int, pending: int) -> float:
        """The mixed step's target: the one set (--max-step-latency-ms), else derived from what the decodes
        alone cost (decode_s: predicted by the fit, or before it estimated from the latest steps)."""
        return self.target_s if self.target_s is not None else self.derived_target(decode_s, decode_rows, pending)

    @staticmethod
    def features(prefill_tokens: int, prefill_pairs: int, decode_rows: int, decode_context: int) -> np.ndarray:
        return np.array([1.0, prefill_tokens, decode_rows, prefill_pairs / 1024.0, decode_context / 1024.0])

    def record(self, prefill_tokens: int, prefill_pairs: int, decode_rows: int, decode_context: int,
               seconds: float) -> None:
        i = self._n % WINDOW
        self._x[i] = self.features(prefill_tokens, prefill_pairs, decode_rows, decode_context)
        self._y[i] = seconds
        self._n += 1
        self._mixed += prefill_tokens > 0 and decode_rows > 0
        if decode_rows == 0 and prefill_tokens >= MIN_CHUNK:
            self._token_s = seconds / prefill_tokens
        elif prefill_tokens == 0 and decode_rows > 0:
            self._decode_s = seconds
        elif decode_rows > 0 and self._token_s is not None:
            # a mixed step less its prefill's estimated cost: with prompts always waiting (a closed loop), no step
            # runs decodes alone before the fit
            self._decode_s = max(0.0, seconds - prefill_tokens * self._token_s)
        if self._n >= FIRST_FIT and self._mixed >= 8 and self._n % REFIT == 0:
            self._fit()

    def _fit(self) -> None:
        n = min(self._n, WINDOW)
        x, y = self._x[:n], self._y[:n]
        coef, _, rank, _ = np.linalg.lstsq(x, y, rcond=None)
        # a negative per-token cost is noise around zero, and would let the bound grow without limit
        self.coef = coef if rank == x.shape[1] and coef[1] > 0 else None

    def predict(self, prefill_tokens: int, prefill_pairs: int, decode_rows: int, decode_context: int) -> float:
        assert self.coef is not None
        return float(self.features(prefill_tokens, prefill_pairs, decode_rows, decode_context) @ self.coef)

    def prefill_budget(self, decode_rows: int, decode_context: int, context: int, budget: int,
                       pending: int = 1) -> int:
        """The most prefill tokens (a multiple of MIN_CHUNK, at least MIN_CHUNK, at most budget) that a step with
        these decodes can carry within the target, for a chunk starting at `context` tokens already computed;
        budget when no decode runs; when there is no fit yet, at most UNFITTED_CHUNK, and less where the steps
        seen so far say that more would pass the target (see the top of the file). pending: the requests whose
        prompts are not yet computed (waiting, or part-way), which the derived target weighs (see derived_target)."""
        if decode_rows == 0:
            return budget
        if self.coef is None:
            if self._token_s is None or self._decode_s is None:
                return min(budget, UNFITTED_CHUNK)
            left = max(0.0, self.target(self._decode_s, decode_rows, pending) - self._decode_s)
            chunks = min(UNFITTED_CHUNK, int(left / self._token_s)) // MIN_CHUNK
        else:
            target = self.target(self.predict(0, 0, decode_rows, decode_context), decode_rows, pending)
            chunks, hi = 0, budget // MIN_CHUNK  # in chunks of MIN_CHUNK: the largest number whose cost fits
            while chunks < hi:
                k = (chunks + hi + 1) // 2
                tokens = k * MIN_CHUNK
                pairs = tokens * context + tokens * (tokens + 1) // 2
                if self.predict(tokens, pairs, decode_rows, decode_context) <= target:
                    chunks = k
                else:
                    hi = k - 1
        return min(budget, max(MIN_CHUNK, chunks * MIN_CHUNK))
