"""The pooling endpoints on a real `tokenmill serve` of all-MiniLM-L6-v2 (--runner auto → pooling): /v1/embeddings
(through the OpenAI client too), /pooling, /v1/score, /v1/rerank, and their 400s, and every pooling route through
`tokenmill router`; and the other runner's 400 both ways (completions on a pooling server here, embeddings on a generate server in test_api_in_process-style below)."""
from __future__ import annotations

import array
import base64

import httpx
import pytest
import torch
import torch.nn.functional as F
from helpers import API_KEY, RemoteServer, RouterProcess, minilm_path

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def embedding_server():
    s = RemoteServer(["--api-key", API_KEY], model=minilm_path(),
                     server_args=["--uvicorn-log-level", "warning", "--dtype", "float32"])
    yield s
    s.stop()


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(minilm_path(), device="cpu")


def _post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url_for(path), json=body, headers=server.headers(), timeout=120)


def _error(r: httpx.Response, param: str | None = None) -> str:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    if param is not None:
        assert error["param"] == param, error
    return error["message"]


def test_embeddings_match_the_reference_in_every_input_form(embedding_server, reference):
    texts = ["A sentence to embed.", "Une autre phrase, en français 🎉"]
    ref = reference.encode(texts, convert_to_tensor=True)
    out = embedding_server.openai().embeddings.create(model=minilm_path(), input=texts)
    assert [d.index for d in out.data] == [0, 1] and out.usage.prompt_tokens == out.usage.total_tokens > 0
    got = torch.tensor([d.embedding for d in out.data])
    assert F.cosine_similarity(got, ref, dim=-1).min() >= 0.9999
    single = _post(embedding_server, "/v1/embeddings", {"input": texts[0]}).json()
    assert single["object"] == "list" and single["data"][0]["object"] == "embedding"
    assert torch.allclose(torch.tensor(single["data"][0]["embedding"]), got[0], atol=1e-6)
    ids = reference.tokenizer(texts)["input_ids"]
    by_ids = _post(embedding_server, "/v1/embeddings", {"input": ids}).json()
    assert torch.allclose(torch.tensor([d["embedding"] for d in by_ids["data"]]), got, atol=1e-6)
    b64 = _post(embedding_server, "/v1/embeddings", {"input": ids[1], "encoding_format": "base64"}).json()
    decoded = array.array("f", base64.b64decode(b64["data"][0]["embedding"]))
    assert torch.allclose(torch.tensor(decoded.tolist()), got[1], atol=1e-6)
    pooled = _post(embedding_server, "/pooling", {"input": texts[0]}).json()
    assert pooled["data"][0]["object"] == "pooling" and len(pooled["data"][0]["data"]) == 384


def test_score_and_rerank(embedding_server, reference):
    query, docs = "What is the capital of France?", ["Berlin is in Germany.", "Paris is the capital of France.",
                                                    "Cats sleep a lot."]
    ref = F.cosine_similarity(reference.encode(query, convert_to_tensor=True)[None],
                              reference.encode(docs, convert_to_tensor=True), dim=-1).tolist()
    score = _post(embedding_server, "/v1/score", {"text_1": query, "text_2": docs}).json()
    assert [d["index"] for d in score["data"]] == [0, 1, 2]
    assert max(abs(d["score"] - r) for d, r in zip(score["data"], ref)) < 1e-4
    rerank = _post(embedding_server, "/v1/rerank", {"query": query, "documents": docs, "top_n": 2}).json()
    order = sorted(range(3), key=lambda i: -ref[i])[:2]
    assert [r["index"] for r in rerank["results"]] == order
    assert rerank["results"][0]["document"] == {"text": docs[order[0]]} and rerank["usage"]["total_tokens"] > 0
    pairwise = _post(embedding_server, "/score", {"text_1": [query, query], "text_2": docs[:2]}).json()
    assert [round(d["score"], 5) for d in pairwise["data"]] == [round(s, 5) for s in ref[:2]]


def _rounded(answer):
    """An answer without its id and time, its floats to 4 places (two runs of one input may differ in the last)."""
    if isinstance(answer, dict):
        return {k: _rounded(v) for k, v in answer.items() if k not in ("id", "created")}
    if isinstance(answer, list):
        return [_rounded(v) for v in answer]
    return round(answer, 4) if isinstance(answer, float) else answer


def test_every_pooling_route_through_the_router(embedding_server):
    """The router forwards each pooling route (the client's API key passed on) and answers as the replica does."""
    router = RouterProcess(["--backend", embedding_server.url, "--model", minilm_path(), "--policy", "least_load"])
    query, docs = "What is the capital of France?", ["Paris is the capital of France.", "Cats sleep a lot."]
    try:
        for path, body in [("/v1/embeddings", {"input": [query, docs[0]]}), ("/pooling", {"input": query}),
                           ("/score", {"text_1": query, "text_2": docs}),
                           ("/v1/score", {"text_1": query, "text_2": docs}),
                           ("/rerank", {"query": query, "documents": docs}),
                           ("/v1/rerank", {"query": query, "documents": docs}),
                           ("/v2/rerank", {"query": query, "documents": docs}), ("/invocations", {"input": query}),
                           ("/tokenize", {"prompt": query})]:
            via = httpx.post(router.url + path, json=body, headers=embedding_server.headers(), timeout=120)
            direct = _post(embedding_server, path, body)
            assert via.status_code == direct.status_code == 200, (path, via.text)
            assert via.headers["x-tokenmill-replica"] == embedding_server.url
            assert _rounded(via.json()) == _rounded(direct.json()), path
        models = httpx.get(router.url + "/v1/models", headers=embedding_server.headers(), timeout=10)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == minilm_path()
        assert httpx.get(router.url + "/v1/models", timeout=10).status_code == 401  # the replica's answer
    finally:
        router.stop()


def test_bad_pooling_requests(embedding_server):
    assert "empty" in _error(_post(embedding_server, "/v1/embeddings", {"input": []}), "input")
    msg = _error(_post(embedding_server, "/v1/embeddings", {"input": [[101] + [1037] * 300 + [102]]}), "input")
    assert "256" in msg and "302" in msg
    ok = _post(embedding_server, "/v1/embeddings", {"input": "word " * 400, "truncate_prompt_tokens": 100})
    assert ok.status_code == 200 and ok.json()["usage"]["prompt_tokens"] == 100
    assert "matryoshka" in _error(_post(embedding_server, "/v1/embeddings", {"input": "x", "dimensions": 8}),
                                  "dimensions")
    assert "--runner generate" in _error(_post(embedding_server, "/v1/completions", {"prompt": "Hi"}))
    assert "--runner generate" in _error(_post(embedding_server, "/v1/chat/completions",
                                               {"messages": [{"role": "user", "content": "Hi"}]}))


def test_embeddings_on_a_generate_server_say_which_runner(server):
    for path, body in (("/v1/embeddings", {"input": "Hi"}), ("/v1/score", {"text_1": "a", "text_2": "b"}),
                       ("/v1/rerank", {"query": "a", "documents": ["b"]}), ("/pooling", {"input": "Hi"})):
        assert "--runner pooling" in _error(_post(server, path, body), "model")
