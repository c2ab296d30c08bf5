"""tokenmill.tokenizer.encode (the server's and the router's prompt tokenization) against transformers' own
`tokenizer.encode`, the reference: the same ids for every text, with and without special tokens, on the default
model's tokenizer (from GGUF, BOS added) and all-MiniLM-L6-v2's (a BERT tokenizer: [CLS] and [SEP] added)."""
from __future__ import annotations

import random

import pytest

from helpers import minilm_path
from tokenmill.tokenizer import encode, load_tokenizer


def texts(tokenizer) -> list[str]:
    rng = random.Random(0)
    specials = [t for t in tokenizer.all_special_tokens if t]
    pieces = ["Hello", " world", "\n\n", "  ", "ünïcödé", "日本語", "🙂", "<|im_start|>", "user", "1234.5",
              "\t", "def f(x):", "'s", "I'M", ""] + specials
    out = ["", " ", "Hello there, how", "<|im_start|>user\nhi<|im_end|>\n"]
    for _ in range(300):
        out.append("".join(rng.choice(pieces) for _ in range(rng.randint(1, 12))))
    return out


@pytest.mark.parametrize("which", ["default", "minilm"])
def test_encode_equals_transformers_encode(which, tokenizer):
    tok = tokenizer if which == "default" else load_tokenizer(minilm_path())
    assert tok.backend_tokenizer is not None  # the direct path, not the fallback, is what is compared
    for text in texts(tok):
        for add_special_tokens in (True, False):
            assert encode(tok, text, add_special_tokens) == tok.encode(text, add_special_tokens=add_special_tokens), \
                (text, add_special_tokens)


def test_a_backend_with_truncation_set_goes_through_transformers(tokenizer):
    """transformers clears the backend's truncation per call; encode does not, so it defers to transformers."""
    tokenizer.backend_tokenizer.enable_truncation(max_length=2)
    try:
        text = "a sentence of more than two tokens"
        assert len(encode(tokenizer, text)) > 2
        assert encode(tokenizer, text) == tokenizer.encode(text)
    finally:
        tokenizer.backend_tokenizer.no_truncation()
