"""Per-request pooling options (vLLM's PoolingParams), the runner names, and the checks a pooling request passes
on both sides of the engine boundary. Imports no torch: the API server uses it."""
from __future__ import annotations

from dataclasses import dataclass

from tokenmill.sampling_params import ParamError

RUNNERS = ("auto", "generate", "pooling")

# config.json architectures that are encoders: they have no decode, so `--runner auto` picks pooling for them
ENCODER_ARCHITECTURES = ("BertModel",)


@dataclass
class PoolingParams:
    """A request that is embedded, not generated: its prompt is computed in one step and pooled into one vector."""
    dimensions: int | None = None  # Matryoshka: keep the first d components (then normalise)


def resolve_runner(runner: str, architecture: str) -> str:
    """`--runner auto`: pooling for encoders, generate for everything else (a decoder can still embed with
    `--runner pooling`, by its last token)."""
    if runner not in RUNNERS:
        raise ValueError(f"--runner must be one of {', '.join(RUNNERS)}, got {runner!r}")
    if runner == "auto":
        return "pooling" if architecture in ENCODER_ARCHITECTURES else "generate"
    if runner == "generate" and architecture in ENCODER_ARCHITECTURES:
        raise ValueError(f"{architecture} is an encoder: it cannot generate; use --runner pooling (or auto)")
    return runner


def truncate(ids: list[int], truncate_prompt_tokens: int | None, max_model_len: int) -> list[int]:
    """vLLM's truncate_prompt_tokens on token ids: keep the last k (-1: max_model_len)."""
    if truncate_prompt_tokens is None:
        return ids
    k = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    return ids[-k:] if len(ids) > k else ids


def check_generate_runner(runner: str) -> None:
    """A text-generation request needs --runner generate."""
    if runner != "generate":
        raise ParamError("this model runs with --runner pooling (embeddings, score, rerank, pooling); completions "
                         "and chat need a server started with --runner generate", "model")


def check_pooling_runner(runner: str) -> None:
    """An embedding, score, rerank or pooling request needs --runner pooling."""
    if runner != "pooling":
        raise ParamError("this model runs with --runner generate; embeddings, score, rerank and pooling need a "
                         "server started with --runner pooling", "model")


def validate_pooling_request(prompt_token_ids: list[int], params: PoolingParams, max_model_len: int,
                             vocab_size: int, matryoshka: bool, runner: str) -> None:
    """Raises ParamError if the engine cannot embed the prompt. The prompt is computed in one step, so it must fit
    max_model_len whole."""
    check_pooling_runner(runner)
    if not prompt_token_ids:
        raise ParamError("the input is empty", "input")
    n = len(prompt_token_ids)
    if n > max_model_len:
        raise ParamError(f"This model's maximum context length is {max_model_len} tokens. However, you requested "
                         f"{n} tokens in the input for embedding generation. Please reduce the length of the "
                         "input, or set truncate_prompt_tokens.", "input")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ParamError(f"token id {bad[0]} is out of vocabulary (size {vocab_size})", "input")
    if params.dimensions is not None:
        if not matryoshka:
            raise ParamError("Model does not support matryoshka representation, changing output dimensions will "
                             "lead to poor results.", "dimensions")
        if params.dimensions < 1:
            raise ParamError("Dimensions must be greater than 0", "dimensions")
