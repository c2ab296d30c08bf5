"""/tokenize and /detokenize (vLLM's extra endpoints): the server's own tokenizer and chat template, no engine."""
from __future__ import annotations

from tokenmill.sampling_params import ParamError
from tokenmill.server import protocol as p
from tokenmill.server.responses import json_response
from tokenmill.server.server_state import ServerState


class OpenAIServingTokenization:
    def __init__(self, state: ServerState):
        self.state = state

    async def tokenize(self, req: p.TokenizeRequest):
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
        strs = [state.token_str(t) for t in ids] if req.return_token_strs else None
        return json_response(p.TokenizeResponse(len(ids), state.engine.max_model_len, ids, strs))

    def detokenize(self, req: p.DetokenizeRequest):
        state = self.state
        state.check_model(req.model, runner=None)
        bad = [t for t in req.tokens if not 0 <= t < state.engine.vocab_size]
        if bad:
            raise ParamError(f"token id {bad[0]} is out of vocabulary (size {state.engine.vocab_size})", "tokens")
        return json_response(p.DetokenizeResponse(state.tokenizer.decode(req.tokens)))
