"""/tokenize, /detokenize and /tokenizer_info (vLLM's extra endpoints): the server's own tokenizer and chat template,
no engine."""
from __future__ import annotations

from tokenmill.sampling_params import ParamError
from tokenmill.server import tokenization_protocol as tp
from tokenmill.server.responses import json_response
from tokenmill.server.server_state import ServerState


class OpenAIServingTokenization:
    def __init__(self, state: ServerState):
        self.state = state

    async def tokenize(self, req: tp.TokenizeRequest):
        state = self.state
        state.check_model(req.model, runner=None)
        if req.messages is not None:
            text, ids = await state.render_chat(req.messages, req.add_generation_prompt, req.continue_final_message,
                                                req.chat_template_kwargs, req.tools)
            if req.add_special_tokens:
                [ids] = await state.encode([text])
        elif req.prompt is not None:
            [ids] = await state.encode([req.prompt], add_special_tokens=req.add_special_tokens is not False)
        else:
            raise ParamError("either prompt or messages is required", "prompt")
        strs = state.tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None  # vocabulary pieces
        return json_response(tp.TokenizeResponse(len(ids), state.engine.max_model_len, ids, strs))

    def detokenize(self, req: tp.DetokenizeRequest):
        state = self.state
        state.check_model(req.model, runner=None)
        bad = [t for t in req.tokens if not 0 <= t < state.engine.vocab_size]
        if bad:
            raise ParamError(f"token id {bad[0]} is out of vocabulary (size {state.engine.vocab_size})", "tokens")
        return json_response(tp.DetokenizeResponse(state.tokenizer.decode(req.tokens)))

    def tokenizer_info(self) -> dict:
        """vLLM's /tokenizer_info: the tokenizer's init arguments (tokenizer_config.json's content, file paths
        left out, special tokens as their text), its class, and the chat template in use."""
        tokenizer = self.state.tokenizer
        config = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
                  if k not in ("vocab_file", "merges_file")}
        config = _json_safe(config)
        config["tokenizer_class"] = type(tokenizer).__name__
        if getattr(tokenizer, "chat_template", None):
            config["chat_template"] = tokenizer.chat_template
        return config


def _json_safe(value):
    if hasattr(value, "content"):  # an AddedToken
        return value.content
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)
