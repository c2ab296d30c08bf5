"""Loads a model's tokenizer with HF transformers, without importing torch where that can be avoided.

transformers' AutoTokenizer imports torch whenever torch is installed (through its model-config modules), which
would put a deep-learning framework in the API server process. When the tokenizer's own config names the generic
tokenizers-backed class (`TokenizersBackend`, alias `PreTrainedTokenizerFast`), the class AutoTokenizer would pick
anyway, we load that class directly: the same object, without torch. That covers every GGUF model, whose
converted tokenizer we cache. Other tokenizer classes go through AutoTokenizer."""
from __future__ import annotations

import hashlib
import json
import logging
import os

from tokenmill import envs
from tokenmill.chat_templates import gguf_chat_template

logger = logging.getLogger("tokenmill.tokenizer")

GENERIC_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def _load_directory(path: str, trust_remote_code: bool = False):
    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            tokenizer_class = json.load(f).get("tokenizer_class")
    except (OSError, ValueError):
        tokenizer_class = None
    if tokenizer_class in GENERIC_TOKENIZER_CLASSES and os.path.exists(os.path.join(path, "tokenizer.json")):
        from transformers import PreTrainedTokenizerFast
        return PreTrainedTokenizerFast.from_pretrained(path, local_files_only=True)
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)


def _with_gguf_chat_template(tok, model_path: str):
    if not getattr(tok, "chat_template", None):  # HF's GGUF conversion drops the file's template
        tok.chat_template = gguf_chat_template(model_path)
    return tok


def load_tokenizer(model_path: str, tokenizer_path: str | None = None, trust_remote_code: bool = False):
    """trust_remote_code (--trust-remote-code): a directory's tokenizer may be a class shipped as code beside it."""
    if tokenizer_path:
        return _load_directory(tokenizer_path, trust_remote_code)
    if os.path.isdir(model_path):
        return _load_directory(model_path, trust_remote_code)
    # Building a tokenizer from GGUF metadata takes ~10 s; keep the converted one, keyed by the file's identity.
    st = os.stat(model_path)
    key = hashlib.sha256(f"{os.path.abspath(model_path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    cached = os.path.join(envs.TOKENMILL_CACHE_DIR, "tokenizers", key)
    if os.path.exists(os.path.join(cached, "tokenizer_config.json")):
        return _with_gguf_chat_template(_load_directory(cached), model_path)
    from transformers import AutoTokenizer  # the GGUF conversion itself needs it (and torch), once per file
    tok = AutoTokenizer.from_pretrained(os.path.dirname(model_path), gguf_file=os.path.basename(model_path),
                                        local_files_only=True)
    tok = _with_gguf_chat_template(tok, model_path)
    try:
        tok.save_pretrained(cached)
    except OSError as e:  # a read-only home only costs time
        logger.warning("could not cache the tokenizer at %s: %s", cached, e)
    return tok


# Text up to this long is tokenized on the event loop by the API server and the router: a short prompt takes a few
# microseconds, less than the hop to a worker thread and back, and 1,024 characters ~0.25 ms (2-core Sapphire
# Rapids); longer text goes to a thread, so that one long prompt does not hold up every other request.
INLINE_ENCODE_CHARS = 1024


def encode(tokenizer, text: str, add_special_tokens: bool = True) -> list[int]:
    """`tokenizer.encode(text, add_special_tokens=...)`'s token ids. For a tokenizers-backed tokenizer the Rust
    backend is called directly: transformers wraps that same call in Python (padding and truncation set-up, a
    BatchEncoding built and taken apart), 16 us against 5.5 us for a short prompt, and its many small objects
    set off garbage collections. The wrapper passes the text unchanged and adds nothing when the backend has no
    padding or truncation set (it clears them per call); if either is set, the wrapper runs."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or backend.truncation is not None or backend.padding is not None:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return backend.encode(text, add_special_tokens=add_special_tokens).ids
