"""BERT encoders (BertModel) over a flat batch of whole sequences.

An encoder attends both ways over its whole input, so it has no KV cache and no decode: a sequence is computed in
one step, and the step's sequences are packed end to end. The linear layers see the packed [num_tokens, hidden]
rows (no padding to compute); only attention pads, to run torch's SDPA (is_causal=False) on a [batch, heads,
longest, head_dim] view with a key mask, which is what a varlen kernel would do without the padded FLOPs. q/k/v
are fused into one matmul at load time, as in llama.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.models.linear import Linear


class BertLayer(nn.Module):
    def __init__(self, config):
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_attention_heads
        self.head_dim = h // self.num_heads
        self.qkv = Linear(h, 3 * h)
        self.attn_out = Linear(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.intermediate = Linear(h, config.intermediate_size)
        self.out = Linear(config.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        # HF's "gelu" is the exact (erf) one; "gelu_new"/"gelu_pytorch_tanh" the tanh approximation
        self.approximate = "none" if config.hidden_act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor, pad_index: torch.Tensor, key_mask: torch.Tensor | None,
                valid: torch.Tensor) -> torch.Tensor:
        t, h = x.shape
        b, length = pad_index.shape
        qkv = self.qkv(x)
        # padded rows read a zero row appended after the last token
        qkv = torch.cat([qkv, qkv.new_zeros(1, 3 * h)])[pad_index]  # [b, length, 3h]
        q, k, v = qkv.view(b, length, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, is_causal=False)
        attn = attn.transpose(1, 2).reshape(b * length, h)[valid]  # back to the packed rows
        x = self.attn_norm(self.attn_out(attn) + x)
        return self.out_norm(self.out(F.gelu(self.intermediate(x), approximate=self.approximate)) + x)


class BertModel(nn.Module):
    is_encoder = True
    # HF checkpoint names of the projections we fuse: name → shard index in `qkv`
    QKV = {"query": 0, "key": 1, "value": 2}

    def __init__(self, config, max_positions: int):
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.word_embeddings = nn.Embedding(config.vocab_size, h)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(max(1, getattr(config, "type_vocab_size", 1)), h)
        self.embed_norm = nn.LayerNorm(h, eps=config.layer_norm_eps)
        self.layers = nn.ModuleList(BertLayer(config) for _ in range(config.num_hidden_layers))
        self.prefix = "bert."  # checkpoints saved from a task model name the encoder bert.
        self.num_kv_heads, self.head_dim = config.num_attention_heads, h // config.num_attention_heads

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def pack_weights(self) -> None:
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()

    def use_cpu_kernels(self, ops) -> None:
        """tokenmill's CPU kernels are decoder kernels (paged attention, RMSNorm): nothing here uses them."""

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, seq_lens: list[int]) -> torch.Tensor:
        """input_ids, positions: [num_tokens], the sequences end to end; returns the last layer's [num_tokens,
        hidden] states."""
        x = (self.word_embeddings(input_ids) + self.position_embeddings(positions)
             + self.token_type_embeddings.weight[0])
        x = self.embed_norm(x)
        pad_index, key_mask, valid = self._padding(seq_lens, x.device)
        for layer in self.layers:
            x = layer(x, pad_index, key_mask, valid)
        return x

    @staticmethod
    def _padding(seq_lens: list[int], device) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
        """pad_index [b, longest]: the packed row of each padded slot (num_tokens for padding); key_mask: True where
        a key is real, None when no sequence is padded; valid: the padded slots that hold a token, in packed order."""
        lens = torch.tensor(seq_lens, device=device)
        longest, total = max(seq_lens), sum(seq_lens)
        starts = torch.cumsum(lens, 0) - lens
        col = torch.arange(longest, device=device)
        real = col[None, :] < lens[:, None]
        pad_index = torch.where(real, starts[:, None] + col[None, :], total)
        key_mask = None if min(seq_lens) == longest else real[:, None, None, :]
        return pad_index, key_mask, real.reshape(-1)

    def load_weights(self, weights) -> set[str]:
        """weights: iterable of (HF checkpoint name, tensor). Returns the parameter names that were filled."""
        params = dict(self.named_parameters())
        loaded = set()
        h = self.config.hidden_size
        for name, tensor in weights:
            if name.startswith(self.prefix):
                name = name[len(self.prefix):]
            if name.startswith(("pooler.", "cls.", "lm_head.")) or name.endswith("position_ids"):
                continue  # BERT's NSP pooler and task heads: sentence embeddings do not use them
            target, shard = self._target(name)
            if target is None:
                raise ValueError(f"unexpected tensor in checkpoint: {name}")
            param = params[target]
            with torch.no_grad():
                (param if shard is None else param[shard * h:(shard + 1) * h]).copy_(tensor)
            loaded.add(target if shard is None else f"{target}#{shard}")
        return {n.split("#")[0] for n in loaded if "#" not in n or all(
            f"{n.split('#')[0]}#{i}" in loaded for i in range(3))}

    @classmethod
    def _target(cls, name: str) -> tuple[str | None, int | None]:
        if name.startswith("embeddings."):
            rest = name[len("embeddings."):]
            return ("embed_norm." + rest.split(".", 1)[1] if rest.startswith("LayerNorm.") else rest), None
        parts = name.split(".")  # encoder.layer.{i}.<module path>.{weight|bias}
        if parts[:2] != ["encoder", "layer"]:
            return None, None
        i, path, kind = parts[2], ".".join(parts[3:-1]), parts[-1]
        if path.startswith("attention.self."):
            return f"layers.{i}.qkv.{kind}", cls.QKV[path.rsplit(".", 1)[1]]
        local = {"attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
                 "intermediate.dense": "intermediate", "output.dense": "out", "output.LayerNorm": "out_norm"}
        return (f"layers.{i}.{local[path]}.{kind}", None) if path in local else (None, None)

    def expected_weights(self) -> set[str]:
        return set(dict(self.named_parameters()))
