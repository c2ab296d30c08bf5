"""The Llama family (Llama, SmolLM2, Mistral, Qwen2, Qwen3) over a flat token batch and a paged KV cache.

Every linear layer sees [num_tokens, hidden]; only attention knows where one sequence ends. q/k/v and
gate/up are fused at load time: fewer, larger matmuls matter on CPU. The residual stream is carried beside
the hidden state (vLLM's layout), so that on the CPU the residual add and the next RMSNorm are one kernel;
`use_cpu_kernels` switches the norms and the activation to tokenmill's kernels, with the torch code as the
reference and fallback."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from tokenmill.models.attention import AttentionMetadata
from tokenmill.models.linear import SMALL_M_MAX_ROWS, Linear, linear, one_layout, pack_small_m, pack_weight
from tokenmill.models.quantization import QuantizedEmbedding, QuantizedTensor, QuantizedWeight, quant_linear


class RMSNorm(nn.Module):
    ops = None  # tokenmill's CPU kernels, when the model runs on them

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """norm(x); with a residual: residual += x, then (norm(residual), residual)."""
        if self.ops is not None and x.dim() == 2:
            if residual is None:
                out = torch.empty_like(x)
                self.ops.rms_norm(out, x, self.weight, self.eps)
                return out
            self.ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
            return x, residual
        if residual is not None:
            residual = x + residual
            return self._norm(residual), residual
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # In float32, as the reference implementation does; bf16 variance loses too much.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


def rope_inv_freq(config) -> tuple[torch.Tensor, float]:
    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        base = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim)), 1.0
    return ROPE_INIT_FUNCTIONS[rope_type](config)


# HF's layer_types: a layer attends within its sliding window, or to every key
SLIDING, FULL = "sliding_attention", "full_attention"

# rope types whose HF tables change with the sequence length: up to this length (a config field) they are the
# static tables rope_inv_freq computes; beyond it HF recomputes them per forward pass
LENGTH_DEPENDENT_ROPE = {"dynamic": "max_position_embeddings", "longrope": "original_max_position_embeddings"}


def check_config(config, max_positions: int, arch: str) -> None:
    """Refuses, naming the field, what changes the math of the Llama family and is not implemented here, rather
    than serving a different model. Read elsewhere: head_dim, attention_bias (registry.py), tie_word_embeddings,
    sliding_window / layer_types (layer_windows), rope_parameters (rope_inv_freq)."""
    def refuse(field: str, why: str):
        raise ValueError(f"{arch}: config field {field} {why}; tokenmill does not implement it")

    if getattr(config, "hidden_act", "silu") != "silu":
        refuse("hidden_act", f"is {config.hidden_act!r} (only 'silu' is implemented for this architecture)")
    if getattr(config, "mlp_bias", False):
        refuse("mlp_bias", "is true (MLP projections with biases)")
    params = getattr(config, "rope_parameters", None) or {}
    if any(isinstance(v, dict) for v in params.values()):
        refuse("rope_parameters", "gives per-layer-type RoPE parameters")
    rope_type = params.get("rope_type", "default")
    if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
        refuse("rope_parameters.rope_type", f"is {rope_type!r} (known: default, {', '.join(ROPE_INIT_FUNCTIONS)})")
    if params.get("partial_rotary_factor", getattr(config, "partial_rotary_factor", 1.0)) not in (None, 1, 1.0):
        refuse("partial_rotary_factor", "rotates only part of each head")
    limit_field = LENGTH_DEPENDENT_ROPE.get(rope_type)
    if limit_field:
        limit = params.get(limit_field) or getattr(config, limit_field, None)
        if limit is not None and max_positions > limit:
            raise ValueError(f"{arch}: rope_parameters.rope_type {rope_type!r} changes its tables beyond {limit_field}"
                             f"={limit} tokens, which tokenmill does not implement; serve with --max-model-len "
                             f"{limit} or less (asked for {max_positions})")
    kinds = set(getattr(config, "layer_types", None) or ()) - {FULL, SLIDING}
    if kinds:
        refuse("layer_types", f"names {sorted(kinds)}")


def layer_windows(config, every_layer: bool) -> list[int | None]:
    """Each layer's sliding window (None: full attention), as HF applies it. every_layer (Mistral): the window
    holds on every layer. Otherwise (Qwen2, Qwen3) on the layers `layer_types` marks sliding: HF derives those from
    use_sliding_window and max_window_layers, and sets sliding_window to None when use_sliding_window is off."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return [None] * config.num_hidden_layers
    if every_layer:
        return [window] * config.num_hidden_layers
    types = getattr(config, "layer_types", None) or [FULL] * config.num_hidden_layers
    return [window if t == SLIDING else None for t in types]


class RotaryEmbedding(nn.Module):
    def __init__(self, config, max_positions: int):
        super().__init__()
        # Computed on the CPU even inside the loader's meta-device context: ops on meta tensors run torch's
        # Python decompositions, whose first use imports torch._dynamo and Triton (a second of start-up).
        with torch.device("cpu"):
            inv_freq, scaling = rope_inv_freq(config)
            freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq)
            emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype).unsqueeze(1), self.sin[positions].to(dtype).unsqueeze(1)


class Attention(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool, sliding_window: int | None = None):
        super().__init__()
        self.sliding_window = sliding_window  # keys p - W + 1..p only (attention.py); None: all
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = getattr(config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.qkv_proj = Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=qkv_bias)
        self.o_proj = Linear(self.q_size, config.hidden_size, bias=o_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps) if qk_norm else None

    def forward(self, x, kv_cache, meta: AttentionMetadata, backend, rope=None) -> torch.Tensor:
        """rope: this layer's RotaryEmbedding where layers differ (Gemma 3); None: the model's (meta.rope)."""
        # norms, RoPE, cache write, attention
        out = backend.forward(self, self.qkv_proj(x), kv_cache, meta, sliding_window=self.sliding_window,
                              rope=rope)
        return self.o_proj(out.view(-1, self.q_size))


class MLP(nn.Module):
    ops = None  # tokenmill's CPU kernels, when the model runs on them

    def __init__(self, config):
        super().__init__()
        self.intermediate = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * self.intermediate, bias=False)
        self.down_proj = Linear(self.intermediate, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if self.ops is not None:
            act = torch.empty(x.shape[0], self.intermediate, dtype=x.dtype)
            self.ops.silu_and_mul(act, gate_up)
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act)


class DecoderLayer(nn.Module):
    def __init__(self, config, qkv_bias: bool, o_bias: bool, qk_norm: bool, sliding_window: int | None = None):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, qkv_bias, o_bias, qk_norm, sliding_window)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, residual, kv_cache, meta, backend):
        """Returns (this layer's MLP output, the residual stream before it); the next norm adds them."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, kv_cache, meta, backend)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def _or(tensor: torch.Tensor | None, default: torch.Tensor) -> torch.Tensor:
    return default if tensor is None else tensor


class LlamaForCausalLM(nn.Module):
    # HF checkpoint names of the projections we fuse: name → (fused name, shard index)
    FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
             "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, config, max_positions: int, qkv_bias: bool = False, o_bias: bool = False,
                 qk_norm: bool = False, sliding_windows: list[int | None] | None = None):
        """sliding_windows: each layer's window (layer_windows; None: full attention everywhere)."""
        super().__init__()
        check_config(config, max_positions, (getattr(config, "architectures", None) or [type(self).__name__])[0])
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        windows = sliding_windows or [None] * config.num_hidden_layers
        self.layers = nn.ModuleList(DecoderLayer(config, qkv_bias, o_bias, qk_norm, w) for w in windows)
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_positions)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else Linear(config.hidden_size, config.vocab_size,
                                                                        bias=False)
        self.tied_lm_head_packed = None
        self.kernel_ops, self.tied_lm_head_small_m = None, None  # set by use_cpu_kernels
        self.fused_ops, self.fused_weights = None, None
        self.lora = None  # the LoRABatch with --enable-lora (tokenmill/lora/): this step's adapters, if any
        attn = self.layers[0].self_attn
        self.num_kv_heads, self.head_dim = attn.num_kv_heads, attn.head_dim

    def pack_weights(self) -> None:
        """Lays the linear weights out for oneDNN; on devices or dtypes it cannot serve, nothing changes."""
        for module in self.modules():
            if isinstance(module, Linear):
                module.pack()
        if isinstance(self.embed_tokens, QuantizedEmbedding):  # lookups dequantize rows to the serving dtype
            self.embed_tokens.dtype = self.norm.weight.dtype
        elif self.lm_head is None:  # the embedding keeps its dense weight for the lookup
            self.tied_lm_head_packed = pack_weight(self.embed_tokens.weight)

    def use_cpu_kernels(self, ops) -> None:
        """Norms and the MLP activation on tokenmill's CPU kernels (None: back to torch ops). Where every linear
        weight is prepacked for oneDNN, the whole decoder stack runs as one kernel call (llama_forward)."""
        for module in self.modules():
            if isinstance(module, (RMSNorm, MLP)):
                module.ops = ops
            elif isinstance(module, Linear):
                module.use_cpu_kernels(ops)
        self.kernel_ops, self.tied_lm_head_small_m = ops, None
        tied = self.lm_head is None and not isinstance(self.embed_tokens, QuantizedEmbedding)
        if tied:
            self.tied_lm_head_small_m = pack_small_m(ops, self.embed_tokens.weight, None)
            # the embedding keeps its dense weight for lookups; the oneDNN copy goes where the small-M one serves
            single = ops is not None and one_layout(ops, self.tied_lm_head_small_m, self.config.hidden_size)
            if single:
                self.tied_lm_head_packed = None
            elif self.tied_lm_head_packed is None:
                self.tied_lm_head_packed = pack_weight(self.embed_tokens.weight)
        self.fused_ops, self.fused_weights = None, None
        linears = [m for m in self.modules() if isinstance(m, Linear)]
        if ops is None or not linears or any(m.packed is None and m.quant is None and not m.single_copy
                                             for m in linears):
            return
        if any(layer.self_attn.sliding_window for layer in self.layers):
            return  # llama_forward attends over every key: windowed layers run one by one (as Gemma 3's)
        none = torch.empty(0, dtype=self.norm.weight.dtype)
        weights = []
        for layer in self.layers:  # a quantized linear passes (qweight, meta) for (oneDNN layout, small-M layout)
            attn = layer.self_attn
            (qkv, qkv_small), (o, o_small) = attn.qkv_proj.fused_weights(), attn.o_proj.fused_weights()
            (gate_up, gate_up_small), (down, down_small) = (layer.mlp.gate_up_proj.fused_weights(),
                                                            layer.mlp.down_proj.fused_weights())
            weights += [layer.input_layernorm.weight, _or(qkv, none), _or(attn.qkv_proj.bias, none),
                        _or(attn.q_norm and attn.q_norm.weight, none), _or(attn.k_norm and attn.k_norm.weight, none),
                        _or(o, none), _or(attn.o_proj.bias, none), layer.post_attention_layernorm.weight,
                        _or(gate_up, none), _or(down, none)]
            weights += [_or(m, none) for m in (qkv_small, o_small, gate_up_small, down_small)]
        self.fused_ops, self.fused_weights = ops, [w.detach() for w in weights]

    def forward(self, input_ids: torch.Tensor, kv_caches: list[tuple], meta: AttentionMetadata,
                backend) -> torch.Tensor:
        meta.rope = self.rotary
        # fused: set only when the runner chose the CPU kernels (use_cpu_kernels); not while the backend
        # calibrates the KV scales (kv_quant.py), which happens layer by layer
        if self.fused_ops is not None and not backend.calibrating:
            attn = self.layers[0].self_attn
            lora = self.lora.fused_args() if self.lora is not None and self.lora.active else ([], [], None)
            return self.fused_ops.llama_forward(
                self.embed_tokens(input_ids), self.fused_weights, self.norm.weight, [c[0] for c in kv_caches],
                [c[1] for c in kv_caches], meta.positions, self.rotary.cos, self.rotary.sin, meta.slot_mapping,
                meta.block_tables, meta.seq_lens, meta.query_start_loc, attn.num_heads, attn.head_dim,
                self.layers[0].mlp.intermediate, self.norm.eps, attn.scale, SMALL_M_MAX_ROWS,
                [c[2] for c in kv_caches], *lora)
        x, residual = self.embed_tokens(input_ids), None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, kv_cache, meta, backend)
        return self.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if isinstance(self.embed_tokens, QuantizedEmbedding):
            return quant_linear(self.embed_tokens.quant_ops, hidden, self.embed_tokens.quant, None).float()
        if self.tied_lm_head_small_m is not None and (hidden.shape[0] <= SMALL_M_MAX_ROWS
                                                       or self.tied_lm_head_packed is None):
            return self.kernel_ops.small_m_linear(hidden, self.tied_lm_head_small_m, None,
                                                  self.config.vocab_size).float()
        return linear(hidden, self.embed_tokens.weight, packed=self.tied_lm_head_packed).float()

    def load_weights(self, weights) -> set[str]:
        """weights: iterable of (HF checkpoint name, tensor). Returns the parameter names that were filled."""
        params = dict(self.named_parameters())
        loaded = set()
        quantized = {}  # module path → {shard: QuantizedTensor}: weights kept quantized (models/quantization.py)
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue
            module_path, _, leaf = name.rpartition(".")
            owner, _, proj = module_path.rpartition(".")
            if proj in self.FUSED:
                fused, shard = self.FUSED[proj]
                if isinstance(tensor, QuantizedTensor):
                    quantized.setdefault(f"{owner}.{fused}", {})[shard] = tensor
                    loaded.add(f"{owner}.{fused}.{leaf}#{shard}")
                    continue
                target = params[f"{owner}.{fused}.{leaf}"]
                sizes = self._shard_sizes(owner, fused)
                offset = sum(sizes[:shard])
                target.data[offset:offset + sizes[shard]].copy_(tensor)
                loaded.add(f"{owner}.{fused}.{leaf}#{shard}")
                continue
            if name not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")
            if isinstance(tensor, QuantizedTensor):
                quantized[module_path] = {0: tensor}
            else:
                params[name].data.copy_(tensor)
            loaded.add(name)
        for path, shards in quantized.items():
            self._keep_quantized(path, shards)
        return loaded

    def _keep_quantized(self, path: str, shards: dict) -> None:
        """Installs a weight kept quantized (the shards of a fused one concatenated by rows); a fused weight whose
        shards came in different formats (or partly dense) is dequantized into its dense parameter instead."""
        owner, _, fused = path.rpartition(".")
        sizes = self._shard_sizes(owner, fused) if fused in ("qkv_proj", "gate_up_proj") else [None]
        parts = [shards.get(i) for i in range(len(sizes))]
        if any(p is None or p.kind != parts[0].kind for p in parts):
            weight, offset = self.get_parameter(f"{path}.weight"), 0
            for i, size in enumerate(sizes):
                if shards.get(i) is not None:
                    weight.data[offset:offset + shards[i].shape[0]].copy_(shards[i].dequantize())
                offset += size or 0
            return
        quant = QuantizedWeight(QuantizedTensor.cat(parts))
        if path == "embed_tokens":
            self.embed_tokens = QuantizedEmbedding(quant)
        else:
            self.get_submodule(path).set_quantized(quant, None)  # the kernels are set by load_model

    def _shard_sizes(self, owner: str, fused: str) -> list[int]:
        if fused == "qkv_proj":
            attn = self.get_submodule(owner)
            return [attn.q_size, attn.kv_size, attn.kv_size]
        inter = self.get_submodule(owner).intermediate
        return [inter, inter]

    def expected_weights(self) -> set[str]:
        out = set()
        for name, _ in self.named_parameters():
            if name.endswith("qkv_proj.weight") or name.endswith("qkv_proj.bias"):
                out |= {f"{name}#{i}" for i in range(3)}
            elif "gate_up_proj" in name:
                out |= {f"{name}#{i}" for i in range(2)}
            else:
                out.add(name)
        return out
