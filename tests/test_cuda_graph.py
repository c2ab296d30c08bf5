"""CUDA graphs for decode (tokenmill/engine/cuda_graph.py): the host-side bookkeeping on the CPU, with a stand-in
graph that re-runs the captured function on the persistent buffers, as a replay re-runs the kernels on the
captured addresses; the real capture under the `cuda` marker."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from tokenmill.config import EngineConfig
from tokenmill.engine.cuda_graph import DecodeCUDAGraphs, DecodeInputBuffers, capture_sizes, padded_size
from tokenmill.models.attention import AttentionMetadata, TorchSDPABackend
from tokenmill.models.llama import Attention, RotaryEmbedding

BLOCK, NUM_BLOCKS, MAX_BLOCKS = 4, 24, 6


def test_capture_sizes_follow_vllm_rule():
    assert capture_sizes([512], 1024) == [1, 2, 4] + list(range(8, 513, 8))
    assert capture_sizes([512], 64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]  # none above --max-num-seqs
    assert capture_sizes([4], 256) == [1, 2, 4]
    assert capture_sizes([64, 1, 8, 8], 32) == [1, 8]  # several values: those, sorted, deduplicated
    assert capture_sizes([512], 256)[-1] == 256 and capture_sizes([2], 256) == [1, 2]
    with pytest.raises(ValueError):
        capture_sizes([0, 4], 8)


def test_padding_to_next_captured_size():
    sizes = [1, 2, 4, 8, 16]
    assert [padded_size(n, sizes) for n in (1, 2, 3, 4, 5, 9, 16)] == [1, 2, 4, 4, 8, 16, 16]
    assert padded_size(17, sizes) is None  # larger than the largest: eager


def test_flags_come_from_the_config():
    assert EngineConfig().cuda_graph_sizes == [512] and EngineConfig().enforce_eager is False
    import argparse
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    args = parser.parse_args(["--cuda-graph-sizes", "1", "2", "8", "--enforce-eager"])
    config = EngineConfig.from_cli_args(args)
    assert config.cuda_graph_sizes == [1, 2, 8] and config.enforce_eager


class OneLayer(torch.nn.Module):
    """Embedding, then one real attention layer over the paged cache: enough to see every input buffer read."""

    def __init__(self):
        super().__init__()
        config = LlamaConfig(vocab_size=50, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                             head_dim=8, intermediate_size=64)
        torch.manual_seed(0)
        self.embed = torch.nn.Embedding(50, 32)
        self.attn = Attention(config, qkv_bias=False, o_bias=False, qk_norm=False)
        self.rope = RotaryEmbedding(config, 64)

    def forward(self, input_ids, kv_caches, meta, backend):
        meta.rope = self.rope
        return self.attn(self.embed(input_ids), kv_caches[0], meta, backend)


class StandInGraph:
    """capture(fn) runs fn once and keeps its output tensor; replay() runs fn again into that same tensor."""
    captured = []

    def capture(self, fn):
        self.fn, self.out = fn, fn()
        StandInGraph.captured.append(self.out.shape[0])
        return self.out

    def replay(self):
        self.out.copy_(self.fn())


def decode_step(n: int, seed: int) -> tuple[torch.Tensor, AttentionMetadata]:
    """n decodes with random lengths and scattered blocks, as the runner's _metadata builds them."""
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, MAX_BLOCKS * BLOCK, (n,), generator=g)
    width = int(-(-lens.max() // BLOCK))
    tables = torch.stack([torch.randperm(NUM_BLOCKS, generator=g)[:width] for _ in range(n)]).int()
    positions = lens - 1
    slots = tables[torch.arange(n), positions // BLOCK].long() * BLOCK + positions % BLOCK
    meta = AttentionMetadata(positions, slots, torch.arange(n + 1, dtype=torch.int32), lens.int(), tables,
                             num_decodes=n, query_lens=[1] * n, context_lens=lens.tolist())
    return torch.randint(0, 50, (n,), generator=g), meta


def new_cache() -> list[tuple]:
    g = torch.Generator().manual_seed(7)
    shape = (NUM_BLOCKS + 1, BLOCK, 2, 8)  # one scratch block past the scheduler's
    return [(torch.randn(shape, generator=g), torch.randn(shape, generator=g), torch.ones(2, 2, 8))]


@torch.inference_mode()
def test_replay_reads_each_steps_inputs_and_pads_into_the_scratch_block():
    model, backend = OneLayer(), TorchSDPABackend()
    graph_cache, eager_cache = new_cache(), new_cache()
    buffers = DecodeInputBuffers(8, MAX_BLOCKS, BLOCK, NUM_BLOCKS, torch.device("cpu"))
    addresses = [t.data_ptr() for t in (buffers.input_ids, buffers.positions, buffers.slot_mapping,
                                        buffers.seq_lens, buffers.block_tables)]
    StandInGraph.captured = []
    graphs = DecodeCUDAGraphs(model, graph_cache, backend, [1, 2, 4, 8], buffers, make_graph=StandInGraph)
    graphs.capture()
    assert StandInGraph.captured == [8, 4, 2, 1]  # largest first: the smaller ones fit in its memory pool
    scratch_before = graph_cache[0][0][NUM_BLOCKS].clone()
    for step, n in enumerate((3, 1, 8, 5, 2)):
        input_ids, meta = decode_step(n, step)
        got = graphs.run(input_ids, meta)
        want = model(input_ids, eager_cache, decode_step(n, step)[1], backend)
        assert got.shape[0] == n
        torch.testing.assert_close(got, want)
        # the real blocks hold what eager writes; padding rows wrote only the scratch block
        torch.testing.assert_close(graph_cache[0][0][:NUM_BLOCKS], eager_cache[0][0][:NUM_BLOCKS])
        torch.testing.assert_close(graph_cache[0][1][:NUM_BLOCKS], eager_cache[0][1][:NUM_BLOCKS])
        if n in (3, 5):  # padded to 4 and 8
            assert buffers.seq_lens[n:padded_size(n, graphs.sizes)].eq(1).all()
            assert buffers.slot_mapping[n:padded_size(n, graphs.sizes)].eq(NUM_BLOCKS * BLOCK).all()
    assert not torch.equal(graph_cache[0][0][NUM_BLOCKS], scratch_before)
    # the buffers were reused, never reallocated
    assert addresses == [t.data_ptr() for t in (buffers.input_ids, buffers.positions, buffers.slot_mapping,
                                                buffers.seq_lens, buffers.block_tables)]
    assert graphs.run(*decode_step(9, 99)) is None  # above the largest captured size: the runner runs it eagerly


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@torch.inference_mode()
def test_captured_decode_graph_equals_eager_on_cuda():
    """The real thing: torch.cuda.CUDAGraph over the triton backend's decode kernels."""
    from tokenmill.models.attention import TritonBackend
    dev = torch.device("cuda")
    model, backend = OneLayer().to(dev), TritonBackend()
    graph_cache = [tuple(t.to(dev) for t in c) for c in new_cache()]
    eager_cache = [tuple(t.to(dev) for t in c) for c in new_cache()]
    buffers = DecodeInputBuffers(8, MAX_BLOCKS, BLOCK, NUM_BLOCKS, dev)
    graphs = DecodeCUDAGraphs(model, graph_cache, backend, [1, 2, 4, 8], buffers)
    graphs.capture()
    for step, n in enumerate((3, 1, 8, 5)):
        input_ids, meta = decode_step(n, step)
        to = lambda m: AttentionMetadata(m.positions.to(dev), m.slot_mapping.to(dev),  # noqa: E731
                                         m.query_start_loc.to(dev), m.seq_lens.to(dev), m.block_tables.to(dev),
                                         m.num_decodes, m.query_lens, m.context_lens)
        got = graphs.run(input_ids.to(dev), to(meta)).clone()
        want = model(input_ids.to(dev), eager_cache, to(decode_step(n, step)[1]), backend)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
