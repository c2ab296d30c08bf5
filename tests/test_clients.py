"""`tokenmill chat` and `tokenmill complete` (vLLM's terminal clients) against a fake replica that records what it
receives (tests/fake_replica.py): the model found in /v1/models, the conversation carried from turn to turn, the
streamed answer printed whole, a refusal reported; and `tokenmill bench latency` on the tiny model."""
from __future__ import annotations

import asyncio
import json

import pytest
from fake_replica import ANSWER, MODEL, FakeReplica

from tokenmill import cli

pytestmark = pytest.mark.anyio


async def run(argv: list[str]) -> int:
    return await asyncio.to_thread(cli.main, argv)  # the fake replica serves on this loop meanwhile


async def test_chat_quick_sends_the_system_prompt_and_prints_the_answer(tokenizer, capsys):
    replica = await FakeReplica(tokenizer).start()
    try:
        rc = await run(["chat", "--url", replica.url + "/v1", "--system-prompt", "Be brief.", "-q", "Hi there",
                        "--api-key", "k"])
    finally:
        await replica.stop()
    assert rc == 0
    [call] = replica.posts("/v1/chat/completions")
    assert call.body["model"] == MODEL and call.body["stream"] is True  # the first model the server lists
    assert call.body["messages"] == [{"role": "system", "content": "Be brief."},
                                     {"role": "user", "content": "Hi there"}]
    assert call.headers["authorization"] == "Bearer k"
    printed = capsys.readouterr().out
    assert printed == tokenizer.decode(replica.answer_ids[:16]) + "\n"
    assert ANSWER.startswith(printed.rstrip("\n"))


async def test_chat_carries_the_conversation(tokenizer, capsys, monkeypatch):
    lines = iter(["First question", "Second question"])

    def fake_input(prompt):
        try:
            return next(lines)
        except StopIteration:
            raise EOFError from None
    monkeypatch.setattr("builtins.input", fake_input)
    replica = await FakeReplica(tokenizer).start()
    try:
        assert await run(["chat", "--url", replica.url + "/v1", "--model-name", "mine"]) == 0
    finally:
        await replica.stop()
    first, second = replica.posts("/v1/chat/completions")
    answer = tokenizer.decode(replica.answer_ids[:16])
    assert second.body["model"] == "mine" and second.body["messages"] == [
        {"role": "user", "content": "First question"}, {"role": "assistant", "content": answer},
        {"role": "user", "content": "Second question"}]


async def test_complete_and_a_refusal(tokenizer, capsys):
    replica = await FakeReplica(tokenizer).start()
    try:
        assert await run(["complete", "--url", replica.url + "/v1", "--max-tokens", "5", "-q", "Once"]) == 0
        [call] = replica.posts("/v1/completions")
        assert (call.body["prompt"], call.body["max_tokens"]) == ("Once", 5)
        assert capsys.readouterr().out == tokenizer.decode(replica.answer_ids[:5]) + "\n"
        replica.status = 500
        assert await run(["complete", "--url", replica.url + "/v1", "-q", "Once"]) == 1
        assert "error: 500: broken" in capsys.readouterr().err
    finally:
        await replica.stop()


def test_bench_latency(tiny_llama_dir, tmp_path, capsys):
    out = tmp_path / "latency.json"
    assert cli.main(["bench", "latency", tiny_llama_dir, "--dtype", "float32", "--max-model-len", "128",
                     "--kv-cache-memory", "16MiB", "--input-len", "8", "--output-len", "4", "--batch-size", "2",
                     "--n", "2", "--num-iters-warmup", "1", "--num-iters", "3", "--output-json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert len(result["latencies"]) == 3 and result["avg_latency"] == pytest.approx(sum(result["latencies"]) / 3)
    assert list(result["percentiles"]) == ["10", "25", "50", "75", "90", "99"]
    assert min(result["latencies"]) <= result["percentiles"]["50"] <= max(result["latencies"])
    assert f"Avg latency: {result['avg_latency']:.4f} seconds" in capsys.readouterr().out
