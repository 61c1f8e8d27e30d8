"""LeRobot's ``lingbot_va`` implementation as the reference of the lingbot-va tests (tiny, random, offline).

LeRobot's training forward (``WanTransformer3DModel.forward_train``) runs on the CPU once
``FlexAttnFunc``'s class attributes hold the eager ``flex_attention`` / ``create_block_mask`` (its
compiled ones fail to build on the CPU); :func:`eager_flex` sets them for one test. Its attention
casts q/k/v to bfloat16 and its forward casts the inputs to bfloat16; :func:`fp32_attention` and
:class:`KeepInputs` undo both, so the same forward also runs in float32 over LeRobot's own masks.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest
import torch
from einops import rearrange

from flexpack.families.lingbot.config import LEROBOT_SHAPE, LingbotConfig

LU = pytest.importorskip("lerobot.policies.lingbot_va.utils", reason="the installed lerobot has no lingbot_va policy")
TEXT_TOKENS = 512  # LeRobot's cross-attention mask assumes 512 text tokens per clip


def eager_flex(monkeypatch) -> None:
    """LeRobot's FlexAttnFunc with eager FlexAttention and block-mask creation (CPU, forward only)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    monkeypatch.setattr(LU.FlexAttnFunc, "flex_attn", staticmethod(flex_attention))
    monkeypatch.setattr(LU.FlexAttnFunc, "compiled_create_block_mask",
                        staticmethod(lambda *a, _compile=None, **k: create_block_mask(*a, **k)))


def reference_model(cfg: LingbotConfig, seed: int = 0, attn_mode: str = "flex"):
    """LeRobot's ``WanTransformer3DModel`` of ``cfg``'s shape, random, with every norm weight and
    modulation table moved off its init so that each parameter carries signal."""
    torch.manual_seed(seed)
    fields = cfg.lerobot_fields()
    model = LU.WanTransformer3DModel(**{k: fields[k] for k in LEROBOT_SHAPE}, attn_mode=attn_mode).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


class _FP32Flex(torch.nn.Module):
    """LeRobot's flex attention op without its bfloat16 cast: eager FlexAttention over the block mask
    LeRobot's ``init_mask`` built for this step."""

    def __init__(self, cross: bool) -> None:
        super().__init__()
        self.cross = cross

    def forward(self, q, k, v):  # (1, S, H, hd) each, as LeRobot's WanAttention passes them
        from torch.nn.attention.flex_attention import flex_attention

        bm = LU.FlexAttnFunc.cross_attention_mask if self.cross else LU.FlexAttnFunc.attention_mask
        out = flex_attention(*(x.transpose(1, 2) for x in (q, k, v)), block_mask=bm)
        return out.transpose(1, 2)


@contextmanager
def fp32_attention(model) -> Iterator[None]:
    """Every attention op of LeRobot's model in float32 (its own masks) while inside."""
    saved = [(b.attn1.attn_op, b.attn2.attn_op) for b in model.blocks]
    for b in model.blocks:
        b.attn1.attn_op, b.attn2.attn_op = _FP32Flex(False), _FP32Flex(True)
    try:
        yield
    finally:
        for b, (a1, a2) in zip(model.blocks, saved):
            b.attn1.attn_op, b.attn2.attn_op = a1, a2


class KeepInputs(dict):
    """A stream dict whose entries cannot be replaced: ``forward_train``'s bfloat16 casts of the inputs
    become no-ops, so a float32 model sees float32 inputs."""

    def __setitem__(self, key, value):
        if key not in self:
            super().__setitem__(key, value)


def train_inputs(cfg: LingbotConfig, lat, clean, act, act_clean, t, t_cond, t_act, t_act_cond, text, chunk, window,
                 keep: bool = False) -> dict:
    """LeRobot's ``forward_train`` input dict from clips: latents (B, C, F, H, W), actions (B, Ca, F, A),
    timesteps (B, F), text (B, 512, Dt); grid ids as ``_add_noise_stream`` makes them."""
    B, _, F, H, W = lat.shape
    A = act.shape[-1]
    _, ph, pw = cfg.patch_size
    stream = KeepInputs if keep else dict
    lgrid = LU.get_mesh_id(F, H // ph, W // pw, t=0)[None].repeat(B, 1, 1)
    agrid = LU.get_mesh_id(F, A, 1, t=1, action=True)[None].repeat(B, 1, 1)
    ld = stream(noisy_latents=lat, latent=clean, timesteps=t, cond_timesteps=t_cond, grid_id=lgrid, text_emb=text)
    ad = stream(noisy_latents=act[..., None], latent=act_clean[..., None], timesteps=t_act, cond_timesteps=t_act_cond,
                grid_id=agrid, text_emb=text)
    return {"latent_dict": ld, "action_dict": ad, "chunk_size": chunk, "window_size": window}


def outputs_to_grid(cfg: LingbotConfig, out: tuple, latent_shape: tuple) -> tuple[torch.Tensor, torch.Tensor]:
    """``forward_train``'s (latent, action) token outputs as (B, C, F, H, W) and (B, Ca, F, A)."""
    B, _, F, H, W = latent_shape
    lat = LU.data_seq_to_patch(cfg.patch_size, out[0], F, H, W, batch_size=B)
    return lat, rearrange(out[1], "b (f n) c -> b c f n", f=F)


def grid_to_outputs(cfg: LingbotConfig, video, action) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse of :func:`outputs_to_grid` (what ``_flow_matching_loss`` takes as ``pred``)."""
    _, ph, pw = cfg.patch_size
    lat = rearrange(video, "b c f (h ph) (w pw) -> b (f h w ph pw) c", ph=ph, pw=pw)
    return lat, rearrange(action, "b c f n -> b (f n) c")


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))
