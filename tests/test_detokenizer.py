"""Incremental detokenization: equal to a full decode, never a broken character, stop strings found across
token boundaries and never leaked while streaming."""
from __future__ import annotations

import pytest

from tokenmill.sampling_params import SamplingParams
from tokenmill.detokenizer import IncrementalDetokenizer

MULTIBYTE = "Hello 👋 世界! Café naïve — 🤖🎉 日本語のテキスト, 한국어, Ελληνικά, and 🇫🇷 flags 👨‍👩‍👧."
TEXTS = [MULTIBYTE, " 🙂🙃 emoji at the start, 中文在中间, and at the end 🚀",
         "plain ASCII text with  double spaces\nand a newline"]


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def stream(detok: IncrementalDetokenizer, ids: list[int], chunk: int = 1):
    """Feeds ids `chunk` at a time as the API server does; returns the deltas and the stop string if any."""
    deltas, stop = [], None
    for i in range(0, len(ids), chunk):
        stop = detok.update(ids[i:i + chunk])
        deltas.append(detok.delta(finished=stop is not None))
        if stop is not None:
            return deltas, stop
    deltas.append(detok.delta(finished=True))
    return deltas, None


def test_text_splits_characters_across_tokens(tokenizer):
    # The premise of the tests below: single tokens of this text are not valid UTF-8 on their own.
    ids = encode(tokenizer, MULTIBYTE)
    assert tokenizer.decode(ids) == MULTIBYTE
    assert sum("\ufffd" in tokenizer.decode([t]) for t in ids) >= 10


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk", [1, 3])
@pytest.mark.parametrize("prompt", ["", "Repeat after me:", "日本"])
def test_incremental_equals_full_decode(tokenizer, text, chunk, prompt):
    prompt_ids = encode(tokenizer, prompt) or [tokenizer.bos_token_id or 0]
    ids = encode(tokenizer, text)
    expected = tokenizer.decode(prompt_ids + ids)[len(tokenizer.decode(prompt_ids)):]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(), prompt_ids)
    deltas, stop = stream(detok, ids, chunk)
    assert stop is None
    assert "".join(deltas) == expected == detok.text
    assert expected == tokenizer.decode(ids)  # byte-level BPE: the prompt does not change the text
    for d in deltas:
        assert "\ufffd" not in d


def test_text_never_holds_a_broken_character(tokenizer):
    ids = encode(tokenizer, MULTIBYTE)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(), [])
    for t in ids:
        detok.update([t])
        assert "\ufffd" not in detok.text
        assert MULTIBYTE.startswith(detok.text)
    assert detok.text == MULTIBYTE


@pytest.mark.parametrize("skip", [True, False])
def test_special_tokens(tokenizer, skip):
    ids = encode(tokenizer, "Hi there") + [tokenizer.eos_token_id]
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(skip_special_tokens=skip), encode(tokenizer, "Say hi:"))
    deltas, _ = stream(detok, ids)
    assert "".join(deltas) == tokenizer.decode(ids, skip_special_tokens=skip)
    assert ("<|im_end|>" in detok.text) is not skip


def test_stop_terminated_leaves_out_the_stop_token(tokenizer):
    ids = encode(tokenizer, "one two three")
    for include, expected in ((False, " two"), (True, " two three")):
        params = SamplingParams(stop_token_ids=[ids[-1]], include_stop_str_in_output=include)
        detok = IncrementalDetokenizer(tokenizer, params, ids[:1])
        assert detok.update(ids[1:2]) is None
        assert detok.update(ids[2:], stop_terminated=True) is None
        assert detok.text == expected and detok.delta(finished=True) == expected


# ---- stop strings ----

STOP_TEXT = "The quick brown fox jumps over the lazy dog 🐶🦴 and then runs far away."


def _stop_case(tokenizer, stop: str | list[str], include: bool = False, chunk: int = 1, text: str = STOP_TEXT):
    stops = [stop] if isinstance(stop, str) else stop
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=stops, include_stop_str_in_output=include),
                                   encode(tokenizer, "Story:"))
    emitted = ""
    found = None
    consumed = 0
    for i in range(0, len(ids), chunk):
        found = detok.update(ids[i:i + chunk])
        consumed = i + chunk
        d = detok.delta(finished=found is not None)
        assert "\ufffd" not in d
        emitted += d
        yield emitted, found, ids[:consumed]
        if found is not None:
            return
    emitted += detok.delta(finished=True)
    yield emitted, None, ids


def _run_stop(tokenizer, stop, include=False, chunk=1, text=STOP_TEXT):
    """Streams text with stop strings; checks that what is emitted is, at every step, a prefix of the expected
    output, so nothing of the stop string ever leaks. Returns the final output, the stop string found and the
    tokens consumed. The stop string found is the first to complete."""
    stops = [stop] if isinstance(stop, str) else stop
    hits = sorted((text.find(s) + len(s), text.find(s), s) for s in stops if s in text)
    if hits:
        _, at, first = hits[0]
        expected = text[:at + len(first)] if include else text[:at]
    else:
        first, expected = None, text
    for emitted, found, consumed in _stop_case(tokenizer, stop, include, chunk, text):
        assert expected.startswith(emitted), (emitted, expected)
    assert emitted == expected and found == first
    return emitted, found, consumed


def test_stop_string_spanning_tokens(tokenizer):
    stop = "the lazy do"  # tokens " the", " lazy", " dog": ends inside the third
    ids = encode(tokenizer, STOP_TEXT)
    assert sum(1 for t in ids if tokenizer.decode([t]).strip() in ("the", "lazy", "dog")) >= 3
    emitted, found, consumed = _run_stop(tokenizer, stop)
    assert emitted == "The quick brown fox jumps over "
    # Found on the very token that completes it, and no later.
    assert tokenizer.decode(consumed).endswith(" dog") and "lazy do" not in tokenizer.decode(consumed[:-1])


@pytest.mark.parametrize("chunk", [1, 2, 5])
def test_stop_string_included_on_request(tokenizer, chunk):
    emitted, _, _ = _run_stop(tokenizer, "over the lazy", include=True, chunk=chunk)
    assert emitted == "The quick brown fox jumps over the lazy"


@pytest.mark.parametrize("chunk", [1, 3])
def test_stop_string_of_multibyte_characters(tokenizer, chunk):
    # 🐶🦴 are each several byte-level tokens: the stop string spans partial-character tokens.
    emitted, found, _ = _run_stop(tokenizer, "🐶🦴", chunk=chunk)
    assert emitted == "The quick brown fox jumps over the lazy dog " and found == "🐶🦴"
    emitted, _, _ = _run_stop(tokenizer, "🦴 and", include=True, chunk=chunk)
    assert emitted == "The quick brown fox jumps over the lazy dog 🐶🦴 and"


def test_first_completed_of_several_stop_strings_wins(tokenizer):
    # "fox" completes before "brown fox jumps" (which starts earlier) and "away": it wins, and the long
    # hold-back that "brown fox jumps" needs leaks nothing.
    emitted, found, _ = _run_stop(tokenizer, ["away", "fox", "brown fox jumps"])
    assert found == "fox" and emitted == "The quick brown "
    emitted, found, _ = _run_stop(tokenizer, ["runs far", "dog"])
    assert found == "dog" and emitted == "The quick brown fox jumps over the lazy "


def test_partial_stop_string_is_released_at_the_end(tokenizer):
    # "lazy dox" never completes: the held-back tail comes out when the request finishes.
    emitted, found, _ = _run_stop(tokenizer, "lazy dox", text="Over the lazy do")
    assert found is None and emitted == "Over the lazy do"


def test_stop_string_in_the_prompt_is_ignored(tokenizer):
    ids = encode(tokenizer, " and then stop here")
    detok = IncrementalDetokenizer(tokenizer, SamplingParams(stop=["Story"]), encode(tokenizer, "Story"))
    deltas, stop = stream(detok, ids)
    assert stop is None and "".join(deltas) == " and then stop here"


def test_stop_strings_completing_on_the_same_token_earliest_start_wins(tokenizer):
    # Both complete on " lazy": the one that starts first is the stop, whatever the order they are listed in.
    for stops in (["lazy", "over the lazy"], ["over the lazy", "lazy"]):
        emitted, found, _ = _run_stop(tokenizer, stops)
        assert found == "over the lazy" and emitted == "The quick brown fox jumps "


def test_prompt_context_gives_the_leading_space():
    # A SentencePiece-style (Metaspace) decoder drops the leading space of the first token it decodes: the
    # last prompt tokens are fed first so that the first output word keeps its space.
    from tokenizers import Tokenizer, decoders, models
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "▁Hello": 1, "▁world": 2, "▁again": 3, "!": 4}, unk_token="<unk>"))
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always")
    assert tok.decode([2, 3]) == "world again"
    detok = IncrementalDetokenizer(tok, SamplingParams(), [1])
    deltas, _ = stream(detok, [2, 3, 4])
    assert "".join(deltas) == " world again!" == tok.decode([1, 2, 3, 4])[len("Hello"):]


@pytest.mark.parametrize("n", [1, 2])
def test_a_generation_cut_inside_a_character_ends_without_a_replacement_char(tokenizer, n):
    """Cut (max_tokens, say) after the first bytes of a multi-byte character: the incomplete character is held back
    to the end, in the streamed deltas and the final text, as vLLM holds it (no trailing U+FFFD)."""
    ids = encode(tokenizer, MULTIBYTE)
    cuts = [i for i in range(1, len(ids)) if tokenizer.decode(ids[:i]).endswith("\ufffd")]
    assert cuts  # the premise: some prefixes end inside a character
    for cut in cuts:
        detok = IncrementalDetokenizer(tokenizer, SamplingParams(n=n), [])
        deltas, stop = stream(detok, ids[:cut], 1)
        assert stop is None and "\ufffd" not in "".join(deltas) + detok.text, cut
        # what the whole characters decode to (a token holding a space and the character's first byte waits whole)
        assert "".join(deltas) == detok.text and MULTIBYTE.startswith(detok.text), cut
        assert len(detok.text) >= len(tokenizer.decode(ids[:cut]).rstrip("\ufffd").rstrip()), cut


def test_logprob_token_texts_complete_their_characters(tokenizer):
    """vLLM's rule for logprob token strings: a byte token that ends inside a character reads "" and the token that
    completes it carries the whole character (decoded with up to 4 tokens before it), so no token string has a
    U+FFFD and the strings of a sequence join into its text. Alone, some of these tokens decode to U+FFFD."""
    from tokenmill.server.server_state import ServerState

    class Texts:  # the two attributes token_str reads
        token_str = ServerState.token_str

        def __init__(self):
            self.tokenizer, self._token_strs = tokenizer, {}

    ids = encode(tokenizer, MULTIBYTE)
    assert any(tokenizer.decode([t]).endswith("\ufffd") for t in ids)  # the premise
    texts = Texts()
    strings = [texts.token_str(t, ids[max(0, i - 4):i]) for i, t in enumerate(ids)]
    assert not any("\ufffd" in s for s in strings)
    assert "".join(strings) == tokenizer.decode(ids)
    assert texts.token_str(ids[0]) == tokenizer.decode([ids[0]])  # without context: the token alone
