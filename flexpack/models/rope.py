"""3D rotary position embedding (Wan layout) from per-token layout positions.

The head dimension is split into three bands, as Wan does: height and width get
``2 * (head_dim // 6)`` channels each and time gets the rest (head_dim 128 → 44 / 42 / 42).
Channels rotate in interleaved pairs ``(x[2i], x[2i+1])``; band ``b`` of size ``d`` rotates pair
``i`` by ``pos_b / theta ** (2i / d)``.

Positions come from the :class:`~flexpack.packing.layout.TokenLayout` (``frame`` restarts per episode,
``hpos``/``wpos`` the patch grid), never from a token's place in the packed sequence, so a packed
episode sees exactly the rotations it would see alone.

Action tokens (:func:`rope_positions`). The ``action_steps`` tokens of one latent frame go through
the same embedding (one Linear for every step) and share the frame's timestep, so only their
positions can tell them apart: tokens with equal positions and equal inputs are interchangeable to attention,
and a model that cannot tell step 0 from step 3 of a frame cannot read the order of its own
history. The rule (``action_positions = "step"``, LingBot-VA's grid ids): action step ``j`` of
``A`` steps in latent frame ``f`` sits at temporal position ``f + (j + 1) / (A + 1)`` — strictly
between frame ``f`` and the next, evenly spaced, in step order — and at spatial position
``(-1, -1)``, one row and column off the patch grid, so no action token shares a spatial
position with a video patch. Action steps therefore differ from each other only in the temporal
band, by multiples of ``1 / (A + 1)`` frames.

The older rule (``action_positions = "frame"``, checkpoints before this rule): every action token
at its frame's position with spatial ``(0, 0)`` (identity rotation of the spatial bands): the steps
of a frame are interchangeable, and the model is equivariant to permuting them. Kept so those
checkpoints still compute what they were trained to.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..packing.layout import ACTION, TokenLayout

# "step": each action step at its own fractional frame offset (LingBot-VA's rule, the default);
# "frame": every action token at its frame's position (the rule before it; old checkpoints)
ACTION_POSITIONS = ("step", "frame")
LINGBOT_ACTION_SPATIAL = -1.0  # spatial position of action tokens under "step" (LingBot-VA's grid ids)


def rope_bands(head_dim: int) -> tuple[int, int, int]:
    """Channels per (time, height, width) band for ``head_dim`` (Wan's split)."""
    if head_dim <= 0 or head_dim % 2:
        raise ValueError(f"RoPE needs a positive even head_dim, got {head_dim}")
    hw = 2 * (head_dim // 6)
    return head_dim - 2 * hw, hw, hw


def rope_cos_sin(
    frame: Tensor, hpos: Tensor, wpos: Tensor, head_dim: int, theta: float = 10000.0
) -> tuple[Tensor, Tensor]:
    """Per-token rotation tables, each (T, head_dim // 2) float32.

    Angles are computed in float64 and rounded once (as the reference does), so long episodes
    (frame positions in the hundreds) do not lose precision before the cos/sin.
    """
    angles = []
    for pos_T, d in zip((frame, hpos, wpos), rope_bands(head_dim)):
        if d == 0:
            continue
        inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64, device=pos_T.device) / d)
        angles.append(pos_T.to(torch.float64)[:, None] * inv_freq[None, :])  # (T, d/2)
    ang_TD2 = torch.cat(angles, dim=-1)
    return ang_TD2.cos().float(), ang_TD2.sin().float()


def apply_rope(x_THD: Tensor, cos_TD2: Tensor, sin_TD2: Tensor) -> Tensor:
    """Rotate interleaved channel pairs of ``x`` (T, H, D) in float32; returns x's dtype."""
    x0, x1 = x_THD.float().unflatten(-1, (-1, 2)).unbind(-1)  # each (T, H, D/2)
    c, s = cos_TD2[:, None, :], sin_TD2[:, None, :]
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2)
    return out.to(x_THD.dtype)


def action_step_offsets(steps: int, device: torch.device | str | None = None) -> Tensor:
    """(steps,) float64 temporal offsets ``(j + 1) / (steps + 1)`` of action steps ``j = 0..steps-1``
    inside their latent frame (the ``"step"`` rule)."""
    if steps < 1:
        raise ValueError(f"action steps must be >= 1, got {steps}")
    return torch.arange(1, steps + 1, dtype=torch.float64, device=device) / (steps + 1)


def rope_positions(
    tl: TokenLayout,
    rule: str = "step",
    *,
    action_spatial: float = LINGBOT_ACTION_SPATIAL,
    frame: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """Per-token float64 RoPE positions ``(time, height, width)``, each (T,), of a token layout.

    Video tokens: ``(frame, hpos, wpos)`` of the layout. Action tokens under ``rule = "step"``:
    ``(frame + (j + 1) / (A + 1), action_spatial, action_spatial)`` for action step ``j`` of the
    layout's ``A = action_tokens`` (see the module docstring); under ``"frame"``: the layout's
    ``(frame, 0, 0)``. ``frame``: per-token frame ids to use instead of ``tl.frame`` (a model family
    whose streams number frames otherwise); the action offsets are added to them all the same.
    """
    if rule not in ACTION_POSITIONS:
        raise ValueError(f"action_positions must be one of {ACTION_POSITIONS}, got {rule!r}")
    f_T = (tl.frame if frame is None else frame).to(torch.float64)
    h_T, w_T = tl.hpos.to(torch.float64), tl.wpos.to(torch.float64)
    A = tl.action_tokens
    if rule == "frame" or A == 0:
        return f_T, h_T, w_T
    # inside every (copy, row, frame) unit of K tokens the video tokens come first, then the A action
    # steps in order (TokenLayout's token order), so a token's step is its place in the unit minus nv
    K = tl.video_tokens + A
    step_T = torch.arange(f_T.shape[0], device=f_T.device) % K - tl.video_tokens
    is_action = tl.stream == ACTION
    offset_T = action_step_offsets(A, f_T.device)[step_T.clamp(0, A - 1)]
    spatial = torch.full_like(h_T, float(action_spatial))
    return (torch.where(is_action, f_T + offset_T, f_T), torch.where(is_action, spatial, h_T),
            torch.where(is_action, spatial, w_T))
