"""Incremental detokenization with stop strings.

tokenizers' DecodeStream buffers tokens until they form valid UTF-8, so no broken characters are emitted.
Stop strings are searched in the text as it grows; while streaming, the last len(longest stop) - 1 characters
are held back, because they may be the start of a stop string that the next token completes."""
from __future__ import annotations

from tokenizers.decoders import DecodeStream

from tokenmill.sampling_params import SamplingParams

_PROMPT_CONTEXT = 4  # prompt tokens fed first, so the first output token gets its leading space right


class IncrementalDetokenizer:
    def __init__(self, tokenizer, params: SamplingParams, prompt_token_ids: list[int]):
        self._backend = tokenizer.backend_tokenizer if hasattr(tokenizer, "backend_tokenizer") else tokenizer
        try:
            self._stream = DecodeStream(ids=list(prompt_token_ids[-_PROMPT_CONTEXT:]),
                                        skip_special_tokens=params.skip_special_tokens)
        except TypeError:  # older tokenizers without prefill
            self._stream = DecodeStream(skip_special_tokens=params.skip_special_tokens)
        self.stop = [s for s in params.stop if s]
        self.include_stop = params.include_stop_str_in_output
        self.hold_back = max((len(s) for s in self.stop), default=1) - 1
        self.text = ""
        self.emitted = 0  # characters of text already handed out by delta()
        self.stop_reason: str | None = None

    def update(self, token_ids: list[int], stop_terminated: bool = False) -> str | None:
        """Adds tokens; returns the stop string if one now appears (text is then cut at it). stop_terminated: the
        last token is the EOS or stop token that ended the request; as in vLLM, its text is left out unless
        include_stop_str_in_output."""
        if stop_terminated and not self.include_stop:
            token_ids = token_ids[:-1]
        for token_id in token_ids:
            piece = self._stream.step(self._backend, token_id)
            if not piece:
                continue
            search_from = max(0, len(self.text) - self.hold_back)
            self.text += piece
            if self.stop and self._find_stop(search_from):
                return self.stop_reason
        return None

    def finish(self, token_ids: list[int], engine_finish: str | None,
               stop_token_ids: list[int]) -> tuple[str | None, str | int | None]:
        """Feeds one engine output; returns (finish_reason, stop_reason), both None while the sample goes on.
        A finish while engine_finish is None means a stop string matched: the caller must abort the engine
        request. A stop string on the token that also hit max_tokens still finishes with "stop", as in vLLM."""
        stop_str = self.update(token_ids, stop_terminated=engine_finish == "stop")
        if stop_str is not None:
            return "stop", stop_str
        if engine_finish is None:
            return None, None
        if engine_finish == "stop" and token_ids and token_ids[-1] in stop_token_ids:
            return "stop", token_ids[-1]
        return ("stop" if engine_finish == "abort" else engine_finish), None

    def _find_stop(self, search_from: int) -> bool:
        best = None
        for s in self.stop:
            i = self.text.find(s, search_from)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return False
        i, s = best
        self.text = self.text[:i + len(s)] if self.include_stop else self.text[:i]
        self.stop_reason = s
        return True

    def delta(self, finished: bool) -> str:
        """Text not handed out yet; unless finished, minus the tail that may still turn into a stop string."""
        end = len(self.text) if finished or not self.stop else max(self.emitted, len(self.text) - self.hold_back)
        out = self.text[self.emitted:end]
        self.emitted = end
        return out
