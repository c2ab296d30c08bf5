"""A stream that outlives its replica: the router relays a streamed completion or chat completion event by event,
knowing the token ids the client has been sent, and when the replica dies mid-stream (its connection breaks, or
it reports a 503 in the stream) it continues on another replica from those ids, under the same response id and in
the same chunk shape, so that the client sees one uninterrupted stream.

How: the router asks the replica for vLLM's `return_token_ids` (the prompt's ids in the first chunk, each chunk's
generated ids) and for the usage chunk, and removes both from what the client sees unless the client asked for
them. To resume, it sends the prompt's ids followed by the generated ids as a token-id prompt to /v1/completions
(chat included: the chat prompt is already ids), with max_tokens (and min_tokens) reduced by what was generated,
and translates the completions chunks back into the original endpoint's shape, with usage counted against the
original prompt. At temperature 0 the resumed text is the text a fault-free run would have produced.

What cannot be resumed this way keeps the old behaviour (the stream ends with an error event): n > 1 or beam
search, logprobs, structured output and tool calls (their state lives in the replica), presence and frequency
penalties (they count output tokens, which become prompt tokens), reasoning output, several prompts. A stop
string that spans the cut is not seen by the new replica."""
from __future__ import annotations

import msgspec

from tokenmill.api import chat_protocol as chp, completion_protocol as cp, protocol as p
from tokenmill.detokenizer import IncrementalDetokenizer
from tokenmill.sampling_params import SamplingParams

# request fields that mean the same on /v1/completions once the prompt is token ids
CARRIED_FIELDS = ("model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos",
                  "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
                  "repetition_penalty", "logit_bias", "user", "priority", "allowed_token_ids", "bad_words",
                  "cache_salt")
COMPLETIONS_DEFAULT_MAX_TOKENS = cp.CompletionRequest.model_fields["max_tokens"].default
DONE = b"data: [DONE]\n\n"

_json_decode = msgspec.json.Decoder().decode
_json_encode = msgspec.json.Encoder().encode


def why_not_resumable(route: str, body: dict | None) -> str | None:
    """None if a stream of this request can be resumed on another replica, else the reason."""
    if route not in ("chat", "completions") or not body or body.get("stream") is not True:
        return "not a streamed completion"
    if body.get("n", 1) not in (1, None) or body.get("use_beam_search"):
        return "n > 1 or beam search"
    if body.get("presence_penalty") or body.get("frequency_penalty"):
        return "presence or frequency penalty"
    if any(body.get(k) is not None for k in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                             "structured_outputs", "thinking_token_budget", "prompt_logprobs")):
        return "structured output, a thinking budget or prompt logprobs"
    response_format = body.get("response_format")
    if isinstance(response_format, dict) and response_format.get("type", "text") != "text":
        return "structured output"
    if route == "chat":
        if body.get("logprobs") or (body.get("tools") and body.get("tool_choice") != "none"):
            return "logprobs or tools"
    else:
        prompt = body.get("prompt")
        if body.get("logprobs") is not None or body.get("echo"):
            return "logprobs or echo"
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (list, str)) and len(prompt) != 1:
            return "several prompts"
    return None


class ResumableStream:
    """One resumable stream's state as the router relays it: feed() takes the replica's bytes and returns the
    client's; after a failure, resume_request() is what to send the next replica and begin_resume() what to tell
    the client before its first chunk."""

    def __init__(self, route: str, body: dict, tokenizer):
        self.route = route
        self.body = body
        self.tokenizer = tokenizer
        stream_options = body.get("stream_options") or {}
        self.wants_ids = bool(body.get("return_token_ids"))
        self.wants_usage = bool(stream_options.get("include_usage"))
        self.prompt_ids: list[int] | None = None
        self.generated: list[int] = []  # the ids of every chunk relayed so far
        self.text = ""  # the text the client has been sent
        self.id = self.created = self.model = None
        self.finished = False  # the choice's finish_reason was relayed
        self.done = False  # [DONE] was relayed
        self.failure: str | None = None  # the replica reported a failure in the stream
        self.usage: dict | None = None  # the first replica's usage, as it reported it
        self.resumed_after: int | None = None  # generated tokens before the resume; None until resumed
        self.num_resumes = 0
        self.blocker: str | None = None  # what makes this stream unresumable after all (reasoning, tool calls)
        self._buffer = b""

    # ---------------- what goes upstream ----------------

    def upstream_body(self, extra: dict | None = None) -> bytes:
        """The request for the first replica; `extra` fields added (a decode instance's kv_transfer_params)."""
        stream_options = {**(self.body.get("stream_options") or {}), "include_usage": True}
        return _json_encode({**self.body, **(extra or {}), "return_token_ids": True, "stream_options": stream_options})

    def remaining_tokens(self) -> int | None:
        if self.route == "chat":
            limit = self.body.get("max_completion_tokens") or self.body.get("max_tokens")
        else:
            limit = self.body.get("max_tokens", COMPLETIONS_DEFAULT_MAX_TOKENS)
        return None if limit is None else limit - len(self.generated)

    def can_resume(self) -> str | None:
        """None if the stream can go on elsewhere, else why not."""
        if self.blocker:
            return self.blocker
        if self.prompt_ids is None:
            return "the replica never sent the prompt's token ids"
        return None

    def resume_request(self) -> tuple[list[int], bytes]:
        """The token-id prompt and the /v1/completions body that continue this stream."""
        body = {k: self.body[k] for k in CARRIED_FIELDS if k in self.body}
        prompt = self.prompt_ids + self.generated
        stream_options = {"include_usage": True}
        if (self.body.get("stream_options") or {}).get("continuous_usage_stats"):
            stream_options["continuous_usage_stats"] = True
        body.update(prompt=prompt, stream=True, return_token_ids=True, stream_options=stream_options)
        remaining = self.remaining_tokens()
        body["max_tokens"] = remaining  # None: up to the context, as the original request
        if self.body.get("min_tokens"):
            body["min_tokens"] = max(0, self.body["min_tokens"] - len(self.generated))
        return prompt, _json_encode(body)

    def begin_resume(self) -> bytes:
        """Called once a replica has failed: the text the generated ids hold that the client was not sent yet (the
        replica held it back: a possible stop string, an incomplete character), and, when nothing is left to
        generate, the stream's end. Resumed chunks are translated from here on."""
        self.num_resumes += 1
        self.resumed_after = len(self.generated)
        self.failure = None
        self._buffer = b""
        out = b""
        params = SamplingParams(stop=_as_list(self.body.get("stop")),
                                include_stop_str_in_output=bool(self.body.get("include_stop_str_in_output")),
                                skip_special_tokens=self.body.get("skip_special_tokens", True))
        detokenizer = IncrementalDetokenizer(self.tokenizer, params, self.prompt_ids)
        stop = detokenizer.update(self.generated)
        full = detokenizer.text
        if full.startswith(self.text) and len(full) > len(self.text):
            out += self._event(self._chunk(full[len(self.text):], None, None, []))
            self.text = full
        remaining = self.remaining_tokens()
        if stop is not None or (remaining is not None and remaining <= 0):
            out += self._finish("stop" if stop is not None else "length", stop)
        return out

    def _finish(self, finish_reason: str, stop_reason) -> bytes:
        out = self._event(self._chunk("", finish_reason, stop_reason, []))
        if self.wants_usage:
            num_prompt = len(self.prompt_ids)
            usage = p.Usage(num_prompt, len(self.generated), num_prompt + len(self.generated))
            out += self._event(self._usage_chunk(usage))
        self.finished = self.done = True
        return out + DONE

    # ---------------- what comes back ----------------

    def feed(self, raw: bytes) -> bytes:
        """The replica's bytes in, the client's out (whole events only). Stops at a failure event."""
        self._buffer += raw
        out = []
        while self.failure is None and not self.done:
            end = self._buffer.find(b"\n\n")
            if end < 0:
                break
            event, self._buffer = self._buffer[:end], self._buffer[end + 2:]
            if not event.startswith(b"data: "):
                out.append(event + b"\n\n")
                continue
            data = event[6:]
            if data == b"[DONE]":
                self.done = True
                out.append(DONE)
                continue
            chunk = _json_decode(data)
            error = chunk.get("error") if isinstance(chunk, dict) else None
            if error is not None:
                if error.get("code") in (500, 503) and not self.finished:
                    self.failure = str(error.get("message"))  # the replica's engine died: go on elsewhere
                    break
                out.append(event + b"\n\n")
                continue
            translated = self._client_chunk(chunk)
            if translated is not None:
                out.append(translated)
        return b"".join(out)

    def _client_chunk(self, chunk: dict) -> bytes | None:
        if self.id is None:
            self.id, self.created, self.model = chunk.get("id"), chunk.get("created"), chunk.get("model")
        if self.resumed_after is not None:
            return self._translate(chunk)
        usage = chunk.get("usage")
        if usage is not None and not chunk.get("choices"):
            self.usage = usage
        # the ids the router asked for, null again when the client did not ask (as the replica sends them then)
        if chunk.get("prompt_token_ids") is not None:  # chat: at the top level of the first chunk
            self.prompt_ids = chunk["prompt_token_ids"] if self.wants_ids else _null(chunk, "prompt_token_ids")
        keep = False
        for choice in chunk.get("choices") or ():
            if choice.get("prompt_token_ids") is not None:  # completions: in the choice's first chunk
                self.prompt_ids = choice["prompt_token_ids"] if self.wants_ids else _null(choice, "prompt_token_ids")
            ids = choice.get("token_ids") if self.wants_ids else _null(choice, "token_ids")
            self.generated += ids or ()
            if self.route == "chat":
                delta = choice.get("delta") or {}
                if delta.get("reasoning_content") or delta.get("tool_calls"):
                    self.blocker = "reasoning or tool-call output"
                self.text += delta.get("content") or ""
                keep |= bool(delta)
            else:
                self.text += choice.get("text") or ""
                keep |= bool(choice.get("text"))
            if choice.get("finish_reason") is not None:
                self.finished = keep = True
            keep |= choice.get("logprobs") is not None
        if not chunk.get("choices"):
            keep = usage is not None and self.wants_usage
        if not keep and not self.wants_ids:
            return None  # a chunk the client would not have had: ids only, or the usage it did not ask for
        return b"data: " + _json_encode(chunk) + b"\n\n"

    def _translate(self, chunk: dict) -> bytes | None:
        """A /v1/completions chunk of the resumed request, in the original request's shape."""
        usage = chunk.get("usage")
        if usage is not None:
            num_prompt = len(self.prompt_ids)
            usage = p.Usage(num_prompt, usage["completion_tokens"] + self.resumed_after,
                            num_prompt + usage["completion_tokens"] + self.resumed_after,
                            msgspec.convert(usage.get("prompt_tokens_details"), p.PromptTokensDetails | None)
                            or p.UNSET)
        choices = chunk.get("choices") or []
        if not choices:
            return self._event(self._usage_chunk(usage)) if usage is not None and self.wants_usage else None
        out = b""
        for choice in choices:
            ids = choice.get("token_ids") or []
            self.generated += ids
            text = choice.get("text") or ""
            self.text += text
            finish = choice.get("finish_reason")
            self.finished |= finish is not None
            if text or finish is not None or self.wants_ids:
                out += self._event(self._chunk(text, finish, choice.get("stop_reason"), ids, usage))
        return out or None

    def _chunk(self, text: str, finish_reason, stop_reason, ids: list[int], usage: p.Usage | None = None):
        if self.route == "chat":
            choice = chp.ChatChunkChoice(0, chp.DeltaMessage(content=text) if text else chp.DeltaMessage(),
                                         finish_reason=finish_reason, stop_reason=stop_reason)
            if self.wants_ids:
                choice.token_ids = ids
            out = chp.ChatCompletionChunk(self.id, self.created, self.model, [choice])
            if usage is not None:
                out.usage = usage
            return out
        choice = cp.CompletionStreamChoice(0, text, None, finish_reason, stop_reason)
        if self.wants_ids:
            choice.token_ids = ids
        return cp.CompletionStreamResponse(self.id, self.created, self.model, [choice], usage)

    def _usage_chunk(self, usage: p.Usage):
        if self.route == "chat":
            return chp.ChatCompletionUsageChunk(self.id, self.created, self.model, usage)
        return cp.CompletionStreamResponse(self.id, self.created, self.model, [], usage)

    @staticmethod
    def _event(message) -> bytes:
        return b"data: " + msgspec.json.encode(message) + b"\n\n"


def _null(fields: dict, name: str):
    """fields[name], left there as null."""
    value, fields[name] = fields.get(name), None
    return value


def _as_list(stop) -> list[str]:
    if stop is None:
        return []
    return [stop] if isinstance(stop, str) else list(stop)
