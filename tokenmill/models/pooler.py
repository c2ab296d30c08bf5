"""Turns a sequence's hidden states into one vector: the pooling method and normalisation of the model, as its
sentence-transformers config states them (`modules.json` → the Pooling module's `config.json`, and a `Normalize`
module), else vLLM's defaults (CLS for BERT-shaped encoders, the last token for decoders; normalised).

`dimensions` (Matryoshka) keeps the first d components, then normalises, as vLLM does; only models that declare
Matryoshka training (`matryoshka_dimensions` or `is_matryoshka` in config.json) allow it."""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

# sentence-transformers' Pooling config keys → our method names
_MODES = {"pooling_mode_cls_token": "cls", "pooling_mode_mean_tokens": "mean", "pooling_mode_lasttoken": "last"}


@dataclass
class PoolerConfig:
    method: str  # cls | mean | last
    normalize: bool
    max_seq_length: int | None = None  # sentence_bert_config.json: what the model was trained on
    matryoshka: bool = False

    @classmethod
    def from_model(cls, model_path: str, hf_config, is_encoder: bool) -> PoolerConfig:
        method, normalize = ("cls" if is_encoder else "last"), True
        matryoshka = bool(getattr(hf_config, "matryoshka_dimensions", None) or getattr(hf_config, "is_matryoshka", False))
        modules = _read_json(model_path, "modules.json") if os.path.isdir(model_path) else None
        if modules is None:
            return cls(method, normalize, None, matryoshka)
        normalize = any(m.get("type", "").endswith(".Normalize") for m in modules)
        for m in modules:
            if m.get("type", "").endswith(".Pooling"):
                pooling = _read_json(model_path, os.path.join(m.get("path", ""), "config.json")) or {}
                modes = [name for key, name in _MODES.items() if pooling.get(key)]
                others = [k for k, v in pooling.items() if k.startswith("pooling_mode") and v and k not in _MODES]
                if len(modes) != 1 or others:
                    raise ValueError(f"unsupported sentence-transformers pooling {pooling}; tokenmill pools with "
                                     "exactly one of: cls, mean, lasttoken")
                method = modes[0]
        max_len = (_read_json(model_path, "sentence_bert_config.json") or {}).get("max_seq_length")
        return cls(method, normalize, max_len, matryoshka)

    def pool(self, hidden: torch.Tensor, seq_lens: list[int], dimensions: list[int | None]) -> list[list[float]]:
        """hidden: [num_tokens, hidden] of whole sequences end to end; returns one float list per sequence."""
        lens = torch.tensor(seq_lens, device=hidden.device)
        ends = torch.cumsum(lens, 0)
        if self.method == "cls":
            pooled = hidden[ends - lens]
        elif self.method == "last":
            pooled = hidden[ends - 1]
        else:  # mean, in float32 as sentence-transformers sums
            seq_of_token = torch.repeat_interleave(torch.arange(len(seq_lens), device=hidden.device), lens)
            sums = torch.zeros(len(seq_lens), hidden.shape[1], dtype=torch.float32, device=hidden.device)
            pooled = sums.index_add_(0, seq_of_token, hidden.float()) / lens[:, None]
        pooled = pooled.float()
        out = []
        for vec, dims in zip(pooled, dimensions):
            if dims is not None:
                vec = vec[:dims]
            if self.normalize:
                vec = F.normalize(vec, p=2, dim=-1)
            out.append(vec.tolist())
        return out


def _read_json(model_path: str, name: str):
    try:
        with open(os.path.join(model_path, name)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
