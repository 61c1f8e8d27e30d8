"""Wan2.x-style video-action diffusion transformer over packed or padded episodes.

The math follows diffusers' ``WanTransformer3DModel`` (Wan 2.2 TI2V, per-token timesteps):
patch embedding, sinusoidal timestep → MLP → 6-way AdaLN modulation, text MLP, blocks of
(AdaLN → self-attention with q/k RMSNorm across heads and 3D RoPE → gated residual; affine
LayerNorm → cross-attention to text; AdaLN → GELU-tanh FFN → gated residual), and an
AdaLN-modulated output head. On top of it: action tokens (a Linear from action channels in, a
Linear to action channels out, their own timestep per frame) and one flat token sequence for
the whole micro-batch, described by a :class:`~flexpack.packing.layout.TokenLayout`.

The packed forward, the parameters and the token sequence are the shared backbone's
(:class:`~flexpack.models.backbone.WanBackbone`: the token layout, spatial padding, attention and precision
are described there); :class:`WanVA` adds what only this family offers: the diffusers-compatible video-only call
(:meth:`WanVA.forward_video`), loading diffusers checkpoints (:meth:`WanVA.from_diffusers`,
:meth:`WanVA.from_diffusers_file`) and a fresh action stream for them (:meth:`WanVA.reset_action_stream`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn
from torch import Tensor

from flexpack.families.wan.config import WanVAConfig
from flexpack.families.wan.convert import from_diffusers, from_diffusers_file
from flexpack.models.backbone import DiTOutput, WanBackbone
from flexpack.packing.layout import SequenceLayout

# the predictions of the noisy copy (the name WanVA's callers know)
WanVAOutput = DiTOutput


def action_stream_init(cfg: WanVAConfig) -> dict[str, Tensor]:
    """Initial action-stream weights (CPU float32, drawn from the global RNG in a fixed order), by
    parameter name; {} without actions. One definition for a plain model and for a sharded one,
    whose ranks each take their slice of the same full tensors."""
    if not cfg.action_channels:
        return {}
    D, Ca = cfg.dim, cfg.action_channels
    embed, proj = nn.Linear(Ca, D, device="cpu"), nn.Linear(D, Ca, device="cpu")  # nn.Linear's own init
    table = torch.empty(2, D, device="cpu").normal_(0.0, D**-0.5)
    return {"action_embed.weight": embed.weight.detach(), "action_embed.bias": embed.bias.detach(),
            "action_head_proj.weight": proj.weight.detach(), "action_head_proj.bias": proj.bias.detach(),
            "action_head_modulation": table}


# ---------------------------------------------------------------------------- the model
class WanVA(WanBackbone):
    """Wan-style DiT over video latents plus action tokens; see the module docstring.

    Args:
        config: shape and options.
        attn: the attention callable (``prepare(layout, mask, ...)`` and ``__call__(q, k, v, prepared)``);
            default ``FlexAttnFunc(config.attn_backend, fixed_segments=True)``: block masks on the
            segment grid of the pack's shape, so that no episode count compiles the mask builder anew.
    """

    def __init__(self, config: WanVAConfig, *, attn: Any = None) -> None:
        super().__init__(config, attn=attn)

    def forward_video(self, latent: Tensor, timestep: Tensor, text: Tensor) -> Tensor:
        """Diffusers-compatible call: latent (B, C, F, H, W), timestep (B,), text (B, L, Dt) → (B, C_out, F, H, W).

        Each sample is one episode of a pad-mode layout, so diffusers' full bidirectional attention
        over one video is the document mask and the same FlexAttnFunc path runs.
        """
        if latent.ndim != 5 or timestep.shape != latent.shape[:1] or text.ndim != 3 or text.shape[0] != latent.shape[0]:
            raise ValueError(
                f"forward_video needs latent (B,C,F,H,W), timestep (B,), text (B,L,D); got "
                f"{tuple(latent.shape)}, {tuple(timestep.shape)}, {tuple(text.shape)}"
            )
        B, L = latent.shape[0], text.shape[1]
        patches, (h, w) = self._patchify(latent[None])
        Fp = patches.shape[2]
        layout = SequenceLayout.from_rows([[Fp]] * B, Fp, text_len=[L] * B, mode="pad").to(latent.device)
        tl = layout.tokens(video_tokens=h * w, grid_hw=(h, w))
        t = timestep.float()[None, :, None].expand(1, B, Fp)
        vid, _ = self._run(patches, acts=None, tl=tl, t_video=t, t_action=None, text=text, mask="document",
                           chunk_size=None, window=None)
        return self._unpatchify(vid, h, w)

    @classmethod
    def from_diffusers(cls, model: nn.Module, *, attn: Any = None, **config_overrides: Any) -> "WanVA":
        """Copy a ``diffusers.WanTransformer3DModel``'s weights (built on the meta device; the action
        modules, which diffusers lacks, get a fresh init)."""
        return from_diffusers(cls, model, attn=attn, **config_overrides)

    @classmethod
    def from_diffusers_file(
        cls, path: str, config: Any = None, *, attn: Any = None, **config_overrides: Any
    ) -> "WanVA":
        """Load a diffusers-format checkpoint: a ``.safetensors`` file (``config`` or a ``config.json``
        beside it gives the shape) or a folder with ``config.json`` and (sharded) weights.

        The model is built on the meta device and adopts the checkpoint's tensors; only the action
        stream is initialized (no random init of billions of weights that are overwritten anyway)."""
        return from_diffusers_file(cls, path, config, attn=attn, **config_overrides)

    @torch.no_grad()
    def reset_action_stream(self) -> None:
        """Fresh weights for the action modules, distributed as at construction (``nn.Linear``'s
        init; head modulation ~ N(0, 1/D)). Loaders call it for the part a video checkpoint lacks."""
        if self.action_embed is None:
            return
        for name, t in action_stream_init(self.config).items():
            self.get_parameter(name).copy_(t)
