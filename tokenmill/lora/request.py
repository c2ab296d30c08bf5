"""Which adapter a request runs with: vLLM's LoRARequest(lora_name, lora_int_id, lora_path).

A msgspec Struct, so it crosses the process boundary inside AddRequest as it is; torch-free, as the API server
imports it. lora_int_id is the adapter's identity in the engine (its cache, its slots, its KV blocks): the API
server hands out a new one at every load, so a name unloaded and loaded again from other weights never finds
the old adapter's KV blocks."""
from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # the model it was trained on, for /v1/models' `parent` (default: the base)

    def __post_init__(self):
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be > 0, got {self.lora_int_id}")

    # vLLM's other names for the same fields
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path

    @property
    def extra_keys(self) -> tuple:
        """What enters every block hash of its requests (engine/block_hash.py): tagged, so that it can never equal
        another kind of extra key, and with the id, so that two adapters (or two loads of one name) never share KV
        with each other, nor with the base model, whose blocks have no extra keys."""
        return (("lora", self.lora_int_id, self.lora_name),)


class LoRAModulePath(msgspec.Struct, frozen=True):
    """One --lora-modules entry: `name=path`, or vLLM's JSON `{"name": ..., "path": ..., "base_model_name": ...}`."""
    name: str
    path: str
    base_model_name: str | None = None

    @classmethod
    def parse(cls, text: str) -> LoRAModulePath:
        if text.lstrip().startswith("{"):
            try:
                return msgspec.json.decode(text, type=cls)
            except msgspec.DecodeError as e:
                raise ValueError(f"--lora-modules: bad JSON {text!r}: {e}") from None
        name, sep, path = text.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes name=path (or JSON), got {text!r}")
        return cls(name, path)
