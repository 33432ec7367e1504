"""A second CPU population for maingrad.hooks.preflight, written after `preflight_zoo.py` and never tuned to:
66 architectures its author had not run preflight on, fp32 and bf16, each correct and with bugs on a parameter
drawn at random from those with a gradient in float64 (batches A-F below).

Each batch was run once before anything was changed for it; what it found was fixed and the batch kept:
- A (13: TransformerEncoder/MultiheadAttention, LSTM, GRU, conv + BatchNorm, GQA with rotary embeddings and
  RMSNorm, a layer used three times, frozen weights, Bilinear/PReLU/depthwise conv, top-2 MoE with capacity,
  weight norm, mixed bf16/fp32, padding and bag embeddings): a zero-initialised bias whose gradient was zeroed
  read `unused` (its random move was zero), and `fd_resolution` read x1.63 where x2.7 could hide.
- B (12: ConvNeXt, pre-norm ViT, T5 relative bias, WaveNet, a linear recurrence, soft-capped tied logits, UNet
  with GroupNorm, MLP-Mixer, highway gates, einsum weights with LoRA): one false blame in bf16 (two steps
  agreed on x0.83 where smaller steps showed noise ten times the measured one).
- C (Linear + BatchNorm1d, 10 seeds): module-local false alarms where the BatchNorm removes a bias (3 of 10
  seeds), and a ReLU kink read as x0.995 in fp32. (BatchNorm is judged on its module since: 100 of 100.)
- D (10: Perceiver latents, post-norm decoder, conv + InstanceNorm, a GRU cell loop, weights tied by hand
  with dropout, ReZero, an FFT long convolution, spectral norm): spectral norm's power iteration, a buffer
  the forward writes and computes with, made every run start where the last one left off: 3 of 3 correct
  models failed and 24 bug cases blamed other weights (now each run starts from the caller's buffers, and a
  difference with no pattern where buffers moved is inconclusive). Otherwise 27 of 27 correct models passed
  and 179 of 216 bugs were named exactly, 2 on their parameter with another anomaly (an overwritten scalar:
  its singles are parallel, so which were kept cannot be told), the rest missed visibly.
- E (15, the shapes of Megatron-style code as forks write them: a norm and a linear in one module, biases
  returned to the caller, an output layer computing with the word embeddings passed in, zero-centred RMSNorm,
  a fused gate-and-up projection, grouped 3-D expert weights behind a top-2 router with capacity and a gated
  shared expert, low-rank latent attention, a Mamba-style selective scan, BERT with an MLM head and a binary
  head, QK layernorm, multi-token prediction, activation recompute (reentrant and not), a transposed linear;
  fp32 and bf16), 6 seeds, all run once before any change: 90 of 90 correct models passed; of 810 bugs one
  wrong blame (a bf16 router whose loss jumps as top-k choices flip read x13.5 at two steps: `refuting` since),
  and zeroed gradients on two weights whose whole effect stays within the loss's noise read `unused`
  (held as `KNOWN_MISSES` until `unused` needed the loss unchanged bit for bit: `inconclusive` since).
- F (14, mechanisms none of the above has: an Embedding with max_norm, an orthogonal parametrization,
  scaled_dot_product_attention, CaiT layer scale at 1e-4, a hypernetwork, a contrastive loss with a learned
  temperature, an L2 penalty in the loss, ignore_index padding, a packed LSTM, index_add_ message passing, a
  flow with log|det W|, transposed convolutions; fp32 and bf16), 3 + 3 seeds, run once: the held-out seeds all
  right; on the tuned ones a false alarm and 8 wrong blames on the max_norm embedding of one seed (its forward
  renormalises the rows it looks up: a parameter written in place is `inconclusive` since), and a silent miss
  (layer scale 1e-4 in bf16: the attention branch rounds away in the residual sum, so a zeroed in_proj_weight
  read `unused`; held in `KNOWN_MISSES` until MultiheadAttention's zero gradients were judged on its output).

`test_preflight_wild.py` holds every case to: a correct model passes (a stateful forward: or is inconclusive
on that account alone); a bug is named on its parameter and nowhere else, or its miss is visible (the
parameter is inconclusive, or its `fd_resolution` admits the factor).
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from preflight_zoo import every_second_halved, later_doubled, microbatch, overwrite, scale, third_only_lost
from torch import nn

from maingrad.hooks.preflight.result import PreflightResult
from maingrad.hooks.preflight.run import preflight

Batch = tuple[torch.Tensor, torch.Tensor]


# -- batch A -------------------------------------------------------------------------------------------------
class Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 32)
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layer(self.emb(x)))


class Recurrent(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.rnn = (
            nn.LSTM(16, 24, num_layers=2, batch_first=True)
            if kind == "lstm"
            else nn.GRU(16, 24, batch_first=True)
        )
        self.head = nn.Linear(24, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.rnn(self.emb(x))[0])


class ResNetBN(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.c2, self.b2 = nn.Conv2d(8, 8, 3, padding=1), nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(self.b1(self.c1(x)))
        h = h + F.relu(self.b2(self.c2(h)))
        return self.head(h.mean((2, 3)))


class RMSNorm(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.w


def _rope(x: torch.Tensor) -> torch.Tensor:
    t, e = x.shape[-2], x.shape[-1]
    inv = 1.0 / (10000 ** (torch.arange(0, e, 2, dtype=torch.float32) / e))
    angle = torch.arange(t, dtype=torch.float32)[:, None] * inv
    cos, sin = angle.cos().to(x.dtype), angle.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).flatten(-2)


class Llama(nn.Module):
    """Grouped-query attention (4 heads, 2 key/value heads), rotary embeddings, RMSNorm, SwiGLU."""

    def __init__(self, layers: int = 2, dim: int = 32, heads: int = 4, kv: int = 2) -> None:
        super().__init__()
        self.heads, self.kv = heads, kv
        self.emb = nn.Embedding(40, dim)
        self.n1 = nn.ModuleList(RMSNorm(dim) for _ in range(layers))
        self.n2 = nn.ModuleList(RMSNorm(dim) for _ in range(layers))
        self.q = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(layers))
        self.kvp = nn.ModuleList(nn.Linear(dim, 2 * dim * kv // heads, bias=False) for _ in range(layers))
        self.o = nn.ModuleList(nn.Linear(dim, dim, bias=False) for _ in range(layers))
        self.gate = nn.ModuleList(nn.Linear(dim, 2 * dim, bias=False) for _ in range(layers))
        self.up = nn.ModuleList(nn.Linear(dim, 2 * dim, bias=False) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(2 * dim, dim, bias=False) for _ in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, 40, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        b, t, d = x.shape
        hd = d // self.heads
        for k in range(len(self.q)):
            h = self.n1[k](x)
            q = self.q[k](h).view(b, t, self.heads, hd).transpose(1, 2)
            key, value = self.kvp[k](h).view(b, t, 2, self.kv, hd).unbind(2)
            rep = self.heads // self.kv
            key = key.transpose(1, 2).repeat_interleave(rep, 1)
            value = value.transpose(1, 2).repeat_interleave(rep, 1)
            att = F.scaled_dot_product_attention(_rope(q), _rope(key), value, is_causal=True)
            x = x + self.o[k](att.transpose(1, 2).reshape(b, t, d))
            h = self.n2[k](x)
            x = x + self.down[k](F.silu(self.gate[k](h)) * self.up[k](h))
        return self.head(self.norm(x))


class Albert(nn.Module):
    """One layer (and its LayerNorm) used three times per forward."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.proj = nn.Linear(16, 24)
        self.shared = nn.Linear(24, 24)
        self.ln = nn.LayerNorm(24)
        self.head = nn.Linear(24, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(self.emb(x))
        for _ in range(3):
            h = self.ln(h + torch.tanh(self.shared(h)))
        return self.head(h)


class Frozen(nn.Module):
    """A frozen weight, a parameter the forward never uses, a learned temperature outside any module."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.unused = nn.Linear(12, 24), nn.Linear(24, 12), nn.Linear(4, 4)
        self.log_t = nn.Parameter(torch.tensor(0.3))
        self.a.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x))) * self.log_t.exp()


class BilinearNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.bl = nn.Bilinear(12, 12, 16)
        self.act = nn.PReLU(16)
        self.dw = nn.Conv1d(16, 16, 3, padding=1, groups=16)
        self.head = nn.Linear(16, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.bl(x, x.flip(-1)))
        return self.head(self.dw(h.T[None])[0].T)


class Top2MoE(nn.Module):
    """Top-2 routing; an expert takes at most `capacity` tokens, the rest are dropped."""

    def __init__(self, dim: int = 12, experts: int = 4, capacity: int = 6) -> None:
        super().__init__()
        self.capacity = capacity
        self.inp = nn.Linear(dim, dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.w1 = nn.ModuleList(nn.Linear(dim, 2 * dim) for _ in range(experts))
        self.w2 = nn.ModuleList(nn.Linear(2 * dim, dim) for _ in range(experts))
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        top, idx = self.router(h).softmax(-1).topk(2, -1)
        y = torch.zeros_like(h)
        for e in range(len(self.w1)):
            token, slot = (idx == e).nonzero(as_tuple=True)
            token, slot = token[: self.capacity], slot[: self.capacity]
            if token.numel():
                y.index_add_(0, token, self.w2[e](F.gelu(self.w1[e](h[token]))) * top[token, slot][:, None])
        return self.out(h + y)


class WeightNormed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.utils.parametrizations.weight_norm(nn.Linear(12, 24))
        self.b = nn.Linear(24, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


class MixedHead(nn.Module):
    """A bf16 body under an fp32 head."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32)).to(torch.bfloat16)
        self.head = nn.Linear(32, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(x.bfloat16()).float())


class PadEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16, padding_idx=0)
        self.bag = nn.EmbeddingBag(40, 16, mode="mean")
        self.head = nn.Linear(32, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bag = self.bag(x.reshape(-1, 1)).view(*x.shape, 16)
        return self.head(torch.cat([self.emb(x), bag], -1))


# -- batch B -------------------------------------------------------------------------------------------------
class ConvNeXt(nn.Module):
    """Depthwise convolution, channels-last LayerNorm, and a layer scale initialised to 1e-2."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 16, 2, stride=2)
        self.dw = nn.Conv2d(16, 16, 3, padding=1, groups=16)
        self.ln = nn.LayerNorm(16)
        self.pw1, self.pw2 = nn.Linear(16, 32), nn.Linear(32, 16)
        self.gamma = nn.Parameter(1e-2 * torch.ones(16))
        self.head = nn.Linear(16, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        y = self.pw2(F.gelu(self.pw1(self.ln(self.dw(h).permute(0, 2, 3, 1))))) * self.gamma
        return self.head((h + y.permute(0, 3, 1, 2)).mean((2, 3)))


class ViT(nn.Module):
    """Patches, a class token initialised to zero, pre-norm TransformerEncoder layers."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 24, 3, stride=3)
        self.cls = nn.Parameter(torch.zeros(1, 1, 24))
        self.pos = nn.Parameter(0.02 * torch.randn(1, 5, 24))
        layer = nn.TransformerEncoderLayer(24, 4, 48, dropout=0.0, batch_first=True, norm_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        p = self.patch(x).flatten(2).transpose(1, 2)
        p = torch.cat([self.cls.expand(p.shape[0], -1, -1), p], 1) + self.pos
        return self.head(self.enc(p)[:, 0])


class RelativeBias(nn.Module):
    """T5-style: a learned bias per head and clipped relative position, added to the attention logits."""

    def __init__(self, dim: int = 24, heads: int = 3) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(40, dim)
        self.ln = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.rel = nn.Embedding(15, heads)
        self.out = nn.Linear(dim, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        b, t, d = h.shape
        q, k, v = self.qkv(self.ln(h)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        rel = (torch.arange(t)[None] - torch.arange(t)[:, None]).clamp(-7, 7) + 7
        att = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads) + self.rel(rel).permute(2, 0, 1)
        y = (att.softmax(-1) @ v).transpose(1, 2).reshape(b, t, d)
        return self.out(h + self.o(y))


class WaveNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Conv1d(12, 16, 1)
        self.filters = nn.ModuleList(nn.Conv1d(16, 16, 2, dilation=d) for d in (1, 2, 4))
        self.gates = nn.ModuleList(nn.Conv1d(16, 16, 2, dilation=d) for d in (1, 2, 4))
        self.skip = nn.Conv1d(16, 12, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x.T[None])
        skip = torch.zeros_like(h)
        for f, g, d in zip(self.filters, self.gates, (1, 2, 4), strict=True):
            padded = F.pad(h, (d, 0))
            z = torch.tanh(f(padded)) * torch.sigmoid(g(padded))
            h, skip = h + z, skip + z
        return self.skip(skip)[0].T


class LinearRecurrence(nn.Module):
    """A diagonal state-space recurrence: its parameters are used at every time step."""

    def __init__(self, dim: int = 12, state: int = 8) -> None:
        super().__init__()
        self.log_a = nn.Parameter(torch.log(torch.linspace(0.5, 0.95, state)))
        self.b = nn.Linear(dim, state, bias=False)
        self.c = nn.Linear(state, dim, bias=False)
        self.d = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, a = self.b(x), self.log_a.exp()
        s, states = torch.zeros(u.shape[-1]), []
        for t in range(u.shape[0]):
            s = a * s + u[t]
            states.append(s)
        return self.c(torch.stack(states)) + self.d * x


class SoftCapped(nn.Module):
    """Gemma-style: a scaled embedding tied to the output, RMSNorm, logits soft-capped by tanh."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.mlp = nn.Sequential(nn.Linear(16, 32), nn.GELU(approximate="tanh"), nn.Linear(32, 16))
        self.norm = nn.RMSNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) * 4.0
        h = h + self.mlp(self.norm(h))
        return 5.0 * torch.tanh(self.norm(h) @ self.emb.weight.T / 5.0)


class UNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.down = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.gn = nn.GroupNorm(2, 8)
        self.up = nn.ConvTranspose2d(8, 3, 2, stride=2)
        self.head = nn.Linear(3, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head((x + self.up(F.silu(self.gn(self.down(x))))).mean((2, 3)))


class Mixer(nn.Module):
    def __init__(self, tokens: int = 16, dim: int = 12) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.tok = nn.Sequential(nn.Linear(tokens, 24), nn.GELU(), nn.Linear(24, tokens))
        self.ch = nn.Sequential(nn.Linear(dim, 24), nn.GELU(), nn.Linear(24, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tok(self.ln1(x).T).T
        return x + self.ch(self.ln2(x))


class Highway(nn.Module):
    """Gated layers, one pair of them used three times."""

    def __init__(self, dim: int = 12) -> None:
        super().__init__()
        self.h, self.t = nn.Linear(dim, dim), nn.Linear(dim, dim)
        nn.init.constant_(self.t.bias, -1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(3):
            g = torch.sigmoid(self.t(x))
            x = g * torch.relu(self.h(x)) + (1 - g) * x
        return x


class LoRA(nn.Module):
    """Raw parameter matrices through einsum and matmul: a frozen base, a LoRA adapter whose B starts at 0."""

    def __init__(self, dim: int = 12, rank: int = 4) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(dim, dim) / math.sqrt(dim), requires_grad=False)
        self.a = nn.Parameter(torch.randn(rank, dim) * 0.1)
        self.b = nn.Parameter(torch.zeros(dim, rank))
        self.w2 = nn.Parameter(torch.randn(dim, dim) / math.sqrt(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.einsum("td,ed->te", x, self.w) + x @ self.a.T @ self.b.T
        return torch.tanh(h) @ self.w2.T


# -- batch C -------------------------------------------------------------------------------------------------
def mlp_batchnorm() -> nn.Module:
    """Linear layers each followed by BatchNorm1d in training mode: the normalisation removes each bias's
    effect (its true gradient is 0; the computed one is rounding)."""
    return nn.Sequential(
        nn.Linear(12, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32), nn.BatchNorm1d(32), nn.Tanh(),
        nn.Linear(32, 12),
    )  # fmt: skip


# -- batch D: held out (run once, after the fixes the other batches led to) ----------------------------------
class Perceiver(nn.Module):
    """Learned latents cross-attending to the tokens (MultiheadAttention with separate key/value sizes)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 12)
        self.latents = nn.Parameter(0.5 * torch.randn(4, 16))
        self.cross = nn.MultiheadAttention(16, 2, kdim=12, vdim=12, batch_first=True)
        self.head = nn.Linear(16, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.emb(x)
        q = self.latents.expand(x.shape[0], -1, -1)
        z = self.cross(q, tokens, tokens, need_weights=False)[0].mean(1, keepdim=True)
        return self.head(z).expand(-1, x.shape[1], -1)


class Decoder(nn.Module):
    """A post-norm TransformerDecoderLayer over an encoded memory."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.dec = nn.TransformerDecoderLayer(16, 2, 32, dropout=0.0, batch_first=True)
        self.head = nn.Linear(16, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        return self.head(self.dec(h, h.flip(1)))


class InstanceNormConv(nn.Module):
    """Conv1d + affine InstanceNorm1d (which removes the convolution's bias, per sample and channel)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv1d(12, 16, 3, padding=1)
        self.norm = nn.InstanceNorm1d(16, affine=True)
        self.out = nn.Conv1d(16, 12, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(F.gelu(self.norm(self.conv(x.T[None]))))[0].T


class CellLoop(nn.Module):
    """An RNN cell stepped in Python, its weights used at every step."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 12)
        self.cell = nn.GRUCell(12, 16)
        self.head = nn.Linear(16, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.zeros(x.shape[0], 16, dtype=self.head.weight.dtype)
        outs = []
        for t in range(x.shape[1]):
            h = self.cell(self.emb(x[:, t]), h)
            outs.append(h)
        return self.head(torch.stack(outs, 1))


class TiedByHand(nn.Module):
    """Two Linear modules holding the same Parameter object; dropout 0.3 (the random state per run)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(12, 12), nn.Linear(12, 12)
        self.b.weight = self.a.weight
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.tanh(self.a(x))))


class ReZero(nn.Module):
    """Residual branches scaled by a learned scalar that starts at 0 plus one at 0.1; LayerNorm without
    affine parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 24)
        self.f1 = nn.Sequential(
            nn.LayerNorm(24, elementwise_affine=False), nn.Linear(24, 24, bias=False), nn.GELU()
        )
        self.f2 = nn.Sequential(
            nn.LayerNorm(24, elementwise_affine=False), nn.Linear(24, 24, bias=False), nn.GELU()
        )
        self.alpha1 = nn.Parameter(torch.zeros(()))
        self.alpha2 = nn.Parameter(torch.tensor(0.1))
        self.out = nn.Linear(24, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        h = h + self.alpha1 * self.f1(h)
        h = h + self.alpha2 * self.f2(h)
        return self.out(h)


class FFTConv(nn.Module):
    """A long convolution through torch.fft with a learned filter, and a gate."""

    def __init__(self, tokens: int = 16, dim: int = 12) -> None:
        super().__init__()
        self.filt = nn.Parameter(0.1 * torch.randn(dim, tokens))
        self.proj = nn.Linear(dim, 2 * dim)
        self.out = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        u, gate = self.proj(x).chunk(2, -1)
        n = 2 * x.shape[0]
        y = torch.fft.irfft(torch.fft.rfft(u.T, n=n) * torch.fft.rfft(self.filt, n=n), n=n)[:, : x.shape[0]].T
        return self.out(y * torch.sigmoid(gate))


class Spectral(nn.Module):
    """A spectrally normalised layer (its power iteration vector is a buffer updated at every forward)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.utils.parametrizations.spectral_norm(nn.Linear(12, 24))
        self.b = nn.Linear(24, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.silu(self.a(x)))


# -- batch E: the shapes of Megatron-style code (written as forks and ports write them, not with TE) -------------
class LNLinear(nn.Module):
    """A norm and a linear in one module (TE's LayerNormLinear as a fork writes it): its parameters multiply."""

    def __init__(self, din: int, dout: int) -> None:
        super().__init__()
        self.layer_norm_weight = nn.Parameter(torch.ones(din))
        self.layer_norm_bias = nn.Parameter(torch.zeros(din))
        self.weight = nn.Parameter(torch.randn(dout, din) / math.sqrt(din))
        self.bias = nn.Parameter(torch.randn(dout) * 0.02)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.layer_norm(x, x.shape[-1:], self.layer_norm_weight, self.layer_norm_bias)
        return F.linear(h, self.weight, self.bias)


class RowLinear(nn.Module):
    """`skip_bias_add`: the bias is returned to the caller, which adds it (fused bias-dropout-add)."""

    def __init__(self, din: int, dout: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dout, din) / math.sqrt(din))
        self.bias = nn.Parameter(torch.randn(dout) * 0.02)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return F.linear(x, self.weight), self.bias


class OutputLayer(nn.Module):
    """Megatron's output layer: computes with the `weight` passed in (the word embeddings' when tied)."""

    def __init__(self, din: int, dout: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(dout, din) / math.sqrt(din))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        return F.linear(x, self.weight if weight is None else weight)


class MegatronGPT(nn.Module):
    """Word and position embeddings, layers of LNLinear qkv -> causal attention -> RowLinear proj (bias added by
    the caller) and LNLinear fc1 -> GELU -> RowLinear fc2, a final LayerNorm, the output layer tied or not."""

    def __init__(self, tied: bool = True, layers: int = 2, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads, self.tied = heads, tied
        self.word = nn.Embedding(40, dim)
        self.position = nn.Embedding(8, dim)
        self.qkv = nn.ModuleList(LNLinear(dim, 3 * dim) for _ in range(layers))
        self.proj = nn.ModuleList(RowLinear(dim, dim) for _ in range(layers))
        self.fc1 = nn.ModuleList(LNLinear(dim, 4 * dim) for _ in range(layers))
        self.fc2 = nn.ModuleList(RowLinear(4 * dim, dim) for _ in range(layers))
        self.final = nn.LayerNorm(dim)
        self.output = OutputLayer(dim, 40)
        for emb in (self.word, self.position):  # Megatron's init_method_std
            nn.init.normal_(emb.weight, std=0.02)
        if tied:
            del self.output.weight
            self.output.register_parameter("weight", None)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        b, t = idx.shape
        x = self.word(idx) + self.position(torch.arange(t))
        hd = x.shape[-1] // self.heads
        for k in range(len(self.qkv)):
            q, key, v = self.qkv[k](x).view(b, t, 3, self.heads, hd).unbind(2)
            att = F.scaled_dot_product_attention(
                q.transpose(1, 2), key.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            out, bias = self.proj[k](att.transpose(1, 2).reshape(b, t, -1))
            x = x + F.dropout(out + bias, 0.0, self.training)
            out, bias = self.fc2[k](F.gelu(self.fc1[k](x)))
            x = x + F.dropout(out + bias, 0.0, self.training)
        h = self.final(x)
        return self.output(h, self.word.weight) if self.tied else self.output(h)


class ZeroCenteredRMSNorm(nn.Module):
    """gamma stored as (gamma - 1), initialised to 0 (Megatron's `apply_layernorm_1p`)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * (1 + self.weight)


class SwiGLUNet(nn.Module):
    """Zero-centred RMSNorms, one fused gate-and-up projection split in two, an untied output layer."""

    def __init__(self, layers: int = 2, dim: int = 24) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, dim)
        self.norms = nn.ModuleList(ZeroCenteredRMSNorm(dim) for _ in range(layers))
        self.gate_up = nn.ModuleList(nn.Linear(dim, 4 * dim, bias=False) for _ in range(layers))
        self.down = nn.ModuleList(nn.Linear(2 * dim, dim, bias=False) for _ in range(layers))
        self.final = ZeroCenteredRMSNorm(dim)
        self.output = nn.Linear(dim, 40, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for norm, gate_up, down in zip(self.norms, self.gate_up, self.down, strict=True):
            g, u = gate_up(norm(x)).chunk(2, -1)
            x = x + down(F.silu(g) * u)
        return self.output(self.final(x))


class GroupedExperts(nn.Module):
    """Expert weights as 3-D parameters, applied per expert to the tokens routed to it (GroupedMLP)."""

    def __init__(self, experts: int, dim: int, ffn: int) -> None:
        super().__init__()
        self.weight1 = nn.Parameter(torch.randn(experts, dim, 2 * ffn) / math.sqrt(dim))
        self.weight2 = nn.Parameter(torch.randn(experts, ffn, dim) / math.sqrt(ffn))

    def forward(self, x: torch.Tensor, slots: list[torch.Tensor], probs: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(x)
        for e, tok in enumerate(slots):
            if tok.numel():
                g, u = (x[tok] @ self.weight1[e]).chunk(2, -1)
                out = out.index_add(0, tok, probs[tok, e : e + 1] * ((F.silu(g) * u) @ self.weight2[e]))
        return out


class GroupedMoE(nn.Module):
    """Top-2 routing with a capacity (tokens over it dropped), grouped experts, a shared expert behind a
    sigmoid gate, a router without bias; the last expert is masked out of the routing (it never gets a token)."""

    def __init__(self, dim: int = 12, experts: int = 4, ffn: int = 16) -> None:
        super().__init__()
        self.inp = nn.Linear(12, dim)
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = GroupedExperts(experts, dim, ffn)
        self.shared = nn.Sequential(nn.Linear(dim, ffn), nn.GELU(), nn.Linear(ffn, dim))
        self.shared_gate = nn.Linear(dim, 1, bias=False)
        self.out = nn.Linear(dim, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        logits = self.router(h)
        n = logits.shape[-1]
        logits = logits.masked_fill(torch.arange(n) == n - 1, -1e4)
        probs = logits.float().softmax(-1).to(h.dtype)
        chosen = probs.topk(2, -1).indices
        capacity = max(1, (2 * h.shape[0]) // (n - 1))
        slots = [(chosen == e).any(-1).nonzero(as_tuple=True)[0][:capacity] for e in range(n)]
        shared = self.shared(h) * torch.sigmoid(self.shared_gate(h))
        return self.out(h + self.experts(h, slots, probs) + shared)


class LatentAttention(nn.Module):
    """Low-rank query and key-value projections with norms between (MLA), rotary embeddings on part of the
    head, and separate rotary key projections."""

    def __init__(self, dim: int = 32, heads: int = 4, rank: int = 12, rope: int = 4) -> None:
        super().__init__()
        self.heads, self.rope = heads, rope
        hd = dim // heads
        self.emb = nn.Embedding(40, dim)
        self.q_down = nn.Linear(dim, rank, bias=False)
        self.q_norm = RMSNorm(rank)
        self.q_up = nn.Linear(rank, heads * (hd + rope), bias=False)
        self.kv_down = nn.Linear(dim, rank + rope, bias=False)
        self.kv_norm = RMSNorm(rank)
        self.kv_up = nn.Linear(rank, heads * 2 * hd, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.head = nn.Linear(dim, 40)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        b, t, d = x.shape
        hd = d // self.heads
        q = self.q_up(self.q_norm(self.q_down(x))).view(b, t, self.heads, hd + self.rope).transpose(1, 2)
        kv, k_rope = self.kv_down(x).split([self.kv_down.out_features - self.rope, self.rope], -1)
        key, value = self.kv_up(self.kv_norm(kv)).view(b, t, self.heads, 2 * hd).transpose(1, 2).chunk(2, -1)
        k_rope = _rope(k_rope[:, None].expand(b, self.heads, t, self.rope))
        q = torch.cat([q[..., :hd], _rope(q[..., hd:])], -1)
        key = torch.cat([key, k_rope], -1)
        value = F.pad(value, (0, self.rope))
        att = F.scaled_dot_product_attention(q, key, value, is_causal=True)[..., :hd]
        return self.head(x + self.o(att.transpose(1, 2).reshape(b, t, d)))


class SelectiveScan(nn.Module):
    """A Mamba-style mixer: input projection, causal depthwise conv, input-dependent step and state matrices,
    `A_log`, `D` and `dt_bias` used outside any Linear, a sequential scan, gated output projection."""

    def __init__(self, dim: int = 16, inner: int = 24, state: int = 4, rank: int = 4) -> None:
        super().__init__()
        self.state, self.rank = state, rank
        self.emb = nn.Embedding(40, dim)
        self.norm = RMSNorm(dim)
        self.in_proj = nn.Linear(dim, 2 * inner, bias=False)
        self.conv = nn.Conv1d(inner, inner, 4, groups=inner, padding=3)
        self.x_proj = nn.Linear(inner, rank + 2 * state, bias=False)
        self.dt_proj = nn.Linear(rank, inner, bias=False)
        self.dt_bias = nn.Parameter(torch.rand(inner) * 0.5 - 2.0)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, state + 1, dtype=torch.float32)).repeat(inner, 1))
        self.D = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, dim, bias=False)
        self.head = nn.Linear(dim, 40)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        b, t, _ = x.shape
        u, z = self.in_proj(self.norm(x)).chunk(2, -1)
        u = F.silu(self.conv(u.transpose(1, 2))[..., :t].transpose(1, 2))
        dt, bm, cm = self.x_proj(u).split([self.rank, self.state, self.state], -1)
        dt = F.softplus(self.dt_proj(dt) + self.dt_bias)  # [b, t, inner]
        a = -torch.exp(self.A_log.float())  # [inner, state]
        h = u.new_zeros(b, u.shape[-1], self.state)
        ys = []
        for s in range(t):
            h = (
                torch.exp(dt[:, s, :, None] * a) * h
                + dt[:, s, :, None] * bm[:, s, None, :] * u[:, s, :, None]
            )
            ys.append((h * cm[:, s, None, :]).sum(-1) + self.D * u[:, s])
        y = torch.stack(ys, 1) * F.silu(z)
        return self.head(x + self.out_proj(y))


class BertMLM(nn.Module):
    """Post-norm encoder with word, position and token-type embeddings (type 1 never used), an MLM head whose
    decoder is the word embeddings plus a bias parameter of its own, a pooler and a binary head; the loss is the
    sum of both (`bert_loss`)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.word = nn.Embedding(40, dim)
        self.position = nn.Embedding(8, dim)
        self.types = nn.Embedding(2, dim)
        self.emb_norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.o = nn.Linear(dim, dim)
        self.norm1 = nn.LayerNorm(dim)
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.norm2 = nn.LayerNorm(dim)
        self.transform = nn.Linear(dim, dim)
        self.transform_norm = nn.LayerNorm(dim)
        self.lm_bias = nn.Parameter(torch.zeros(40))
        self.pooler = nn.Linear(dim, dim)
        self.binary = nn.Linear(dim, 2)
        for emb in (self.word, self.position, self.types):
            nn.init.normal_(emb.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t = idx.shape
        x = self.emb_norm(self.word(idx) + self.position(torch.arange(t)) + self.types(torch.zeros_like(idx)))
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, -1).transpose(1, 3).unbind(2)
        att = F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, -1)
        x = self.norm1(x + self.o(att))
        x = self.norm2(x + self.fc2(F.gelu(self.fc1(x))))
        h = self.transform_norm(F.gelu(self.transform(x)))
        logits = F.linear(h, self.word.weight) + self.lm_bias
        return logits, self.binary(torch.tanh(self.pooler(x[:, 0])))


def bert_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, target = batch
    logits, binary = model(x)
    lm = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), target.reshape(-1))
    return lm + F.cross_entropy(binary.float(), x[:, 0] % 2)


class QKNormGPT(nn.Module):
    """Per-head LayerNorms on queries and keys (QK layernorm), learned absolute positions as a raw parameter."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.emb = nn.Embedding(40, dim)
        self.pos = nn.Parameter(torch.randn(8, dim) * 0.02)
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.q_norm, self.k_norm = nn.LayerNorm(dim // heads), nn.LayerNorm(dim // heads)
        self.o = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, 40, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos[: idx.shape[1]]
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, t, 3, self.heads, -1).transpose(1, 3).unbind(2)
        att = F.scaled_dot_product_attention(self.q_norm(q), self.k_norm(k), v, is_causal=True)
        return self.head(x + self.o(att.transpose(1, 2).reshape(b, t, d)))


class MultiTokenPrediction(nn.Module):
    """A trunk and a multi-token-prediction module (the next token's embedding joined to the hidden state,
    projected, one more layer) sharing the embeddings and the output head; `mtp_loss` weighs its loss 0.3."""

    def __init__(self, dim: int = 24) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, dim)
        self.trunk = nn.Sequential(
            nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim)
        )
        self.h_norm, self.e_norm = RMSNorm(dim), RMSNorm(dim)
        self.mtp_proj = nn.Linear(2 * dim, dim, bias=False)
        self.mtp_layer = nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, dim), nn.GELU())
        self.final = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 40, bias=False)

    def forward(self, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.emb(idx)
        h = x + self.trunk(x)
        nxt = self.emb(torch.roll(idx, -1, 1))
        m = self.mtp_proj(torch.cat([self.h_norm(h), self.e_norm(nxt)], -1))
        m = m + self.mtp_layer(m)
        return self.head(self.final(h)), self.head(self.final(m))


def mtp_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, target = batch
    main, mtp = model(x)
    main_loss = F.cross_entropy(main.float().reshape(-1, 40), target.reshape(-1))
    return main_loss + 0.3 * F.cross_entropy(
        mtp.float().reshape(-1, 40), torch.roll(target, -1, 1).reshape(-1)
    )


class Recomputed(nn.Module):
    """Layers under activation recompute (`torch.utils.checkpoint`): their forward runs again in the backward."""

    def __init__(self, reentrant: bool, layers: int = 2, dim: int = 24) -> None:
        super().__init__()
        self.reentrant = reentrant
        self.emb = nn.Embedding(40, dim)
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(dim), nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, 40)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for layer in self.layers:
            x = x + torch.utils.checkpoint.checkpoint(layer, x, use_reentrant=self.reentrant)
        return self.head(x)


class TransposedLinear(nn.Module):
    """A linear whose weight is stored [in, out] and applied as x @ w + b (not nn.Linear's layout)."""

    def __init__(self, din: int, dout: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.randn(din, dout) / math.sqrt(din))
        self.b = nn.Parameter(torch.zeros(dout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + self.b


class Transposed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = TransposedLinear(12, 32), TransposedLinear(32, 32), TransposedLinear(32, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(F.gelu(self.b(F.gelu(self.a(x)))))


# -- batch F -------------------------------------------------------------------------------------------------
class MaxNormEmbedding(nn.Module):
    """An embedding with max_norm: its forward renormalises the rows it looks up, in place, under no_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16, max_norm=1.0)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(x))))


class Orthogonal(nn.Module):
    """torch.nn.utils.parametrizations.orthogonal: the layer computes with a matrix derived from `original`."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(12, 16)
        self.rot = torch.nn.utils.parametrizations.orthogonal(nn.Linear(16, 16))
        self.out = nn.Linear(16, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.tanh(self.rot(torch.tanh(self.inp(x)))))


class SDPABlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.fc = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc(self.ln2(x))


class SDPAGPT(nn.Module):
    """A GPT whose attention is F.scaled_dot_product_attention (causal), untied head."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 32)
        self.pos = nn.Parameter(0.02 * torch.randn(8, 32))
        self.blocks = nn.ModuleList(SDPABlock(32, 4) for _ in range(2))
        self.ln = nn.LayerNorm(32)
        self.head = nn.Linear(32, 40, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.emb(x) + self.pos[: x.shape[1]]
        for block in self.blocks:
            h = block(h)
        return self.head(self.ln(h))


class LayerScaleViT(nn.Module):
    """CaiT-style layer scale: each residual branch multiplied by a per-channel weight initialised to 1e-4."""

    def __init__(self) -> None:
        super().__init__()
        self.patch = nn.Conv2d(3, 24, 3, stride=3)
        self.pos = nn.Parameter(0.02 * torch.randn(1, 4, 24))
        self.ln1, self.ln2 = nn.LayerNorm(24), nn.LayerNorm(24)
        self.attn = nn.MultiheadAttention(24, 4, batch_first=True)
        self.mlp = nn.Sequential(nn.Linear(24, 48), nn.GELU(), nn.Linear(48, 24))
        self.gamma1 = nn.Parameter(1e-4 * torch.ones(24))
        self.gamma2 = nn.Parameter(1e-4 * torch.ones(24))
        self.head = nn.Linear(24, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.patch(x.to(self.patch.weight.dtype)).flatten(2).transpose(1, 2) + self.pos
        a = self.ln1(h)
        h = h + self.gamma1 * self.attn(a, a, a, need_weights=False)[0]
        h = h + self.gamma2 * self.mlp(self.ln2(h))
        return self.head(h.mean(1))


class HyperNet(nn.Module):
    """The main layer's weight is generated from a learned code by another layer (not a parameter itself)."""

    def __init__(self) -> None:
        super().__init__()
        self.code = nn.Parameter(torch.randn(6))
        self.gen = nn.Linear(6, 12 * 12)
        self.bias = nn.Parameter(torch.zeros(12))
        self.out = nn.Linear(12, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.gen(self.code).view(12, 12) / 4
        return self.out(torch.tanh(F.linear(x, w, self.bias)))


class Contrastive(nn.Module):
    """CLIP-style: two towers, normalised features, a learned temperature; the loss couples a micro-batch's rows."""

    def __init__(self) -> None:
        super().__init__()
        self.image = nn.Sequential(nn.Linear(12, 24), nn.GELU(), nn.Linear(24, 16))
        self.text = nn.Sequential(nn.Linear(12, 24), nn.Tanh(), nn.Linear(24, 16))
        self.logit_scale = nn.Parameter(torch.tensor(math.log(1 / 0.07)))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        a, b = F.normalize(self.image(x), dim=-1), F.normalize(self.text(y), dim=-1)
        return self.logit_scale.exp() * a @ b.t()


def contrastive_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    logits = model(x, y).float()
    labels = torch.arange(logits.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.t(), labels)) / 2


class Regularised(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(12, 32), nn.SiLU(), nn.Linear(32, 32), nn.SiLU(), nn.Linear(32, 12)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def l2_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    """MSE plus an L2 penalty on the weights computed in the loss (weight decay written by hand)."""
    penalty = sum((p.float() ** 2).sum() for n, p in model.named_parameters() if n.endswith("weight"))
    return mse(model, batch) + 1e-3 * penalty


def padded_tokens(n: int, seed: int) -> list[Batch]:
    """Token batches whose targets are padded with -100 from a per-row length (packed sequences): each
    micro-batch's mean runs over a different number of tokens."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, 40, (3, 8), generator=gen)
        y = torch.randint(0, 40, (3, 8), generator=gen)
        lengths = torch.randint(3, 9, (3,), generator=gen)
        y[torch.arange(8)[None, :] >= lengths[:, None]] = -100
        out.append((x, y))
    return out


def ignore_index_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, target = batch
    logits = model(x).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), ignore_index=-100)


class PackedLSTM(nn.Module):
    """An LSTM over pack_padded_sequence: each row stops at its own length (from its padding)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(40, 16)
        self.rnn = nn.LSTM(16, 24, batch_first=True)
        self.head = nn.Linear(24, 40)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        lengths = 8 - (x == 0).long().cumprod(1).sum(1).clamp(max=5)  # leading padding shortens a row
        packed = nn.utils.rnn.pack_padded_sequence(
            self.emb(x), lengths, batch_first=True, enforce_sorted=False
        )
        out, _ = self.rnn(packed)
        h, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=x.shape[1])
        return self.head(h)


class GraphNet(nn.Module):
    """Message passing with index_add_ over a fixed ring-and-chords graph, then a mean readout per row."""

    def __init__(self) -> None:
        super().__init__()
        n = 12
        src = torch.cat([torch.arange(n), torch.arange(n), torch.arange(0, n, 3)])
        dst = torch.cat(
            [(torch.arange(n) + 1) % n, (torch.arange(n) - 1) % n, (torch.arange(0, n, 3) + 5) % n]
        )
        self.register_buffer("src", src)
        self.register_buffer("dst", dst)
        self.embed = nn.Linear(1, 16)
        self.msg = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.upd = nn.ModuleList(nn.Linear(32, 16) for _ in range(2))
        self.out = nn.Linear(16, 12)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.embed(x.unsqueeze(-1)))  # (rows, nodes, 16)
        for msg, upd in zip(self.msg, self.upd, strict=True):
            m = msg(h)[:, self.src]
            agg = torch.zeros_like(h).index_add_(1, self.dst, m)
            h = torch.tanh(upd(torch.cat([h, agg], -1)))
        return self.out(h.mean(1))


class Flow(nn.Module):
    """An invertible linear and an affine coupling: the loss is a negative log-likelihood with log|det W|."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.eye(12) + 0.1 * torch.randn(12, 12))
        self.net = nn.Sequential(nn.Linear(6, 24), nn.Tanh(), nn.Linear(24, 12))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = x @ self.w.t()
        a, b = z[:, :6], z[:, 6:]
        s, t = self.net(a).chunk(2, -1)
        s = torch.tanh(s)
        return torch.cat([a, b * s.exp() + t], -1), torch.linalg.slogdet(self.w)[1] + s.sum(-1)


def flow_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    z, logdet = model(batch[0])
    return (0.5 * (z.float() ** 2).sum(-1) - logdet.float()).mean()


class ConvTransposeDecoder(nn.Module):
    """A code up-sampled by two ConvTranspose1d (with a BatchNorm between) into a row of 12."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(12, 8 * 3)
        self.up1 = nn.ConvTranspose1d(8, 8, 2, stride=2)
        self.bn = nn.BatchNorm1d(8)
        self.up2 = nn.ConvTranspose1d(8, 1, 2, stride=2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc(x).view(-1, 8, 3)
        h = F.gelu(self.bn(self.up1(h)))
        return self.up2(h).view(-1, 12)


# -- batches and losses --------------------------------------------------------------------------------------
def tokens(n: int, seed: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randint(0, 40, (3, 8), generator=gen)
        x[:, :2] = torch.where(torch.rand(3, 2, generator=gen) < 0.3, 0, x[:, :2])  # some padding
        out.append((x, torch.randint(0, 40, (3, 8), generator=gen)))
    return out


def rows(n: int, seed: int) -> list[Batch]:
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 12, generator=gen), torch.randn(16, 12, generator=gen)) for _ in range(n)]


def rows_bf16(n: int, seed: int) -> list[Batch]:
    return [(x.bfloat16(), y) for x, y in rows(n, seed)]


def images(size: int, channels: int = 3, batch: int = 6) -> Callable[[int, int], list[Batch]]:
    def make(n: int, seed: int) -> list[Batch]:
        gen = torch.Generator().manual_seed(seed)
        return [
            (
                torch.randn(batch, channels, size, size, generator=gen),
                torch.randint(0, 5, (batch,), generator=gen),
            )
            for _ in range(n)
        ]

    return make


def cross_entropy(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, target = batch
    logits = model(x).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def mse(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return ((model(x).float() - y) ** 2).mean()


@dataclass(frozen=True)
class WildCase:
    name: str
    make: Callable[[], nn.Module]
    loss: Callable[[nn.Module, Batch], torch.Tensor]
    batches: Callable[[int, int], list[Batch]]
    batch: str  # "A" .. "E"
    # the forward writes a buffer it computes with (spectral norm's power iteration: the sequence's later
    # micro-batches see it moved, as in training) or a parameter (an Embedding's max_norm: the finite differences
    # cannot judge it), so a correct model may end inconclusive on that account
    stateful: bool = False


CASES: dict[str, WildCase] = {
    c.name: c
    for c in [
        WildCase("encoder-mha", Encoder, cross_entropy, tokens, "A"),
        WildCase("lstm", lambda: Recurrent("lstm"), cross_entropy, tokens, "A"),
        WildCase("gru", lambda: Recurrent("gru"), cross_entropy, tokens, "A"),
        WildCase("resnet-batchnorm", ResNetBN, cross_entropy, images(6), "A"),
        WildCase("llama-gqa", Llama, cross_entropy, tokens, "A"),
        WildCase("llama-gqa-bf16", lambda: Llama().bfloat16(), cross_entropy, tokens, "A"),
        WildCase("albert-shared", Albert, cross_entropy, tokens, "A"),
        WildCase("frozen-temperature", Frozen, mse, rows, "A"),
        WildCase("bilinear-prelu-depthwise", BilinearNet, mse, rows, "A"),
        WildCase("top2-moe-capacity", Top2MoE, mse, rows, "A"),
        WildCase("weight-norm", WeightNormed, mse, rows, "A"),
        WildCase("mixed-bf16-fp32", MixedHead, mse, rows, "A"),
        WildCase("padding-embedding-bag", PadEmbedding, cross_entropy, tokens, "A"),
        WildCase("convnext", ConvNeXt, cross_entropy, images(8, batch=4), "B"),
        WildCase("vit-prenorm", ViT, cross_entropy, images(6, batch=4), "B"),
        WildCase("t5-relative-bias", RelativeBias, cross_entropy, tokens, "B"),
        WildCase("wavenet", WaveNet, mse, rows, "B"),
        WildCase("linear-recurrence", LinearRecurrence, mse, rows, "B"),
        WildCase("softcap-tied", SoftCapped, cross_entropy, tokens, "B"),
        WildCase("softcap-tied-bf16", lambda: SoftCapped().bfloat16(), cross_entropy, tokens, "B"),
        WildCase("unet-groupnorm", UNet, cross_entropy, images(6), "B"),
        WildCase("mixer", Mixer, mse, rows, "B"),
        WildCase("mixer-bf16", lambda: Mixer().bfloat16(), mse, rows_bf16, "B"),
        WildCase("highway-shared", Highway, mse, rows, "B"),
        WildCase("lora-einsum", LoRA, mse, rows, "B"),
        WildCase("mlp-batchnorm", mlp_batchnorm, mse, rows, "C"),
        WildCase("mlp-batchnorm-bf16", lambda: mlp_batchnorm().bfloat16(), mse, rows_bf16, "C"),
        WildCase("perceiver-latents", Perceiver, cross_entropy, tokens, "D"),
        WildCase("decoder-postnorm", Decoder, cross_entropy, tokens, "D"),
        WildCase("decoder-postnorm-bf16", lambda: Decoder().bfloat16(), cross_entropy, tokens, "D"),
        WildCase("conv-instancenorm", InstanceNormConv, mse, rows, "D"),
        WildCase("gru-cell-loop", CellLoop, cross_entropy, tokens, "D"),
        WildCase("tied-by-hand-dropout", TiedByHand, mse, rows, "D"),
        WildCase("rezero", ReZero, mse, rows, "D"),
        WildCase("rezero-bf16", lambda: ReZero().bfloat16(), mse, rows_bf16, "D"),
        WildCase("fft-long-conv", FFTConv, mse, rows, "D"),
        WildCase("spectral-norm", Spectral, mse, rows, "D", stateful=True),
        WildCase("megatron-gpt-tied", MegatronGPT, cross_entropy, tokens, "E"),
        WildCase("megatron-gpt-untied", lambda: MegatronGPT(tied=False), cross_entropy, tokens, "E"),
        WildCase("megatron-gpt-bf16", lambda: MegatronGPT().bfloat16(), cross_entropy, tokens, "E"),
        WildCase("swiglu-zero-centred", SwiGLUNet, cross_entropy, tokens, "E"),
        WildCase("swiglu-zero-centred-bf16", lambda: SwiGLUNet().bfloat16(), cross_entropy, tokens, "E"),
        WildCase("grouped-moe", GroupedMoE, mse, rows, "E"),
        WildCase("grouped-moe-bf16", lambda: GroupedMoE().bfloat16(), mse, rows_bf16, "E"),
        WildCase("latent-attention", LatentAttention, cross_entropy, tokens, "E"),
        WildCase("selective-scan", SelectiveScan, cross_entropy, tokens, "E"),
        WildCase("bert-mlm", BertMLM, bert_loss, tokens, "E"),
        WildCase("qk-layernorm", QKNormGPT, cross_entropy, tokens, "E"),
        WildCase("multi-token-prediction", MultiTokenPrediction, mtp_loss, tokens, "E"),
        WildCase("recompute", lambda: Recomputed(False), cross_entropy, tokens, "E"),
        WildCase("recompute-reentrant", lambda: Recomputed(True), cross_entropy, tokens, "E"),
        WildCase("transposed-linear", Transposed, mse, rows, "E"),
        WildCase("embedding-max-norm", MaxNormEmbedding, cross_entropy, tokens, "F", stateful=True),
        WildCase("orthogonal-parametrization", Orthogonal, mse, rows, "F"),
        WildCase("sdpa-gpt", SDPAGPT, cross_entropy, tokens, "F"),
        WildCase("sdpa-gpt-bf16", lambda: SDPAGPT().bfloat16(), cross_entropy, tokens, "F"),
        WildCase("layerscale-vit", LayerScaleViT, cross_entropy, images(6, batch=4), "F"),
        WildCase(
            "layerscale-vit-bf16", lambda: LayerScaleViT().bfloat16(), cross_entropy, images(6, batch=4), "F"
        ),
        WildCase("hypernetwork", HyperNet, mse, rows, "F"),
        WildCase("contrastive-temperature", Contrastive, contrastive_loss, rows, "F"),
        WildCase("l2-in-loss", Regularised, l2_loss, rows, "F"),
        WildCase("ignore-index-padding", SDPAGPT, ignore_index_loss, padded_tokens, "F"),
        WildCase("lstm-packed", PackedLSTM, cross_entropy, tokens, "F"),
        WildCase("graph-index-add", GraphNet, mse, rows, "F"),
        WildCase("flow-logdet", Flow, flow_loss, rows, "F"),
        WildCase("conv-transpose-batchnorm", ConvTransposeDecoder, mse, rows, "F"),
    ]
}

SEEDS = {
    "A": (0, 1, 2), "B": (3, 4, 5), "C": tuple(range(6, 16)), "D": (20, 21, 22), "E": (50, 51, 52), "F": (60, 61, 62)
}  # fmt: skip
# drawn after every rule and threshold was set, and run once before this file's target picker was mended (the
# only change they led to): the population's held-out part, graded like the rest
HELD_OUT_SEEDS = {
    "A": (30, 31, 32), "B": (33, 34, 35), "C": tuple(range(36, 46)), "D": (46, 47, 48), "E": (53, 54, 55),
    "F": (63, 64, 65),
}  # fmt: skip


def _zeroed(model: nn.Module, name: str) -> None:
    dict(model.named_parameters())[name].register_hook(lambda g: g * 0)


# Misses the population finds and the tests hold as such (strict xfail: a case that starts passing fails them).
# Keys: (case, seed, bug, True where only the loss-level probe after the screening misses it). `unused` needs
# the loss unchanged bit for bit, so a zeroed gradient whose whole effect stays within the loss's noise (a
# selective scan's A_log, held-out seed 55; a zero-initialised (1 + w) norm weight in bf16, seed 54 on the
# forced late path) is `inconclusive` with that bound: a visible miss. Where the effect rounds away whole, the
# loss cannot tell: only a module-local rerun can (none held now).
KNOWN_MISSES: dict[tuple[str, int, str, bool], str] = {}


# bug -> (inject(model, parameter name), the anomaly it must get or None for any, the factor it applies)
BUGS: dict[str, tuple[Callable[[nn.Module, str], None], str | None, float | None]] = {
    "x2": (scale(2.0), "grad_scaled", 2.0),
    "x0.5": (scale(0.5), "grad_scaled", 0.5),
    "x1.3": (scale(1.3), "grad_scaled", 1.3),
    "sign": (scale(-1.0), None, -1.0),
    "zeroed": (_zeroed, "grad_lost", 0.0),
    "overwrite": (overwrite, "grad_overwritten", None),
    "every-second-halved": (every_second_halved, "grad_inconsistent", None),
    "later-doubled": (later_doubled, "grad_inconsistent", None),
    "third-lost": (third_only_lost, "grad_inconsistent", None),
}
BUGS_OF = {
    "A": ("x2", "x0.5", "x1.3", "zeroed"),
    "B": ("x2", "x0.5", "sign", "overwrite", "every-second-halved", "later-doubled", "third-lost"),
    "C": ("x2", "x0.5", "zeroed", "overwrite", "every-second-halved"),
    "D": ("x2", "x0.5", "x1.3", "sign", "zeroed", "overwrite", "every-second-halved", "third-lost"),
    "E": (
        "x2",
        "x0.5",
        "x1.3",
        "sign",
        "zeroed",
        "overwrite",
        "every-second-halved",
        "later-doubled",
        "third-lost",
    ),
}
BUGS_OF["F"] = BUGS_OF["E"]


def target(case: WildCase, model: nn.Module, seed: int) -> str:
    """A parameter drawn (seeded) from those with a gradient on one micro-batch, in float64: a bias that a
    normalisation removes has a gradient of rounding in the model's own dtype, and no bug to inject."""
    x, y = case.batches(1, 100 + seed)[0]
    exact = copy.deepcopy(model).double()
    try:  # (class labels stay integers: a cast of them fails and would leave the model in its own dtype)
        case.loss(exact, tuple(t.double() if t.is_floating_point() else t for t in (x, y))).backward()
    except RuntimeError:  # a forward that casts to its own dtype (the mixed bf16/fp32 one): as it is
        exact = copy.deepcopy(model)
        case.loss(exact, (x, y)).backward()
    norms = {n: float(p.grad.norm()) for n, p in exact.named_parameters() if p.grad is not None}
    largest = max(norms.values())
    live = [n for n, g in norms.items() if g > 1e-9 * largest]
    return random.Random(seed).choice(live)


def build(case: WildCase, seed: int, bug: str | None) -> tuple[nn.Module, str | None]:
    torch.manual_seed(seed)
    model = case.make()
    if bug is None:
        return model, None
    name = target(case, model, seed)
    BUGS[bug][0](model, name)
    return model, name


# batch E's own module classes whose forward is affine in each parameter (or a product of two: a norm's weight
# times a linear weight), computed from their inputs and parameters alone: what a fork would pass as
# `module_fd_classes` (not GroupedExperts: a SiLU between its two weights)
DECLARED = (LNLinear, RowLinear, OutputLayer, ZeroCenteredRMSNorm, TransposedLinear)

PASSING = ("pass", "stateful-inconclusive")  # the grades a correct model may get
CAUGHT = ("named", "visible-miss")  # the grades a bug may get


def grade(
    name: str, seed: int, bug: str | None, declared: bool = False
) -> tuple[str, PreflightResult, str | None]:
    """One call on a case, graded (with the result and the bug's target). A correct model: `pass`, or
    `stateful-inconclusive` (a stateful forward, inconclusive only on account of the buffers it writes), else
    `inconclusive`, `error` or `false-alarm`. A bug: `wrong-blame` (another parameter named), `named` (on its
    parameter with the anomaly its kind must get; a scalar's singles are parallel, so which were kept cannot be
    told, only that the sum is off), `wrong-verdict`, `visible-miss` (only of a bug the finite differences must
    find, the runs name every accumulation bug, and visible on the parameter: inconclusive, or its
    `fd_resolution` admits the factor; a zeroed gradient never `unused`) or `silent-miss`. `declared`: with
    `module_fd_classes=DECLARED`."""
    case = CASES[name]
    model, target = build(case, seed, bug)
    result = preflight(
        model,
        microbatch(case.loss),
        case.batches(3, seed),
        loss_fn=case.loss,
        module_fd_classes=DECLARED if declared else (),
    )
    if bug is None:
        unsure = [p for p in result.params if p.inconclusive]
        if result.status == "pass":
            return "pass", result, None
        if case.stateful and result.status == "inconclusive":
            buffers = all(
                any(w in " ".join(p.notes) for w in ("the forward writes buffers", "the forward writes this"))
                for p in unsure
            )
            return ("stateful-inconclusive" if buffers else "inconclusive"), result, None
        return (result.status if result.status in ("inconclusive", "error") else "false-alarm"), result, None
    named = {p.name: p.anomalies for p in result.params if p.anomalies}
    _, code, factor = BUGS[bug]
    p = next(p for p in result.params if p.name == target)
    if not set(named) <= {target}:
        verdict = "wrong-blame"
    elif target in named:
        verdict = "named" if code is None or code in named[target] or p.numel == 1 else "wrong-verdict"
    elif factor is not None and (p.inconclusive or (factor != 0.0 and p.could_hide(factor))):
        verdict = "visible-miss"
    else:
        verdict = "silent-miss"
    return verdict, result, target
