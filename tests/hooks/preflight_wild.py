"""A second CPU population for maingrad.hooks.preflight, written after `preflight_zoo.py` and never tuned to:
37 architectures its author had not run preflight on, fp32 and bf16, each correct and with bugs on a parameter
drawn at random from those with a gradient in float64 (batches A-D below).

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
from preflight_zoo import every_second_halved, later_doubled, overwrite, scale, third_only_lost
from torch import nn

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
    batch: str  # "A" .. "D"
    # the forward writes a buffer it computes with (spectral norm's power iteration): the sequence's later
    # micro-batches see it moved, as in training, so a correct model may end inconclusive on that account
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
    ]
}

SEEDS = {"A": (0, 1, 2), "B": (3, 4, 5), "C": tuple(range(6, 16)), "D": (20, 21, 22)}
# drawn after every rule and threshold was set, and run once before this file's target picker was mended (the
# only change they led to): the population's held-out part, graded like the rest
HELD_OUT_SEEDS = {"A": (30, 31, 32), "B": (33, 34, 35), "C": tuple(range(36, 46)), "D": (46, 47, 48)}


def _zeroed(model: nn.Module, name: str) -> None:
    dict(model.named_parameters())[name].register_hook(lambda g: g * 0)


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
}


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
