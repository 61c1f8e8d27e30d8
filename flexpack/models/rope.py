"""3D rotary position embedding (Wan layout) from per-token layout positions.

The head dimension is split into three bands, as Wan does: height and width get
``2 * (head_dim // 6)`` channels each and time gets the rest (head_dim 128 → 44 / 42 / 42).
Channels rotate in interleaved pairs ``(x[2i], x[2i+1])``; band ``b`` of size ``d`` rotates pair
``i`` by ``pos_b / theta ** (2i / d)``.

Positions come from the :class:`~flexpack.packing.layout.TokenLayout` (``frame`` restarts per episode,
``hpos``/``wpos`` the patch grid), never from a token's place in the packed sequence, so a packed
episode sees exactly the rotations it would see alone.

Action tokens: the layout gives them ``hpos = wpos = 0``, so their spatial bands rotate by angle 0
(the identity) and only the temporal band carries position. Relative to a video patch at
``(h, w)`` an action token therefore looks like a token at the top-left spatial origin; between two
action tokens the spatial bands contribute no relative offset at all. We chose the identity over a
learned or "centre of the grid" position because it needs no extra parameters and keeps the
action stream independent of the video resolution.
"""

from __future__ import annotations

import torch
from torch import Tensor


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
