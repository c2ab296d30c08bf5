"""Emulate llama.cpp's CPU numerics (x86 AVX2/AVX-512 build, non-flash-attention path) for the SmolLM2-135M
Q4_1 GGUF, teacher-forced on the stored llama.cpp greedy outputs, with knobs to switch each emulation on/off.

Usage (from any directory; the model defaults to the installed default GGUF):
  .venv/bin/python benchmarks/llamacpp_numerics.py [--combos NAME,...] [--model PATH.gguf] [--json OUT]
(see COMBOS at the bottom). Written for issue 15's llama.cpp line; benchmarks/results/quantization.md holds the
findings.

Each knob (all off = a plain float32 model on the dequantized weights, HF-style rope/norm):
  act      : activations quantized to Q8_1 per 32-block before every Q4_1 matmul (integer dot products,
             d_w*d_x*isum + m_w*s_x as ggml_vec_dot_q4_1_q8_1), and to Q8_0 before the Q8_0 lm_head.
  act_lm   : only the lm_head part of `act` (Q8_0 activations for the tied Q8_0 output matrix).
  act_q4   : only the Q4_1 part of `act`.
  lanes    : with act, accumulate exactly as the AVX2 kernel does (8 float lanes, FMA per block, hsum_float_8,
             + summs added at the end); without it the per-block terms are summed in float64.
  kv16     : K and V rounded to fp16 (llama.cpp's default F16 KV cache).
  q16      : Q rounded to fp16 before K.Q (non-FA mul_mat converts src1 to vec_dot_type F16).
  p16      : softmax probabilities rounded to fp16 before .V (non-FA: kq (f32) converted to F16 for V mul_mat).
  fa       : flash-attention emulation instead (ggml CPU FA one-row kernel: Q->f16, online softmax,
             V accumulated in an f16 accumulator (VKQ16) with ggml_vec_mad_f16 / ggml_vec_scale_f16).
  grope    : rope angles as ggml computes them (theta = p; theta *= powf(base, -2/n_dims) per pair, float32).
  gnorm    : rms_norm as ggml (sum of float x*x in double, mean -> float, scale = 1.0f/sqrtf(mean+eps)).
  gsoftmax : softmax as ggml (exp(x-max) * (float)(1.0/sum_double)) instead of torch.softmax.
  half_away: Q8 rounding half away from zero (ggml scalar ref) instead of half-to-even (x86 _mm256_round_ps).
"""
from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize

torch.set_num_threads(1)

GGUF = None  # set by main(): --model, default tokenmill's default model (the SmolLM2-135M Q4_1 GGUF)
REF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests/data/llamacpp_q4_1_greedy.json")

N_LAYER, HID, NH, NKV, HD, EPS, BASE = 30, 576, 9, 3, 64, 1e-5, 100000.0


# ----------------------------------------------------------------------------------------------- weights
class Q4_1:
    """Raw Q4_1 blocks of a [out, in] matrix: d, m (fp16 values as float32), q (0..15) as float32."""

    def __init__(self, raw: np.ndarray, out: int, inp: int):
        nb = inp // 32
        b = np.ascontiguousarray(raw).reshape(out, nb, 20)
        self.d = torch.from_numpy(b[:, :, 0:2].copy().view(np.float16).astype(np.float32)[..., 0])  # [O, nb]
        self.m = torch.from_numpy(b[:, :, 2:4].copy().view(np.float16).astype(np.float32)[..., 0])
        qs = b[:, :, 4:20]
        q = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.float32)  # element j<16 low, j>=16 high
        self.q = torch.from_numpy(q)  # [O, nb, 32]
        self.w = (self.d[..., None] * self.q + self.m[..., None]).reshape(out, inp)  # ggml dequantize_row_q4_1
        self.kind = "q4_1"


class Q8_0:
    def __init__(self, raw: np.ndarray, out: int, inp: int):
        nb = inp // 32
        b = np.ascontiguousarray(raw).reshape(out, nb, 34)
        self.d = torch.from_numpy(b[:, :, 0:2].copy().view(np.float16).astype(np.float32)[..., 0])
        self.q = torch.from_numpy(b[:, :, 2:34].copy().view(np.int8).astype(np.float32))
        self.w = (self.d[..., None] * self.q).reshape(out, inp)
        self.kind = "q8_0"


def load():
    r = GGUFReader(GGUF)
    W = {}
    for t in r.tensors:
        shape = [int(x) for x in t.shape]  # ggml order: ne0 (in), ne1 (out)
        if t.tensor_type.name == "Q4_1":
            W[t.name] = Q4_1(t.data, shape[1], shape[0])
        elif t.tensor_type.name == "Q8_0":
            W[t.name] = Q8_0(t.data, shape[1], shape[0])
        else:
            W[t.name] = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(
                list(reversed(shape))))
    # sanity: our block decoding equals gguf's dequantize
    t = next(t for t in r.tensors if t.name == "blk.0.attn_q.weight")
    ref = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(576, 576)
    assert np.array_equal(ref, W["blk.0.attn_q.weight"].w.numpy()), "Q4_1 decode mismatch"
    t = next(t for t in r.tensors if t.name == "token_embd.weight")
    ref = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32).reshape(49152, 576)
    assert np.array_equal(ref, W["token_embd.weight"].w.numpy()), "Q8_0 decode mismatch"
    return W


# ----------------------------------------------------------------------------------------------- activations
def _round(v: torch.Tensor, half_away: bool) -> torch.Tensor:
    if half_away:
        return torch.sign(v) * torch.floor(v.abs() + 0.5)  # roundf
    return torch.round(v)  # half to even, as _mm256_round_ps(_MM_ROUND_NEAREST)


def quant_q8(x: torch.Tensor, half_away: bool):
    """quantize_row_q8_1 / quantize_row_q8_0 (x86 AVX2 version). x: [T, K] float32.
    returns q [T, nb, 32] (float ints), d (fp16 value as f32) [T, nb], s (fp16 value as f32) [T, nb]."""
    T, K = x.shape
    xb = x.reshape(T, K // 32, 32)
    amax = xb.abs().amax(-1)                                     # max_scalar (float)
    d = amax / 127.0                                             # float d = max_scalar / 127.f
    d16 = d.half().float()                                       # y.d = FP32_TO_FP16(d)
    idv = torch.where(amax != 0, torch.tensor(127.0) / amax, torch.zeros_like(amax))  # id = 127.f/max_scalar
    q = _round(xb * idv[..., None], half_away)                   # round(x * id)
    s = (d * q.sum(-1)).half().float()                           # y.s = FP32_TO_FP16(d * sum(q))  (d unrounded)
    return q, d16, s


def qlinear(x: torch.Tensor, W, knobs: dict, lm: bool = False) -> torch.Tensor:
    use_q = knobs.get("act_lm" if lm else "act_q4", False) or knobs.get("act", False)
    if not use_q:
        return x @ W.w.T
    qx, dx, sx = quant_q8(x, knobs.get("half_away", False))
    T = x.shape[0]
    O, nb = W.d.shape
    lanes = knobs.get("lanes", False)
    out = torch.empty(T, O, dtype=torch.float32)
    ch = 4096 if lm else O
    for o0 in range(0, O, ch):
        o1 = min(O, o0 + ch)
        qw = W.q[o0:o1]                                          # [o, nb, 32]
        dw = W.d[o0:o1]                                          # [o, nb]
        d0d1 = (dw.T[:, None, :] * dx.T[:, :, None])             # [nb, T, o]  float32 product of fp16 values
        if not lanes:
            isum = torch.bmm(qx.permute(1, 0, 2), qw.permute(1, 2, 0))   # [nb, T, o] exact integers
            acc = (d0d1 * isum).double().sum(0)                  # per-block terms rounded to f32, summed in f64
            if W.kind == "q4_1":
                mw = W.m[o0:o1]
                summs = (mw.T[:, None, :] * sx.T[:, :, None]).double().sum(0)
                acc = acc + summs
            out[:, o0:o1] = acc.float()
        else:
            # AVX2: lane l (0..7) of mul_sum_*_pairs_float holds bytes 4l..4l+3 of the 32-byte vectors.
            # Q4_1: qx bytes = [low nibbles of qs[0..15], high nibbles] = our element order (j<16 low).
            # Q8_0: mul_sum_i8_pairs_float -> same lane layout over the 32 int8s.
            qx8 = qx.reshape(T, nb, 8, 4)
            qw8 = qw.reshape(o1 - o0, nb, 8, 4)
            acc = torch.zeros(T, o1 - o0, 8, dtype=torch.float64)
            summs = torch.zeros(T, o1 - o0, dtype=torch.float32)
            for b in range(nb):
                xy = torch.einsum("tlk,olk->tol", qx8[:, b], qw8[:, b])          # exact ints
                acc = (acc + d0d1[b][:, :, None].double() * xy.double()).float().double()  # fma -> f32
                if W.kind == "q4_1":
                    if knobs.get("summs_fma"):
                        summs = (summs.double() + W.m[o0:o1, b][None, :].double() * sx[:, b][:, None].double()).float()
                    else:
                        summs = summs + (W.m[o0:o1, b][None, :] * sx[:, b][:, None])     # float, no fma
            a = acc.float()
            # hsum_float_8: res = lo128 + hi128; res += movehl(res); res_ss += movehdup
            r = a[..., 0:4] + a[..., 4:8]
            r2 = torch.stack([r[..., 0] + r[..., 2], r[..., 1] + r[..., 3]], -1)
            h = r2[..., 0] + r2[..., 1]
            if W.kind == "q4_1":
                h = h + summs
            out[:, o0:o1] = h
    return out


# ----------------------------------------------------------------------------------------------- other ops
def rmsnorm(x: torch.Tensor, w: torch.Tensor, knobs: dict) -> torch.Tensor:
    if knobs.get("gnorm"):
        s = (x * x).double().sum(-1, keepdim=True)              # sum += (ggml_float)(x*x)
        mean = (s / x.shape[-1]).float()                         # const float mean = sum/ne00
        scale = 1.0 / torch.sqrt(mean + EPS)                     # 1.0f/sqrtf(mean + eps)  (float32 ops)
        return (x * scale) * w
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def ggml_thetas(T: int, ts) -> np.ndarray:
    """Rope angles as ggml computes them: theta = p, then theta *= ts per pair, in float32."""
    th = np.zeros((T, HD // 2), dtype=np.float32)
    for p in range(T):
        t = np.float32(p)
        for i in range(HD // 2):
            th[p, i] = t
            t = np.float32(t * ts)
    return th


def rope_tables(T: int, knobs: dict):
    if knobs.get("grope"):
        ts = np.float32(np.power(np.float32(BASE), np.float32(-2.0) / np.float32(HD), dtype=np.float32))
        th = torch.from_numpy(ggml_thetas(T, ts))
    else:
        inv = 1.0 / (BASE ** (torch.arange(0, HD, 2, dtype=torch.float) / HD))
        th = torch.outer(torch.arange(T, dtype=torch.float), inv)
    return torch.cos(th), torch.sin(th)


def rope_norm(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """llama.cpp rope mode NORM (adjacent pairs) on GGUF-ordered q/k. x: [T, H, HD]."""
    x0 = x[..., 0::2]
    x1 = x[..., 1::2]
    c = cos[:, None, :]
    s = sin[:, None, :]
    y0 = x0 * c - x1 * s
    y1 = x0 * s + x1 * c
    return torch.stack([y0, y1], -1).reshape(x.shape)


def softmax(s: torch.Tensor, knobs: dict) -> torch.Tensor:
    if knobs.get("gsoftmax"):
        m = s.amax(-1, keepdim=True)
        e = torch.exp(s - m)
        tot = e.double().sum(-1, keepdim=True)
        return e * (1.0 / tot).float()
    return torch.softmax(s, -1)


def attention(q, k, v, knobs):
    """q [T, NH, HD], k/v [T, NKV, HD]; causal. returns [T, NH*HD]."""
    T = q.shape[0]
    if knobs.get("kv16"):
        k = k.half().float()
        v = v.half().float()
    rep = NH // NKV
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    scale = 1.0 / math.sqrt(HD)
    if knobs.get("fa"):
        return fa_attention(q, k, v, scale, knobs)
    if knobs.get("q16"):
        q = q.half().float()
    s = torch.einsum("thd,shd->hts", q, k) * scale               # [NH, T, S]
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    s = s.masked_fill(mask, float("-inf"))
    p = softmax(s, knobs)
    if knobs.get("p16"):
        p = p.half().float()
    o = torch.einsum("hts,shd->thd", p, v)
    return o.reshape(T, NH * HD)


def fa_attention(q, k, v, scale, knobs):
    """ggml_compute_forward_flash_attn_ext_f16_one_chunk, F16 K/V: Q converted to f16, s = dot_f16(k, q) (f32),
    s = s*scale + mask; online softmax; V accumulated in f16 (VKQ16 = VKQ16*ms (f16), VKQ16 += v*vs (f16))."""
    T = q.shape[0]
    qh = q.half().float()
    kh = k.half().float()
    vh = v.half().float()
    out = torch.empty(T, NH, HD)
    for t in range(T):
        S = torch.zeros(NH, dtype=torch.float32)
        M = torch.full((NH,), float("-inf"))
        acc = torch.zeros(NH, HD, dtype=torch.float16)
        for j in range(t + 1):
            s = (qh[t] * kh[j]).sum(-1) * scale                  # [NH]
            Mold = M
            M = torch.maximum(M, s)
            ms = torch.where(s > Mold, torch.exp(Mold - M), torch.ones_like(M))
            vs = torch.where(s > Mold, torch.ones_like(M), torch.exp(s - M))
            acc = (acc.float() * ms[:, None]).half()             # ggml_vec_scale_f16 (only when max changed)
            acc = (acc.float() + vh[j] * vs[:, None]).half()     # ggml_vec_mad_f16
            S = S * ms + vs
        out[t] = acc.float() / S[:, None]                        # S_inv = 1/S; VKQ32 *= S_inv
    return out.reshape(T, NH * HD)



def fma(a, b, c):
    """float32 fma emulated in float64 (a*b exact; one rounding to f32 except rare double-rounding)."""
    return (a.double() * b.double() + c.double()).float()


def v_expf(x: torch.Tensor) -> torch.Tensor:
    """ggml_v_expf, AVX512F+DQ version (vec.h), elementwise on float32."""
    f = lambda v: torch.tensor(v, dtype=torch.float32)
    r = f(float.fromhex("0x1.8p23"))
    z = fma(x, f(float.fromhex("0x1.715476p+0")).expand_as(x), r.expand_as(x))
    n = z - r
    b = fma(-n, f(float.fromhex("0x1.7f7d1cp-20")).expand_as(x),
            fma(-n, f(float.fromhex("0x1.62e4p-1")).expand_as(x), x))
    u = b * b
    c = lambda h: f(float.fromhex(h)).expand_as(x)
    j = fma(fma(fma(c("0x1.0e4020p-7"), b, c("0x1.573e2ep-5")), u, fma(c("0x1.555e66p-3"), b, c("0x1.fffdb6p-2"))),
            u, fma(c("0x1.ffffecp-1"), b, c("0x1p0")))
    nn = torch.nan_to_num(n, nan=0.0, posinf=1000.0, neginf=-1000.0).clamp(-1000, 1000)
    res = torch.ldexp(j, nn)                                    # _mm512_scalef_ps(j, n)
    big = n.abs() > 192
    alt = torch.where(n <= 0, torch.zeros_like(x), torch.full_like(x, float("inf")))
    return torch.where(big, alt, res).float()


def silu_mul(g, u, knobs):
    if knobs.get("vexp"):
        e = v_expf(torch.zeros_like(g) - g)
        return (g / (1.0 + e)) * u
    return torch.nn.functional.silu(g) * u


def reduce16(a: torch.Tensor) -> torch.Tensor:
    """_mm512_reduce_add_ps over the last dim (16), GCC's order."""
    t3 = a[..., 8:16] + a[..., 0:8]
    t6 = t3[..., 4:8] + t3[..., 0:4]
    t8a = t6[..., 0] + t6[..., 2]
    t8b = t6[..., 1] + t6[..., 3]
    return t8a + t8b


def dot_tinyblas(p: torch.Tensor) -> torch.Tensor:
    """p: [..., n] exact f32 products; tinyBLAS<16,__m512> accumulation (madd per 16 lanes, then hsum)."""
    n = p.shape[-1]
    assert n % 16 == 0
    pc = p.reshape(*p.shape[:-1], n // 16, 16)
    acc = pc[..., 0, :]
    for c in range(1, n // 16):
        acc = acc + pc[..., c, :]
    return reduce16(acc)


def dot_vecf16(p: torch.Tensor) -> torch.Tensor:
    """ggml_vec_dot_f16 on AVX512 (EPR 16, STEP 64): 4 accumulators, REDUCE, leftovers in double."""
    n = p.shape[-1]
    np_ = n & ~63
    out = torch.zeros(p.shape[:-1], dtype=torch.float64)
    if np_:
        pc = p[..., :np_].reshape(*p.shape[:-1], np_ // 64, 4, 16)
        acc = pc[..., 0, :, :]
        for i in range(1, np_ // 64):
            acc = acc + pc[..., i, :, :]
        s0 = acc[..., 0, :] + acc[..., 2, :]
        s1 = acc[..., 1, :] + acc[..., 3, :]
        out = reduce16(s0 + s1).double()
    if np_ < n:
        for i in range(np_, n):
            out = out + p[..., i].double()
    return out.float()


def _pad(n, pad):
    return ((n + pad - 1) // pad) * pad


def attention_exact(q, k, v, knobs, n_prompt):
    """Non-FA llama.cpp attention with f16 K/V cache, Q->f16, probs->f16 and ggml's accumulation orders:
    prompt rows (one ubatch, mul_mat with n>=2) use llamafile tinyBLAS f16; generated rows (n=1) ggml_vec_dot_f16."""
    T = q.shape[0]
    pad = knobs.get("kv_pad", 32)
    rep = NH // NKV
    kh = k.half().float().repeat_interleave(rep, dim=1)        # [T, NH, HD]
    vh = v.half().float().repeat_interleave(rep, dim=1)
    qh = q.half().float()
    scale = 1.0 / math.sqrt(HD)
    out = torch.empty(T, NH, HD)
    for t in range(T):
        prompt = t < n_prompt
        nkv = _pad(n_prompt if prompt else t + 1, pad)
        S = min(nkv, T)
        prod = qh[t][:, None, :] * kh[:S].permute(1, 0, 2)     # [NH, S, HD] exact
        sc = dot_tinyblas(prod) if prompt else dot_vecf16(prod)  # [NH, S]
        w = torch.full((NH, nkv), float("-inf"))
        w[:, :t + 1] = sc[:, :t + 1] * scale
        mx = w.amax(-1, keepdim=True)
        e = v_expf(w - mx) if knobs.get("vexp") else torch.exp(w - mx)
        if nkv % 16 == 0:
            tot = reduce16(e.reshape(NH, nkv // 16, 16)).double().sum(-1, keepdim=True)
        else:
            tot = e.double().sum(-1, keepdim=True)
        pr = (e * (1.0 / tot).float()).half().float()           # ggml_vec_scale_f32 then f32->f16 for V mul_mat
        pv = torch.zeros(NH, HD, nkv)
        pv[:, :, :S] = pr[:, None, :S] * vh[:S].permute(1, 2, 0)  # [NH, HD, nkv]
        if prompt:
            if nkv % 16:
                raise ValueError("tinyBLAS needs k%16==0")
            out[t] = dot_tinyblas(pv)
        else:
            out[t] = dot_vecf16(pv)
    return out.reshape(T, NH * HD)


def rope_tables_exact(T):
    ts = np.float32(np.power(np.float64(BASE), -2.0 / HD))     # powf(base, -2.0f/n_dims), correctly rounded
    th = ggml_thetas(T, ts)
    c = torch.from_numpy(np.cos(th.astype(np.float64)).astype(np.float32))   # cosf ~ correctly rounded
    s = torch.from_numpy(np.sin(th.astype(np.float64)).astype(np.float32))
    return c, s


def rope_fma(x, cos, sin, fused=1):
    """rotate_pairs compiled with contraction: y0 = fma(x0, c, -(x1*s)); y1 = fma(x0, s, x1*c)."""
    x0 = x[..., 0::2]
    x1 = x[..., 1::2]
    c = cos[:, None, :].expand_as(x0)
    s = sin[:, None, :].expand_as(x0)
    if fused == 2:   # the other contraction: y0 = fma(-x1, s, x0*c); y1 = fma(x1, c, x0*s)
        y0 = fma(-x1, s, x0 * c)
        y1 = fma(x1, c, x0 * s)
    else:
        y0 = fma(x0, c, -(x1 * s))
        y1 = fma(x0, s, x1 * c)
    return torch.stack([y0, y1], -1).reshape(x.shape)


def forward(W, ids, knobs, out_rows, n_prompt=None):
    T = len(ids)
    x = W["token_embd.weight"].w[torch.tensor(ids)]              # get_rows: dequantized Q8_0 rows
    cos, sin = rope_tables_exact(T) if knobs.get("rope_exact") else rope_tables(T, knobs)
    rope = (lambda t: rope_fma(t, cos, sin, knobs['rope_fma'])) if knobs.get("rope_fma") else (lambda t: rope_norm(t, cos, sin))
    for L in range(N_LAYER):
        p = f"blk.{L}."
        h = rmsnorm(x, W[p + "attn_norm.weight"], knobs)
        q = qlinear(h, W[p + "attn_q.weight"], knobs).reshape(T, NH, HD)
        k = qlinear(h, W[p + "attn_k.weight"], knobs).reshape(T, NKV, HD)
        v = qlinear(h, W[p + "attn_v.weight"], knobs).reshape(T, NKV, HD)
        q = rope(q)
        k = rope(k)
        a = attention_exact(q, k, v, knobs, n_prompt) if knobs.get("attn_exact") else attention(q, k, v, knobs)
        x = x + qlinear(a, W[p + "attn_output.weight"], knobs)
        h = rmsnorm(x, W[p + "ffn_norm.weight"], knobs)
        g = qlinear(h, W[p + "ffn_gate.weight"], knobs)
        u = qlinear(h, W[p + "ffn_up.weight"], knobs)
        x = x + qlinear(silu_mul(g, u, knobs), W[p + "ffn_down.weight"], knobs)
    x = rmsnorm(x[out_rows], W["output_norm.weight"], knobs)
    return qlinear(x, W["token_embd.weight"], knobs, lm=True)


def evaluate(W, cases, knobs):
    firsts, margins = [], []
    for c in cases:
        P, O = c["prompt_ids"], c["output_ids"]
        ids = P + O[:-1]
        rows = torch.arange(len(P) - 1, len(P) - 1 + len(O))
        logits = forward(W, ids, knobs, rows, len(P))
        am = logits.argmax(-1)
        first, margin = len(O), None
        for i in range(len(O)):
            if int(am[i]) != O[i]:
                first = i
                margin = float(logits[i, am[i]] - logits[i, O[i]])
                break
        firsts.append(first)
        margins.append(margin)
    return firsts, margins


EXACT = dict(act=1, lanes=1, summs_fma=1, gnorm=1, rope_exact=1, rope_fma=1, vexp=1, attn_exact=1, kv_pad=32)
def _x(**kw):
    d = dict(EXACT); d.update(kw); return {k: v for k, v in d.items() if v is not None}

COMBOS = {
    "float": {},
    "float+grope+gnorm": dict(grope=1, gnorm=1, gsoftmax=1),
    "act": dict(act=1),
    "act_q4": dict(act_q4=1),
    "act_lm": dict(act_lm=1),
    "kv16": dict(kv16=1),
    "kv16+q16+p16": dict(kv16=1, q16=1, p16=1),
    "act+kv16": dict(act=1, kv16=1),
    "act+kv16+q16+p16": dict(act=1, kv16=1, q16=1, p16=1),
    "act+kv16+q16+p16+g": dict(act=1, kv16=1, q16=1, p16=1, grope=1, gnorm=1, gsoftmax=1),
    "act+kv16+q16+p16+g+lanes": dict(act=1, kv16=1, q16=1, p16=1, grope=1, gnorm=1, gsoftmax=1, lanes=1),
    "act+fa+g": dict(act=1, kv16=1, fa=1, grope=1, gnorm=1, gsoftmax=1),
    "act+kv16+q16+p16+g+half_away": dict(act=1, kv16=1, q16=1, p16=1, grope=1, gnorm=1, gsoftmax=1, half_away=1),
    "exact": _x(),
    "exact-summs_fma": _x(summs_fma=None),
    "exact-rope_fma": _x(rope_fma=None),
    "exact-vexp": _x(vexp=None),
    "exact-lanes": _x(lanes=None, summs_fma=None),
    "exact-attn_exact(+kv16+q16+p16)": _x(attn_exact=None, kv16=1, q16=1, p16=1, gsoftmax=1),
    "exact_kv_pad256": _x(kv_pad=256),
    "exact_kv_pad64": _x(kv_pad=64),
    "exact-act": _x(act=None, lanes=None, summs_fma=None),
    "exact_rope_fma2": _x(rope_fma=2),
    "exact-rope_fma-summs_fma": _x(rope_fma=None, summs_fma=None),
    "exact-rope_fma-vexp": _x(rope_fma=None, vexp=None),
    "exact-rope_fma-lanes": _x(rope_fma=None, lanes=None, summs_fma=None),
    "exact-rope_fma_kv_pad64": _x(rope_fma=None, kv_pad=64),
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--combos", default=",".join(COMBOS))
    ap.add_argument("--cases", default="")
    ap.add_argument("--json", default="")
    ap.add_argument("--model", default=None, help="the Q4_1 GGUF (default: tokenmill's default model)")
    a = ap.parse_args()
    global GGUF
    if a.model:
        GGUF = a.model
    else:
        from tokenmill.models.paths import default_model_path
        GGUF = default_model_path()
    cases = json.load(open(REF))["cases"]
    if a.cases:
        cases = [cases[int(i)] for i in a.cases.split(",")]
    W = load()
    results = {}
    for name in a.combos.split(","):
        t0 = time.time()
        firsts, margins = evaluate(W, cases, COMBOS[name])
        full = sum(f == 32 for f in firsts)
        results[name] = dict(full=full, firsts=firsts, margins=margins)
        ms = ["-" if m is None else f"{m:.4f}" for m in margins]
        print(f"{name:34s} full={full}/{len(cases)} first={firsts} margins={ms} ({time.time()-t0:.0f}s)",
              flush=True)
    if a.json:
        json.dump(results, open(a.json, "w"), indent=1)


if __name__ == "__main__":
    main()
