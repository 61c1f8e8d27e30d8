"""The backends over episode runs (document / valid masks): one SDPA call per episode, or varlen attention.

Both see an episode as one contiguous token run (``TokenLayout.doc_start`` / ``doc_len``), so a layout with
spatial padding (:mod:`flexpack.packing.grids`) is refused before it reaches them (``FlexAttnFunc``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from flexpack.packing.layout import to_device


def sdpa_loop(q: Tensor, k: Tensor, v: Tensor, prep: Any) -> Tensor:
    """One SDPA call per episode run of ``prep`` (a :class:`~flexpack.attention.flex.PreparedMask`), zeros between."""
    pieces, at = [], 0
    for s, n in prep.runs():
        if s > at:  # padding between episodes: zeros
            pieces.append(q.new_zeros(*q.shape[:2], s - at, v.shape[-1]))
        pieces.append(F.scaled_dot_product_attention(q[:, :, s:s + n], k[:, :, s:s + n], v[:, :, s:s + n]))
        at = s + n
    if at < q.shape[2]:
        pieces.append(q.new_zeros(*q.shape[:2], q.shape[2] - at, v.shape[-1]))
    return torch.cat(pieces, dim=2)


def varlen(q: Tensor, k: Tensor, v: Tensor, prep: Any) -> Tensor:
    """``varlen_attn`` over the episode runs of ``prep``; padding rows give zeros."""
    from torch.nn.attention.varlen import varlen_attn

    if "cu" not in prep._cache:
        # padding runs become their own sequences (outputs zeroed below) so cu_seqlens cover T
        bounds = {0, prep.q_len}
        for s, n in prep.runs():
            bounds |= {s, s + n}
        b = sorted(bounds)
        cu = to_device(torch.tensor(b, dtype=torch.int32), q.device)  # pinned, without blocking
        prep._cache["cu"] = (cu, max(y - x for x, y in zip(b[:-1], b[1:])))
    cu, mx = prep._cache["cu"]
    # (1, H, T, D) -> (T, H, D)
    out = varlen_attn(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), cu, cu, mx, mx)
    out = out.transpose(0, 1)[None]
    return out * prep.valid()[:, None].to(out.dtype)
