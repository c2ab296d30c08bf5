"""A request's `kv_transfer_params`, vLLM's disaggregated prefill/decode handshake (its NixlConnector's keys).

A router (or vLLM's toy proxy) sends a prompt to a prefill instance with `{"do_remote_decode": true}` and
max_tokens 1; that instance prefills, keeps the prompt's full KV blocks pinned, and answers with
`{"do_remote_prefill": true, "remote_engine_id", "remote_block_ids", "remote_host", "remote_port",
"remote_request_id", "tp_size"}`. The router sends the same prompt, with those params, to a decode instance,
which fetches the blocks its prefix cache lacks from remote_host:remote_port (engine/kv_transfer.py) and decodes.

Torch-free and small: the API server, the engine and the offline API share it."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class KVTransferParams:
    do_remote_decode: bool = False  # to a prefill instance: pin the prompt's blocks for a decode instance
    do_remote_prefill: bool = False  # to a decode instance: fetch the prompt's blocks from the remote_* instance
    remote_engine_id: str | None = None
    remote_block_ids: list[int] | None = None  # the prefill instance's block ids, one per full prompt block
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None  # the prefill instance's request, whose pinned blocks are fetched
    tp_size: int = 1

    def problem(self) -> str | None:
        """Why these params cannot be served (None: they can); the caller names the field kv_transfer_params."""
        if self.do_remote_decode and self.do_remote_prefill:
            return "do_remote_decode and do_remote_prefill cannot both be true"
        if self.tp_size != 1:
            return f"tp_size must be 1 (one engine per instance), got {self.tp_size}"
        if not self.do_remote_prefill:
            return None
        missing = [name for name in ("remote_engine_id", "remote_block_ids", "remote_host", "remote_port",
                                     "remote_request_id") if getattr(self, name) is None]
        if missing:
            return f"do_remote_prefill needs {', '.join(missing)} (the prefill instance's kv_transfer_params)"
        if not 0 < self.remote_port < 65536:
            return f"remote_port must be in [1, 65535], got {self.remote_port}"
        if any(b < 0 for b in self.remote_block_ids):
            return "remote_block_ids must be non-negative block ids"
        return None

    @property
    def active(self) -> bool:
        """False for the all-off shape (both flags false): nothing to do."""
        return self.do_remote_decode or self.do_remote_prefill
