"""LingBot-VA as LeRobot ships it (``lingbot_va``): the dual-stream Wan transformer over packed episodes.

:class:`LingbotVA` is LeRobot's ``WanTransformer3DModel`` (lerobot 0.6.1, ``policies/lingbot_va/utils.py``)
parameter for parameter — :mod:`flexpack.families.lingbot.convert` maps the names both ways — computed
by flexpack's Wan backbone (:class:`~flexpack.models.backbone.WanBackbone`, which
:class:`~flexpack.families.wan.model.WanVA` computes with too) over a :class:`~flexpack.packing.layout.TokenLayout`.
It differs from :class:`~flexpack.families.wan.model.WanVA` in four places, all LeRobot's:

* each stream has its own timestep embedder (``condition_embedder`` for video tokens,
  ``condition_embedder_action`` for action tokens); the action copy's text projection is in the
  checkpoint but never used (LeRobot projects the text with the video one), so it is kept frozen;
* one output (shift, scale) table for both streams, each stream adding its own timestep embedding;
* the input patch embedding is a Linear over ``(C, pt, ph, pw)`` (LeRobot's ``patch_embedding_mlp``);
* RoPE positions are LeRobot's grid ids (``get_mesh_id``): a video token of latent frame ``f`` at
  patch ``(h, w)`` is at ``(f, h, w)``; action step ``j`` of ``A`` in frame ``f`` is at
  ``(f + (j + 1) / (A + 1), -1, -1)``, so every step of a frame has a position of its own. The
  fractional frame is rounded to float32 as LeRobot computes it. Frames count from 0 in every
  episode (``TokenLayout.frame``), as LeRobot's clips start at 0. The bands (time ``hd - 2*(hd//3)``,
  height and width ``hd//3`` channels) are flexpack's :func:`~flexpack.models.rope.rope_bands` for every
  head dim LeRobot's RoPE can run (the config refuses the others). The angles' cos/sin are taken in
  float64 (LeRobot rounds the angles to float32 first: a difference below 1e-6 at small positions).

Sequence and mask. LeRobot's ``forward_train`` concatenates, per batch of clips, [noisy latents,
clean latents, noisy actions, clean actions]; flexpack orders the same tokens per episode run (copy
by copy, frame by frame, video tokens then action tokens of each frame). Attention only sees the
mask and the positions, so the two orders give the same outputs per token. The mask is
:func:`flexpack.attention.masks.lingbot_mask` (built by flexpack's block-mask builder from the
layout, never a T x T evaluation); text cross-attention lets each episode see its own text.

Inputs (:meth:`LingbotVA.forward`): ``batch.latent`` (2, R, C, Fr, H, W) = (noisy, clean),
``batch.action`` (2, R, action_dim, Fr, action_per_frame), ``batch.text`` (E, L, text_dim);
``timestep`` / ``action_timestep`` (2, R, Fr) on the 0..1000 scale (the clean copy's are LeRobot's
``cond_timesteps``); ``chunk_size`` / ``window``: ints or one per episode. Outputs are the noisy
copy's predictions (:class:`~flexpack.models.backbone.DiTOutput`), zero on padding frames.

Text: LeRobot zero-pads the UMT5 output of a prompt to ``max_sequence_length`` (512) tokens and attends
all of them (its cross-attention mask knows no text length; the zero tokens still pass the text
projection's biases). A batch means the same here when every episode's ``text_len`` is ``L``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from flexpack.families.lingbot.config import LingbotConfig
from flexpack.models.backbone import DiTOutput, WanBackbone
from flexpack.models.rope import rope_cos_sin
from flexpack.models.wan_blocks import MLP, TimeEmbed
from flexpack.packing.layout import ACTION, TokenLayout


def lingbot_positions(tl: TokenLayout) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token RoPE positions (frame, height, width), each (T,) float64, as LeRobot's ``get_mesh_id``.

    Video tokens: ``(frame, hpos, wpos)``. Action step ``j`` of ``A`` per frame:
    ``(float32(frame + float32((j + 1) / (A + 1))), -1, -1)``. Padding tokens get their layout values
    (their outputs are masked).
    """
    frame = tl.frame.to(torch.float32)
    hpos, wpos = tl.hpos.to(torch.float64), tl.wpos.to(torch.float64)
    A = tl.action_tokens
    if A:
        # step j of every action token, from its place inside its unit
        step = torch.zeros_like(tl.frame)
        step[tl.action_index.reshape(-1)] = torch.arange(A, device=step.device).repeat(tl.action_index[..., 0].numel())
        offset = (step + 1).to(torch.float32) / (A + 1)
        is_action = tl.stream == ACTION
        frame = torch.where(is_action, frame + offset, frame)
        hpos = torch.where(is_action, -1.0, hpos)
        wpos = torch.where(is_action, -1.0, wpos)
    return frame.to(torch.float64), hpos, wpos


class LingbotVA(WanBackbone):
    """LeRobot's LingBot-VA transformer on flexpack's packed layout; see the module docstring.

    Built from a :class:`~flexpack.families.lingbot.config.LingbotConfig`; ``self.config`` is its
    :class:`~flexpack.families.wan.config.WanVAConfig` shape (what FLOP counts and parallelize rules read),
    ``self.family_config`` the LingBot-VA config itself.
    """

    def __init__(self, config: LingbotConfig, *, attn: Any = None) -> None:
        super().__init__(config.wan_shape(), attn=attn)
        self.family_config = config
        D = config.dim
        self.action_time_embed = TimeEmbed(config.freq_dim, D)
        # LeRobot's deep copy of the video embedder carries a text projection no forward uses
        self.action_text_embed = MLP(config.text_dim, D, D).requires_grad_(False)
        self.action_head_modulation = None  # one output table for both streams (head_modulation)

    def forward(
        self,
        batch: Any,
        layout: Any = None,
        *,
        timestep: Tensor,
        action_timestep: Tensor | None = None,
        chunk_size: int | Tensor,
        window: int | Tensor,
        text_slots: int | None = None,
        mask: str = "lingbot",
    ) -> DiTOutput:
        """Predict the flow of the noisy copy (see the module docstring for the inputs).

        ``mask`` stays ``"lingbot"`` in training; other masks of :mod:`flexpack.attention.masks` are
        accepted for experiments (``chunk_size`` / ``window`` are then passed to them as given).
        """
        return super().forward(batch, layout, timestep=timestep, action_timestep=action_timestep, mask=mask,
                               chunk_size=chunk_size, window=window, text_slots=text_slots)

    # ---------------------------------------------------------------- the backbone's hooks
    def _time_embedding(self, t_US: Tensor) -> tuple[Tensor, Tensor]:
        """Stream 0 (video) through ``time_embed``, stream 1 (action) through ``action_time_embed``."""
        U, S = t_US.shape
        temb, mod = self.time_embed(t_US[:, 0])
        if S == 1:
            return temb, mod
        a_temb, a_mod = self.action_time_embed(t_US[:, 1])
        return torch.stack([temb, a_temb], 1).flatten(0, 1), torch.stack([mod, a_mod], 1).flatten(0, 1)

    def _rope(self, tl: TokenLayout) -> tuple[Tensor, Tensor]:
        return rope_cos_sin(*lingbot_positions(tl), self.config.head_dim)

    def _action_head_table(self) -> Tensor:
        return self.head_modulation
