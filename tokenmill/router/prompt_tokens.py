"""A request's prompt as the replicas will tokenize it: the same tokenizer and chat template code as
`tokenmill serve` (tokenmill/api/chat_utils.py), so the router's block keys are the engine's.

The router tokenizes once per request, whatever the number of replicas; the body goes to the replica as sent.
A body the router cannot tokenize is still forwarded (the replica answers it, 400 included); it is routed
without a cache prediction."""
from __future__ import annotations

import logging

from tokenmill.api.chat_protocol import ChatMessage
from tokenmill.api.chat_utils import render_chat
from tokenmill.tokenizer import encode

logger = logging.getLogger("tokenmill.router.prompt_tokens")


class PromptTokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def token_ids(self, route: str, body: dict) -> list[int] | None:
        """The first prompt's token ids (the one a multi-prompt request is routed by), or None."""
        try:
            if route == "chat":
                messages = [ChatMessage.model_validate(m) for m in body["messages"]]
                _, ids = render_chat(self.tokenizer, messages, body.get("add_generation_prompt", True),
                                     body.get("continue_final_message", False), body.get("chat_template_kwargs"),
                                     body.get("tools"))
                return ids
            prompt = body["prompt"]
            if isinstance(prompt, list) and prompt:
                prompt = prompt[0]
            if isinstance(prompt, str):
                return encode(self.tokenizer, prompt)
            if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
                return prompt
        except Exception as e:  # noqa: BLE001 - the replica will report what is wrong with the request
            logger.debug("could not tokenize a %s request: %r", route, e)
        return None
