"""Building blocks of :class:`~flexpack.models.backbone.WanBackbone`: norms, MLPs, timestep embedding, attention, block.

Hidden states inside a block are ``(U, K, D)``: ``U`` units (one per copy, row and latent frame)
of ``K`` tokens (video patches first, then action tokens), so AdaLN factors, given per unit and
stream as ``(U, S, D)`` (``S`` = 1 without actions, 2 with), broadcast over a unit's tokens.
Norms, modulation and gated residuals run in float32 and cast back (bf16-friendly).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from .rope import apply_rope


def layer_norm_fp32(x: Tensor, eps: float, weight: Tensor | None = None, bias: Tensor | None = None) -> Tensor:
    """LayerNorm in float32 (returns float32)."""
    w = weight.float() if weight is not None else None
    b = bias.float() if bias is not None else None
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps)


def stream_affine(x_UKD: Tensor, mul_USD: Tensor, add_USD: Tensor | None, nv: int) -> Tensor:
    """``x * mul (+ add)`` with per-(unit, stream) factors: slots ``[:nv]`` use stream 0, the rest stream 1.

    Broadcasting (U, 1, D) over the unit's slots keeps autograd from saving (T, D) factor copies.
    """
    if mul_USD.shape[1] == 1 or nv == x_UKD.shape[1]:
        out = x_UKD * mul_USD[:, :1]
        return out + add_USD[:, :1] if add_USD is not None else out
    parts = []
    for s, part in enumerate((x_UKD[:, :nv], x_UKD[:, nv:])):
        y = part * mul_USD[:, s : s + 1]
        parts.append(y + add_USD[:, s : s + 1] if add_USD is not None else y)
    return torch.cat(parts, dim=1)


class RMSNorm(nn.Module):
    """RMSNorm over the last dim, computed in float32 (q/k norm across all heads, as Wan)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class MLP(nn.Module):
    """Linear → GELU(tanh) → Linear (the FFN and Wan's text embedder)."""

    def __init__(self, d_in: int, d_hidden: int, d_out: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(d_in, d_hidden)
        self.fc2 = nn.Linear(d_hidden, d_out)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


class TimeEmbed(nn.Module):
    """Sinusoid (cos, sin order, max period 10⁴) → Linear → SiLU → Linear → temb; SiLU → Linear → 6·D modulation."""

    def __init__(self, freq_dim: int, dim: int) -> None:
        super().__init__()
        self.freq_dim = freq_dim
        self.fc1 = nn.Linear(freq_dim, dim)
        self.fc2 = nn.Linear(dim, dim)
        self.mod_proj = nn.Linear(dim, 6 * dim)

    def sinusoid(self, t_N: Tensor) -> Tensor:
        half = self.freq_dim // 2
        inv = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32, device=t_N.device) / half)
        ang = t_N.float()[:, None] * inv[None, :]
        emb = torch.cat([ang.cos(), ang.sin()], dim=-1)
        return F.pad(emb, (0, self.freq_dim % 2))  # (N, freq_dim)

    def forward(self, t_N: Tensor) -> tuple[Tensor, Tensor]:
        """Returns temb (N, D) and modulation (N, 6, D)."""
        emb = self.sinusoid(t_N).to(self.fc1.weight.dtype)
        temb = self.fc2(F.silu(self.fc1(emb)))
        return temb, self.mod_proj(F.silu(temb)).unflatten(-1, (6, -1))


class Attention(nn.Module):
    """Multi-head attention with q/k RMSNorm across heads, optional RoPE, through FlexAttnFunc."""

    def __init__(self, dim: int, num_heads: int, eps: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = RMSNorm(dim, eps)
        self.norm_k = RMSNorm(dim, eps)

    def forward(self, x_TD: Tensor, ctx_SD: Tensor, attend: Any, rope: tuple[Tensor, Tensor] | None) -> Tensor:
        """``attend(q, k, v)``: attention over the step's prepared mask
        (:meth:`~flexpack.attention.flex.FlexAttnFunc.bind`), q (1, H, T, hd), k/v (1, H, S, hd)."""
        H = self.num_heads
        q_THd = self.norm_q(self.q(x_TD)).unflatten(-1, (H, -1))
        k_SHd = self.norm_k(self.k(ctx_SD)).unflatten(-1, (H, -1))
        v_SHd = self.v(ctx_SD).unflatten(-1, (H, -1))
        if rope is not None:
            q_THd, k_SHd = apply_rope(q_THd, *rope), apply_rope(k_SHd, *rope)
        # the whole micro-batch is one sequence: (1, H, T, hd)
        o_1HTd = attend(q_THd.transpose(0, 1)[None], k_SHd.transpose(0, 1)[None], v_SHd.transpose(0, 1)[None])
        return self.o(o_1HTd[0].transpose(0, 1).flatten(1).to(x_TD.dtype))


class WanBlock(nn.Module):
    """AdaLN self-attention, cross-attention to text, AdaLN FFN; residuals gated per unit and stream."""

    def __init__(self, dim: int, num_heads: int, ffn_dim: int, eps: float, cross_attn_norm: bool) -> None:
        super().__init__()
        D = dim
        self.eps = eps
        # rows: shift, scale, gate (self-attn); shift, scale, gate (FFN) — Wan's order
        self.modulation = nn.Parameter(torch.randn(6, D) / D**0.5)
        self.self_attn = Attention(D, num_heads, eps)
        self.cross_norm_weight = nn.Parameter(torch.ones(D)) if cross_attn_norm else None
        self.cross_norm_bias = nn.Parameter(torch.zeros(D)) if cross_attn_norm else None
        self.cross_attn = Attention(D, num_heads, eps)
        self.ffn = MLP(D, ffn_dim, D)

    def forward(
        self,
        x_UKD: Tensor,
        mod_US6D: Tensor,
        text_SD: Tensor | None,
        rope: tuple[Tensor, Tensor],
        self_attend: Any,
        text_attend: Any,
        nv: int,
    ) -> Tensor:
        """One block; ``self_attend`` / ``text_attend`` are the step's bound attention calls
        (``(q, k, v) -> out``), decided outside so that a compiled block traces kernels only."""
        dt = x_UKD.dtype
        shift, scale, gate, c_shift, c_scale, c_gate = (self.modulation.float() + mod_US6D.float()).unbind(2)
        h = stream_affine(layer_norm_fp32(x_UKD, self.eps), 1 + scale, shift, nv).to(dt)
        a = self.self_attn(h.flatten(0, 1), h.flatten(0, 1), self_attend, rope).view_as(x_UKD)
        x_UKD = (x_UKD.float() + stream_affine(a, gate, None, nv)).to(dt)
        if text_SD is not None:
            if self.cross_norm_weight is not None:
                h = layer_norm_fp32(x_UKD, self.eps, self.cross_norm_weight, self.cross_norm_bias).to(dt)
            else:
                h = x_UKD
            x_UKD = x_UKD + self.cross_attn(h.flatten(0, 1), text_SD, text_attend, None).view_as(x_UKD)
        h = stream_affine(layer_norm_fp32(x_UKD, self.eps), 1 + c_scale, c_shift, nv).to(dt)
        f = self.ffn(h)
        return (x_UKD.float() + stream_affine(f.float(), c_gate, None, nv)).to(dt)
