"""Beam search, run above the engine as vLLM v1 runs it; shared by the offline LLM.beam_search and the API server's
`use_beam_search`. No torch here: the API server imports it.

Each step submits one engine request per live beam: the prompt and the beam's tokens, max_tokens=1, asking for the
top 2 * beam_width logprobs (HF's and vLLM's candidate count: enough that beam_width non-EOS continuations always
remain). The engine needs nothing special: its prefix cache finds the prompt's full KV blocks and those the beams
have in common, so a step computes only each beam's last, partial block. The requests of one step are submitted
together (one message to the engine), so they run as one batch.

Scores are vLLM's (get_beam_search_score, after HF's BeamHypotheses): cum_logprob / len ** length_penalty, where
len counts the prompt and the generated tokens but not a final EOS. A step keeps the beam_width best non-EOS
continuations of all beams (all live beams have the same length, so that is the order of their scores); a
continuation by EOS (unless ignore_eos) completes a beam. After max_tokens steps the live beams complete too
("length"), and the result is the beam_width best completed beams.

early_stopping, with HF's meaning (vLLM accepts the field but always runs to max_tokens):
  False: stop as soon as no live beam can still beat the beam_width-th best completed one. The bound is exact (a
         beam's cum_logprob only falls, and its length stays within [now, prompt + max_tokens]), so the result is
         the one that running to max_tokens gives, often in fewer steps.
  True:  stop once beam_width beams have completed with EOS; the live ones are dropped (HF's early_stopping=True).
The steps are greedy and candidates are ranked by the model's raw logprobs, so `temperature` (accepted, as in
vLLM's BeamSearchParams) does not change the result."""
from __future__ import annotations

from dataclasses import dataclass, field

from tokenmill.logprobs import TokenLogprobs
from tokenmill.sampling_params import ParamError, SamplingParams


@dataclass
class BeamSearchParams:
    """vLLM's BeamSearchParams (beam_width is the request's n), plus HF's early_stopping."""
    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool = False

    def __post_init__(self):
        if self.beam_width < 1:
            raise ParamError(f"beam_width must be at least 1, got {self.beam_width}", "beam_width")
        if self.max_tokens < 1:
            raise ParamError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.temperature < 0:
            raise ParamError(f"temperature must be non-negative, got {self.temperature}", "temperature")

    @property
    def num_candidates(self) -> int:
        return 2 * self.beam_width

    def step_params(self, num_logprobs: int = 0) -> SamplingParams:
        """The params of one beam's request in one step: a greedy token and the candidates (or the logprobs the
        client asked for, if more)."""
        return SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True,
                              logprobs=max(self.num_candidates, num_logprobs))


def check_beam_width(beam_width: int, max_logprobs: int, param: str = "beam_width") -> None:
    """A step asks for 2 * beam_width logprobs, which the engine caps at --max-logprobs."""
    if max_logprobs != -1 and 2 * beam_width > max_logprobs:
        raise ParamError(f"beam search with a beam width of {beam_width} needs {2 * beam_width} logprobs per step, "
                         f"more than --max-logprobs allows ({max_logprobs}); the most is {max_logprobs // 2}", param)


@dataclass
class BeamSearchSequence:
    """A beam, in vLLM's shape."""
    tokens: list[int]  # the prompt's, then the generated ones (a final EOS included)
    logprobs: list[TokenLogprobs] = field(default_factory=list)  # per generated token: its logprob and the candidates
    cum_logprob: float = 0.0
    text: str | None = None  # filled in when returned
    finish_reason: str | None = None  # "stop" (EOS) or "length"
    stop_reason: int | str | None = None  # the EOS id for "stop", as vLLM gives it


@dataclass
class BeamSearchOutput:
    """The best beams of one prompt, best first (vLLM's BeamSearchOutput)."""
    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None,
                      length_penalty: float = 1.0) -> float:
    """vLLM's get_beam_search_score: the length counts the prompt, not a final EOS."""
    seq_len = len(tokens) - (1 if tokens and tokens[-1] == eos_token_id else 0)
    return cum_logprob / seq_len ** length_penalty


class BeamSearch:
    """The search of one prompt: `live` are the beams the next step extends; advance() takes that step's results."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams, eos_token_id: int | None):
        self.params = params
        self.eos_token_id = eos_token_id
        self.prompt_len = len(prompt_token_ids)
        self.live = [BeamSearchSequence(list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.num_steps = 0

    @property
    def done(self) -> bool:
        return not self.live

    def score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, self.eos_token_id, self.params.length_penalty)

    def advance(self, results: list[TokenLogprobs | None]) -> None:
        """One step: results[i] is the engine's answer for live beam i (None: it gave none, so the beam ends)."""
        p = self.params
        candidates = []  # (cum_logprob, parent, token, its logprobs entry), in beam order then rank order
        for beam, entry in zip(self.live, results):
            if entry is None:
                continue
            for rank, (token, logprob) in enumerate(zip(entry.top_token_ids, entry.top_logprobs), 1):
                chosen = TokenLogprobs(token, logprob, rank, entry.top_token_ids, entry.top_logprobs)
                cum = beam.cum_logprob + logprob
                if token == self.eos_token_id and not p.ignore_eos:
                    self.completed.append(BeamSearchSequence(beam.tokens + [token], beam.logprobs + [chosen], cum,
                                                             finish_reason="stop", stop_reason=token))
                else:
                    candidates.append((cum, beam, token, chosen))
        candidates.sort(key=lambda c: c[0], reverse=True)  # stable: ties keep beam order, then rank order
        self.live = [BeamSearchSequence(beam.tokens + [token], beam.logprobs + [chosen], cum)
                     for cum, beam, token, chosen in candidates[:p.beam_width]]
        self.num_steps += 1
        if self.num_steps >= p.max_tokens or self._no_live_beam_can_win():
            if not (p.early_stopping and len(self.completed) >= p.beam_width):
                for beam in self.live:
                    beam.finish_reason = "length"
                self.completed.extend(self.live)
            self.live = []

    def _no_live_beam_can_win(self) -> bool:
        p = self.params
        if len(self.completed) < p.beam_width:
            return False
        if p.early_stopping:
            return True
        kth_best = sorted(map(self.score, self.completed), reverse=True)[p.beam_width - 1]
        # A beam's cum_logprob (<= 0) only falls; the score's length lies between the beam's length now (EOS next,
        # which is not counted) and prompt + max_tokens. The best it can reach is at the longest length when the
        # penalty rewards length (> 0), else at the shortest.
        longest = self.prompt_len + p.max_tokens
        return all(b.cum_logprob / (longest if p.length_penalty > 0 else len(b.tokens)) ** p.length_penalty
                   <= kth_best for b in self.live)

    def best(self) -> list[BeamSearchSequence]:
        """The beam_width best completed beams, best first."""
        return sorted(self.completed, key=self.score, reverse=True)[:self.params.beam_width]


def live_beams(searches: list[BeamSearch]) -> list[list[int]]:
    """The token ids of every live beam of every search: one step's engine requests, submitted together."""
    return [beam.tokens for s in searches for beam in s.live]


def advance_all(searches: list[BeamSearch], results: list[TokenLogprobs | None]) -> None:
    """Hands each search its share of a step's results (in live_beams' order)."""
    start = 0
    for s in searches:
        n = len(s.live)
        if n:
            s.advance(results[start:start + n])
        start += n
