"""LingBot-VA's training mask (LeRobot ``lingbot_va``) over a noisy and a clean copy of video and action
tokens, with a chunk size and a window per episode."""

from __future__ import annotations

import torch
from torch import Tensor

from flexpack.attention.mask_table import register_mask
from flexpack.attention.maskmod import MaskMod, both_sides, per_episode_values, segment_bound, tag_mask
from flexpack.packing.layout import CLEAN, NOISY, TokenLayout


def lingbot_mask(layout: TokenLayout, chunk_size: int | Tensor, window: int | Tensor) -> MaskMod:
    """LingBot-VA's training mask (LeRobot ``lingbot_va``) over noisy and clean copies of video and action tokens.

    Note: every token gets a block id ``fid = frame // chunk * 2 + stream`` (video ``2c``, action
    ``2c + 1`` for chunk ``c`` of its episode). Inside one episode: clean -> clean: ``fid_k <= fid_q``;
    noisy -> clean: ``fid_k < fid_q``; noisy -> noisy: ``fid_k == fid_q``; clean -> noisy: never; and
    always ``|fid_q - fid_k| <= window`` (block ids: two per chunk). So a noisy action token sees the
    clean video of its own chunk, a noisy video token does not. ``chunk_size`` and ``window`` are an
    int or one value per episode slot ((E,) tensor): they are data in the closure, not constants,
    so changing them rebuilds no compiled graph.

    Segments: a frame's video and action tokens have different block ids, so (with action tokens)
    every frame of every copy is two segments whatever the chunk size (``segments_per_cell = 2``).
    Ranges: a query sees up to ``2 * chunk + 1`` key ranges (the video tokens of a chunk are
    separated by its action tokens), so ``runs`` is None: the kernels evaluate this mask_mod.
    """
    chunk_E = per_episode_values(chunk_size, layout, "chunk_size", 1)
    win_E = per_episode_values(window, layout, "window", 0)
    doc = layout.doc
    inside = layout.valid
    slot = doc.clamp(min=0)
    if chunk_E.numel():  # gathers need one episode at least; without one every token is padding
        fid = torch.where(inside, layout.frame // chunk_E[slot] * 2 + layout.stream, -1)
        win = torch.where(inside, win_E[slot], -1)
    else:
        fid = win = torch.full_like(doc, -1)
    copy = torch.where(inside, layout.copy, NOISY)

    def lingbot(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        fq, fk = fid[q_idx], fid[kv_idx]
        q_clean, k_clean = copy[q_idx] == CLEAN, copy[kv_idx] == CLEAN
        clean_to_clean = q_clean & k_clean & (fk <= fq)
        noisy_to_clean = ~q_clean & k_clean & (fk < fq)
        noisy_to_noisy = ~q_clean & ~k_clean & (fk == fq)
        same = (doc[q_idx] == doc[kv_idx]) & (doc[q_idx] >= 0)
        return (clean_to_clean | noisy_to_clean | noisy_to_noisy) & same & ((fq - fk).abs() <= win[q_idx])

    per_cell = 2 if layout.action_tokens and layout.video_tokens else 1
    seg = both_sides(segment_bound(layout, lambda n: layout.copies * n * per_cell))
    mod = tag_mask(lingbot, "lingbot", (doc, copy, fid), (doc, copy, fid), lingbot_mask.__doc__, runs=None,
                   segments=seg)
    mod.segments_per_cell = per_cell  # type: ignore[attr-defined]
    return mod


def _lingbot(layout: TokenLayout, chunk_size: int | Tensor | None, window: int | Tensor | None) -> MaskMod:
    if chunk_size is None or window is None:
        raise ValueError("mask 'lingbot' needs chunk_size and window (ints or one per episode)")
    return lingbot_mask(layout, chunk_size, window)


# not measured yet; its mask_mod runs inside partial blocks (no ranges): Triton flex
register_mask("lingbot", build=_lingbot, options=("chunk_size", "window"), token_level=True,
              families=("lingbot-va",))
