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
