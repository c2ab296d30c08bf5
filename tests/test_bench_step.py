"""`tokenmill bench step` on a tiny workload: every category is there, none is negative, and they add up."""
from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

import tokenmill
from tokenmill.bench.step import REGION, _categories
from tokenmill.cli import main

ROWS = ["linear layers", "attention", "norms/RoPE/activations", "other (python/dispatch)", "sampling",
        "building inputs", "scheduling", "detokenization", "IPC"]


@pytest.fixture
def profiled_llm(llm, monkeypatch):
    """conftest's shared LLM, for main() to build through tokenmill.LLM (one model load for every mode); the
    methods that bench step wraps in its timers are put back after the test, for the LLM's other users."""
    runner = llm.engine.runner
    model = getattr(runner, "model", None)
    for target, name in ((runner, "execute"), (runner, "sampler"), (model, "forward"), (model, "compute_logits")):
        if hasattr(target, name):
            monkeypatch.setattr(target, name, getattr(target, name))
    monkeypatch.setattr(tokenmill, "LLM", lambda **kwargs: llm)
    return llm


@pytest.mark.slow  # loads the real model (~9 s on 2 cores) and profiles it
@pytest.mark.parametrize("mode", ["decode", "mixed", "prefill"])
def test_bench_step_breakdown_adds_up(profiled_llm, mode, tmp_path, capsys):
    out = tmp_path / "step.json"
    assert main(["bench", "step", "--batch-size", "2", "--input-len", "16", "--output-len", "4", "--num-steps", "2",
                 "--dtype", "float32", "--threads", "1", "--mode", mode, "--output-json", str(out)]) == 0
    assert "total step" in capsys.readouterr().out
    result = json.loads(out.read_text())
    rows = result["ms_per_step"]
    assert list(rows) == ROWS
    assert all(v >= 0 for v in rows.values()), rows
    assert sum(rows.values()) == pytest.approx(result["total_step_ms"], rel=0.05)
    assert result["total_step_ms"] > 0 and result["tokens_per_step"] > 0
    assert rows["linear layers"] > 0 and rows["sampling"] > 0
    assert set(result["machine"]["flags"]) == {"avx2", "avx512f", "avx512_bf16", "amx_bf16"}
    assert result["machine"]["torch_threads"] == 1


def event(name, parent=None, annotation=False):
    return SimpleNamespace(name=name, cpu_parent=parent, is_user_annotation=annotation)


def test_ops_count_in_the_category_of_their_outermost_op():
    model, sampler = event(REGION + "model", annotation=True), event(REGION + "sampler", annotation=True)
    embedding = event("aten::embedding", model)
    assert _categories(embedding) == ("norms/RoPE/activations", "op:aten::embedding")
    assert _categories(event("aten::index_select", embedding)) == ()  # counted with the embedding
    assert _categories(event("aten::index_select", model))[0] == "attention"
    assert _categories(event("tokenmill::paged_attention", model))[0] == "attention"
    assert _categories(event("tokenmill::rope_and_cache", event("inner", model, annotation=True)))[0] == "attention"
    assert _categories(event("tokenmill_avx512::paged_attention", model)) == ("attention",
                                                                             "op:tokenmill_avx512::paged_attention")
    assert _categories(event("tokenmill::fused_add_rms_norm", model))[0] == "norms/RoPE/activations"
    assert _categories(event("mkldnn::_linear_pointwise", model))[0] == "linear layers"
    assert _categories(event("aten::view", model)) == ()  # dispatch: left to "other"
    assert _categories(event("aten::mm")) == ()  # outside the model
    assert _categories(event("tokenmill::argmax", sampler)) == ()  # inside the sampler's wall time already
    assert _categories(event("tokenmill::argmax")) == ("argmax",)
    assert _categories(event("tokenmill_avx2::argmax")) == ("argmax",)
