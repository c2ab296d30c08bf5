"""Flags whose value is a JSON object naming a dataclass's fields, as vLLM's `--kv-events-config` and
`--speculative-config` are: one parser, so that every such flag refuses unknown keys the same way."""
from __future__ import annotations

import dataclasses
import json


def parse_json_flag(cls, flag: str, value):
    """value: the flag's JSON text, or (the offline LLM) a dict or an instance of cls; None stays None."""
    if value is None or isinstance(value, cls):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as e:
            raise ValueError(f"{flag} is not JSON: {e}") from None
    known = {f.name for f in dataclasses.fields(cls)}
    if not isinstance(value, dict) or set(value) - known:
        unknown = sorted(set(value) - known) if isinstance(value, dict) else value
        raise ValueError(f"{flag} takes a JSON object with the keys {sorted(known)}; got {unknown!r}")
    return cls(**value)


def fold_dotted_json_flags(argv: list[str]) -> list[str]:
    """vLLM's dotted spelling of a JSON flag's keys, `--structured-outputs-config.backend xgrammar` (or
    `--flag.key=value`, `--flag.a.b value` for a nested key), folded into `--flag '{"key": "xgrammar"}'`, merged over
    the flag's own JSON when that is given too. A value that parses as JSON is taken as such (true, 4), else as text."""
    dotted: dict[str, dict] = {}
    out: list[str] = []
    first_at: dict[str, int] = {}
    i = 0
    while i < len(argv):
        token = argv[i]
        head, eq, value = token.partition("=")
        if not (head.startswith("--") and "." in head):
            out.append(token)
            i += 1
            continue
        if not eq:
            if i + 1 >= len(argv):
                raise ValueError(f"{head} needs a value")
            value, i = argv[i + 1], i + 1
        i += 1
        flag, *keys = head.split(".")
        try:
            value = json.loads(value)
        except ValueError:
            pass
        node = dotted.setdefault(flag, {})
        for key in keys[:-1]:
            node = node.setdefault(key, {})
        node[keys[-1]] = value
        first_at.setdefault(flag, len(out))
    for flag in sorted(dotted, key=first_at.__getitem__, reverse=True):  # later insertions first: indexes hold
        given = [j for j, t in enumerate(out) if t == flag or t.startswith(flag + "=")]
        if given:
            j = given[-1]
            text = out[j].partition("=")[2] if "=" in out[j] else (out[j + 1] if j + 1 < len(out) else "{}")
            try:
                base = json.loads(text)
            except ValueError:
                raise ValueError(f"{flag} is not JSON: {text!r}") from None
            merged = json.dumps(_merge(base, dotted[flag]))
            if "=" in out[j]:
                out[j] = f"{flag}={merged}"
            else:
                out[j + 1] = merged
        else:
            out[first_at[flag]:first_at[flag]] = [flag, json.dumps(dotted[flag])]
    return out


def _merge(base: dict, over: dict) -> dict:
    merged = dict(base)
    for key, value in over.items():
        merged[key] = _merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) \
            else value
    return merged
