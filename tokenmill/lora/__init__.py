"""Multi-LoRA serving: many PEFT adapters of one base model, served from one engine and batched together.

- request.py: LoRARequest (vLLM's name and fields), which adapter a request runs with; torch-free.
- adapter.py: reading a PEFT directory (adapter_config.json + adapter_model.safetensors) into per-layer A and B.
- layers.py: the slots of one linear layer and the batched delta: every token's adapter in one pass.
- manager.py: the CPU cache of loaded adapters (LRU, --max-cpu-loras), the --max-loras slots (LRU swap-in), and
  the per-step token → slot map."""
from tokenmill.lora.request import LoRARequest

__all__ = ["LoRARequest"]
