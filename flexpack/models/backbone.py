"""The Wan transformer every built-in model family computes with: patch embedding, timestep and text
embedding, the blocks, the output head, over one flat token sequence of packed or padded episodes.

:class:`WanBackbone` holds what :class:`~flexpack.families.wan.model.WanVA` and
:class:`~flexpack.families.lingbot.model.LingbotVA` share (their parameters, names and order, and the packed
forward); each family's model class subclasses it and adds only the entry points it supports, overriding the
hooks where its model differs (``_time_embedding``, ``_rope``, ``_action_head_table``).

Token sequence. ``layout.tokens()`` puts every (copy, row, frame) "unit" at a contiguous run of
``K = video_tokens + action_tokens`` tokens (video first). The model therefore keeps hidden states
as ``(U, K, D)``: modulation is per unit and stream and broadcasts over the unit's tokens, so no
``(T, 6, D)`` per-token modulation table is ever materialized (that table would cost ~5 GB at
65k tokens × dim 3072 in fp32, and its slices would be saved for backward in every block).

Spatial padding (a run whose datasets' latent grids differ, :mod:`flexpack.packing.grids`): each frame's
patches are taken in slot order (``TokenLayout.video_slot``: the episode's own patches first) and put back after
the head, zero on padding.

Attention sees one sequence of ``T = U * K`` tokens (batch dim 1) through
:class:`~flexpack.attention.flex.FlexAttnFunc`; both masks (self and text) are prepared once per
forward and shared by all blocks. Outputs at padding frames are set to zero, so nothing flows
back from them even if a loss forgot to mask.

Precision: LayerNorms, RMSNorms, modulation, gated residuals and RoPE run in float32 and cast
back, so the model can hold bf16 weights and activations.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from flexpack.attention.masks import text_slots
from flexpack.packing.layout import SequenceLayout, TokenLayout

from .rope import rope_cos_sin, rope_positions
from .wan_blocks import MLP, TimeEmbed, WanBlock, layer_norm_fp32


@dataclass(frozen=True, eq=False)
class DiTOutput:
    """Predictions for the noisy copy: ``video`` (R, C_out, Fr, H, W), ``action`` (R, Ca, Fr, A) or None."""

    video: Tensor
    action: Tensor | None


class WanBackbone(nn.Module):
    """Wan-style DiT over video latents plus action tokens; see the module docstring.

    Args:
        config: shape and options (a family's Wan shape: the :class:`~flexpack.models.registry.ModelShape`
            fields and ``eps``, ``cross_attn_norm``, ``freq_dim``, ``patch_volume``,
            ``activation_checkpointing``, ``action_positions``, ``rope_theta``).
        attn: the attention callable (``prepare(layout, mask, ...)`` and ``__call__(q, k, v, prepared)``);
            default ``FlexAttnFunc(config.attn_backend, fixed_segments=True)``: block masks on the
            segment grid of the pack's shape, so that no episode count compiles the mask builder anew.
    """

    def __init__(self, config: Any, *, attn: Any = None) -> None:
        super().__init__()
        cfg = self.config = config
        D, Ca = cfg.dim, cfg.action_channels
        self.patch_embed = nn.Linear(cfg.in_channels * cfg.patch_volume, D)  # input order (C, pt, ph, pw)
        self.action_embed = nn.Linear(Ca, D) if Ca else None
        self.time_embed = TimeEmbed(cfg.freq_dim, D)
        self.text_embed = MLP(cfg.text_dim, D, D)
        self.blocks = nn.ModuleList(
            WanBlock(D, cfg.num_heads, cfg.ffn_dim, cfg.eps, cfg.cross_attn_norm) for _ in range(cfg.num_layers)
        )
        self.head_modulation = nn.Parameter(torch.randn(2, D) / D**0.5)  # shift, scale
        self.head_proj = nn.Linear(D, cfg.out_dim * cfg.patch_volume)  # output order (pt, ph, pw, C)
        self.action_head_modulation = nn.Parameter(torch.randn(2, D) / D**0.5) if Ca else None
        self.action_head_proj = nn.Linear(D, Ca) if Ca else None
        if attn is None:
            # imported late: attention may pull in compile machinery
            from flexpack.attention.flex import FlexAttnFunc

            attn = FlexAttnFunc(cfg.attn_backend, fixed_segments=True)
        self.attn = attn

    # -------------------------------------------------------------- public entry points
    def forward(
        self,
        batch: Any,
        layout: SequenceLayout | None = None,
        *,
        timestep: Tensor,
        action_timestep: Tensor | None = None,
        mask: str = "document",
        chunk_size: int | None = None,
        window: int | None = None,
        text_slots: int | None = None,
    ) -> DiTOutput:
        """Predict the flow for a packed or padded micro-batch.

        Args:
            batch: a :class:`~flexpack.packing.collate.Batch` (or anything with ``latent``, ``action``, ``text``
                fields) holding the *model inputs*: ``latent`` (R, C, Fr, H, W) or, with teacher
                forcing, (2, R, C, Fr, H, W) = (noisy, clean); ``action`` (R, Ca, Fr, A) or
                (2, R, Ca, Fr, A) likewise; ``text`` (E, L, Dt) or None.
            layout: defaults to ``batch.layout``.
            timestep: (R, Fr) or (copies, R, Fr) diffusion time per latent frame (0..1000 scale).
            action_timestep: same shape, for action tokens; defaults to ``timestep``.
            mask: self-attention mask name for ``FlexAttnFunc.prepare`` (``"document"``,
                ``"chunk_causal"``, ``"teacher_forcing"``, ...).
            text_slots: text key slots when the micro-batch has at most that many episodes (more
                episodes: the next power of two of their count, as without it); a fixed value that bounds
                every micro-batch of a run keeps one compiled shape per pack.
        """
        cfg = self.config
        layout = batch.layout if layout is None else layout
        if cfg.patch_size[0] != 1:
            raise ValueError(f"model(batch, layout) needs temporal patch size 1, got patch_size={cfg.patch_size}")
        lat = batch.latent if batch.latent.ndim == 6 else batch.latent[None]
        if lat.ndim != 6:
            raise ValueError("batch.latent must be (R,C,Fr,H,W) or (copies,R,C,Fr,H,W), "
                             f"got {tuple(batch.latent.shape)}")
        copies, R, C, Fr, H, W = lat.shape
        if (R, Fr) != tuple(layout.frame_doc.shape):
            raise ValueError(f"batch.latent has (R, Fr)={(R, Fr)} but the layout has {tuple(layout.frame_doc.shape)}")
        t_video = self._per_copy(timestep, (copies, R, Fr), "timestep")
        t_action = acts = None
        A = 0
        action = getattr(batch, "action", None)
        if action is not None and self.action_embed is None:
            # dropping the actions silently would train a different model than the caller asked for
            raise ValueError(f"batch.action {tuple(action.shape)} given but the model has action_channels=0")
        if self.action_embed is not None and action is not None:
            act = action if action.ndim == 5 else action[None]
            if (act.ndim != 5 or act.shape[:2] != (copies, R) or act.shape[2] != cfg.action_channels
                    or act.shape[3] != Fr):
                raise ValueError(
                    f"batch.action must be ({copies},{R},{cfg.action_channels},{Fr},A) (copy dim optional), "
                    f"got {tuple(action.shape)}"
                )
            A = act.shape[4]
            acts = rearrange(act, "k r ca f a -> k r f a ca")
            t_action = (t_video if action_timestep is None
                        else self._per_copy(action_timestep, (copies, R, Fr), "action_timestep"))
        patches, (h, w) = self._patchify(lat)
        tl = layout.tokens(video_tokens=h * w, action_tokens=A, copies=copies, grid_hw=(h, w))
        if tl.video_slot is not None:  # spatial padding: each frame's own patches first (flexpack.packing.grids)
            patches = patches.gather(3, tl.video_slot[None, ..., None].expand_as(patches))
        vid, act_out = self._run(patches, acts, tl, t_video, t_action, batch.text, mask, chunk_size, window, text_slots)
        if tl.video_slot is not None:
            vid = _unslot(vid, tl)
        valid_RF = layout.frame_valid.to(vid.dtype)
        video = self._unpatchify(vid * valid_RF[..., None, None], h, w)
        action_out = None if act_out is None else rearrange(act_out * valid_RF[..., None, None], "r f a ca -> r ca f a")
        return DiTOutput(video=video, action=action_out)
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    # -------------------------------------------------------------- internals
    @staticmethod
    def _per_copy(t: Tensor, shape: tuple[int, int, int], name: str) -> Tensor:
        t = t if t.ndim == 3 else t[None]
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} must be (R, Fr) or (copies, R, Fr) = {shape}, got {tuple(t.shape)}")
        return t

    def _patchify(self, lat: Tensor) -> tuple[Tensor, tuple[int, int]]:
        """(copies, R, C, F, H, W) → (copies, R, F/pt, h*w, C*pt*ph*pw), patch grid (h, w)."""
        c, R, C, Fn, H, W = lat.shape
        pt, ph, pw = self.config.patch_size
        if C != self.config.in_channels or Fn % pt or H % ph or W % pw:
            raise ValueError(
                f"latent (C,F,H,W)={(C, Fn, H, W)} does not fit in_channels={self.config.in_channels}, "
                f"patch={self.config.patch_size}"
            )
        patches = rearrange(lat, "k r c (f pt) (h ph) (w pw) -> k r f (h w) (c pt ph pw)", pt=pt, ph=ph, pw=pw)
        return patches, (H // ph, W // pw)

    def _unpatchify(self, y: Tensor, h: int, w: int) -> Tensor:
        """(R, F', h*w, pt*ph*pw*C) → (R, C, F'*pt, h*ph, w*pw); the head's channel order is
        diffusers' (patch offsets outer, channels inner), unlike the input patches'."""
        pt, ph, pw = self.config.patch_size
        return rearrange(y, "r f (h w) (pt ph pw c) -> r c (f pt) (h ph) (w pw)", h=h, w=w, pt=pt, ph=ph, pw=pw)

    def _run(
        self,
        patches: Tensor,
        acts: Tensor | None,
        tl: TokenLayout,
        t_video: Tensor,
        t_action: Tensor | None,
        text: Tensor | None,
        mask: str,
        chunk_size: int | None,
        window: int | None,
        min_text_slots: int | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Token-level forward. patches (copies,R,F,nv,P), acts (copies,R,F,A,Ca) →
        video (R,F,nv,P_out), action (R,F,A,Ca) for copy 0 (the noisy one)."""
        cfg, D = self.config, self.config.dim
        nv, na = tl.video_tokens, tl.action_tokens
        K = nv + na
        copies, R, Fr = t_video.shape
        U = copies * R * Fr
        # unit (block of K tokens) holding each (copy, row, frame); TokenLayout guarantees
        # video_index[c, r, f, j] == unit * K + j (tested in tests/test_layout.py, not re-checked here:
        # a check would cost a device sync every step)
        unit_CRF = torch.div(tl.video_index[..., 0], K, rounding_mode="floor")
        to_tokens = torch.argsort(unit_CRF.reshape(-1))  # grid order → token order

        dtype = self.patch_embed.weight.dtype  # inputs follow the weights (fp32 data into a bf16 model)
        emb = self.patch_embed(patches.to(dtype))  # (copies, R, F, nv, D)
        t_grid = t_video.reshape(U, 1)
        if na:
            emb = torch.cat([emb, self.action_embed(acts.to(dtype))], dim=3)
            t_grid = torch.stack([t_video, t_action], dim=-1).reshape(U, 2)
        x_UKD = emb.reshape(U, K, D)[to_tokens]
        S = t_grid.shape[1]
        temb, mod = self._time_embedding(t_grid[to_tokens])
        temb_USD, mod_US6D = temb.view(U, S, D), mod.view(U, S, 6, D)

        rope = self._rope(tl)
        self_mask = self.attn.prepare(tl, mask, chunk_size=chunk_size, window=window)
        text_SD = text_mask = None
        if text is not None:
            if text.ndim != 3 or text.shape[0] != tl.text_len.shape[0]:
                raise ValueError(f"text must be (E={tl.text_len.shape[0]}, L, Dt), got {tuple(text.shape)}")
            # keys padded to the run's slot count (or a power of two of episode slots): one compiled shape
            # per slot count rather than per episode count (the extra slots are masked out)
            E, L = text.shape[:2]
            slots = min_text_slots if min_text_slots and E <= min_text_slots else text_slots(E)
            text_SD = F.pad(self.text_embed(text.to(emb.dtype)), (0, 0, 0, 0, 0, slots - E)).flatten(0, 1)  # (S*L, D)
            text_mask = self.attn.prepare(tl, "text", text_tokens=L, text_slots=slots)

        self_attend, text_attend = self._bind(self_mask), self._bind(text_mask)
        use_ckpt = cfg.activation_checkpointing and torch.is_grad_enabled()
        for block in self.blocks:
            args = (x_UKD, mod_US6D, text_SD, rope, self_attend, text_attend, nv)
            x_UKD = checkpoint(block, *args, use_reentrant=False) if use_ckpt else block(*args)

        noisy = unit_CRF[0].reshape(-1)  # (R*F,) units of the noisy copy, in grid order
        x0 = layer_norm_fp32(x_UKD[noisy], cfg.eps)  # (R*F, K, D) fp32
        temb0 = temb_USD[noisy].float()
        vid = self._head(x0[:, :nv], temb0[:, 0], self.head_modulation, self.head_proj, emb.dtype)
        act_out = None
        if na:
            act_out = self._head(x0[:, nv:], temb0[:, 1], self._action_head_table(), self.action_head_proj, emb.dtype)
            act_out = act_out.view(R, Fr, na, -1)
        return vid.view(R, Fr, nv, -1), act_out

    # hooks a model family built on these blocks overrides (flexpack.families.lingbot.model)
    def _time_embedding(self, t_US: Tensor) -> tuple[Tensor, Tensor]:
        """temb (U*S, D) and modulation (U*S, 6, D) of timesteps (U, S) per unit and stream."""
        return self.time_embed(t_US.reshape(-1))

    def _rope(self, tl: TokenLayout) -> tuple[Tensor, Tensor]:
        """Per-token RoPE tables (cos, sin) for the layout's tokens."""
        return rope_cos_sin(*rope_positions(tl, self.config.action_positions), self.config.head_dim,
                            self.config.rope_theta)

    def _action_head_table(self) -> Tensor:
        """The output head's (shift, scale) table of the action stream."""
        return self.action_head_modulation

    def _bind(self, prepared: Any) -> Any:
        """``(q, k, v) -> out`` over a prepared mask (None stays None); attention callables without
        ``bind`` are called as ``attn(q, k, v, prepared)``."""
        if prepared is None:
            return None
        bind = getattr(self.attn, "bind", None)
        if bind is not None:
            return bind(prepared, self.config.head_dim)
        return functools.partial(_call_with_mask, self.attn, prepared)

    @staticmethod
    def _head(x_NKD: Tensor, temb_ND: Tensor, table_2D: Tensor, proj: nn.Linear, dtype: torch.dtype) -> Tensor:
        shift, scale = (table_2D.float()[None] + temb_ND[:, None]).unbind(1)  # each (N, D)
        return proj((x_NKD * (1 + scale[:, None]) + shift[:, None]).to(dtype))


def _unslot(vid_RFnP: Tensor, tl: TokenLayout) -> Tensor:
    """Video outputs from slot order back to patch order, zero on spatial padding (nothing flows back from it)."""
    real = (tl.doc[tl.video_index[0]] >= 0)[..., None]  # (R, F, nv, 1): the noisy copy's slots of an episode
    out = torch.where(real, vid_RFnP, 0.0)
    return torch.zeros_like(out).scatter(2, tl.video_slot[..., None].expand_as(out), out)


def _call_with_mask(attn: Any, prepared: Any, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    return attn(q, k, v, prepared)
