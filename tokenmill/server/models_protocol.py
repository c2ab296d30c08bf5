"""/v1/models and vLLM's LoRA adapter endpoints: the model list, and the load/unload request bodies."""
from __future__ import annotations

import msgspec

from tokenmill.api.protocol import Int, _Body


class ModelCard(msgspec.Struct):
    id: str
    created: int
    root: str
    max_model_len: int
    object: str = "model"
    owned_by: str = "tokenmill"
    parent: str | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]
    object: str = "list"


class LoadLoRAAdapterRequest(_Body):
    """vLLM's /v1/load_lora_adapter (with VLLM_ALLOW_RUNTIME_LORA_UPDATING): both fields are required, and their
    absence is answered in vLLM's words (serving_models.py)."""
    lora_name: str | None = None
    lora_path: str | None = None
    load_inplace: bool = False  # replace an adapter already loaded under this name


class UnloadLoRAAdapterRequest(_Body):
    """vLLM's /v1/unload_lora_adapter: the adapter by name (lora_int_id is accepted, as vLLM's shape has it)."""
    lora_name: str | None = None
    lora_int_id: Int | None = None
