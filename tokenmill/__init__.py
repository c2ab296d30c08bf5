"""tokenmill: an LLM inference server with a paged KV cache, prefix caching and continuous batching."""
from tokenmill.beam_search import BeamSearchParams
from tokenmill.lora.request import LoRARequest
from tokenmill.sampling_params import SamplingParams, StructuredOutputsParams

__version__ = "0.1.0"
__all__ = ["LLM", "BeamSearchParams", "LoRARequest", "SamplingParams", "StructuredOutputsParams", "__version__"]


def __getattr__(name):
    # LLM pulls in torch and the model code; keep `import tokenmill` light for the CLI and the API server.
    if name == "LLM":
        from tokenmill.llm import LLM
        return LLM
    raise AttributeError(name)
