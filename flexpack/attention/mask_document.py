"""The document masks: attention inside each episode ("document"), and the same limited to each
episode's valid frames ("valid", pad mode). Both are "same episode" masks, so the per-episode backends
(one SDPA per episode, varlen attention) take them besides the dense and FlexAttention ones."""

from __future__ import annotations

import torch
from torch import Tensor

from flexpack.attention.mask_table import KNOWN_BACKENDS, register_mask
from flexpack.attention.maskmod import MaskMod, all_of, both_sides, segment_bound, tag_mask
from flexpack.packing.layout import TokenLayout


def document_mask(layout: TokenLayout) -> MaskMod:
    """Bidirectional attention inside each episode.

    Note: ``doc[q] == doc[kv]`` and ``doc[q] >= 0``. With ``doc = [0, 0, 1, -1]`` token 2 sees
    only itself, token 3 (padding) sees nothing and is seen by nothing.
    """
    doc = layout.doc

    def document(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (doc[q_idx] == doc[kv_idx]) & (doc[q_idx] >= 0)

    seg = both_sides(segment_bound(layout, lambda n: 1))
    return tag_mask(document, "document", (doc,), (doc,), document_mask.__doc__, runs=1, segments=seg)


def _token_valid(layout: TokenLayout) -> Tensor:
    """(T,) bool: token belongs to an episode and its frame is below that episode's valid frames."""
    ep_frames = layout.frames.episode_frames.to(layout.doc.device)
    if ep_frames.numel() == 0:
        return torch.zeros_like(layout.doc, dtype=torch.bool)
    limit = ep_frames[layout.doc.clamp(min=0)]
    return (layout.doc >= 0) & (layout.frame < limit)


def valid_frame_mask(layout: TokenLayout) -> MaskMod:
    """Both tokens are valid frames (pad mode): ``frame < valid_frames[episode]`` and ``doc >= 0``.

    Note: this mask alone does **not** separate episodes (compose it with :func:`document_mask`);
    it exists so that a pad-mode caller can state "frames at or beyond ``valid_frames`` are
    excluded" independently of how episodes are separated (e.g. one row per batch element).
    """
    valid = _token_valid(layout)

    def valid_frame(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return valid[q_idx] & valid[kv_idx]

    return tag_mask(valid_frame, "valid_frame", (valid,), (valid,), valid_frame_mask.__doc__)




def valid_document_mask(layout: TokenLayout) -> MaskMod:
    """The "valid" mask: :func:`document_mask` and :func:`valid_frame_mask` (document ∧ valid-frame).

    Note: each copy's valid frames of an episode are one key range (``runs = copies``); its keys (doc,
    valid) make per episode and copy a valid prefix and an invalid rest (two segments)."""
    mod = all_of(document_mask(layout), valid_frame_mask(layout))
    mod.runs = layout.copies  # type: ignore[attr-defined]  # each copy's valid frames are one run
    mod.segments = both_sides(segment_bound(layout, lambda n: 2 * layout.copies))  # type: ignore[attr-defined]
    return mod


# chosen from benchmarks/results/attention_h200.json (see BENCHMARKS.md): FLASH beat Triton flex by
# 1.2-1.4x fwd+bwd on document and teacher-forcing masks
register_mask("document", build=document_mask, backends=KNOWN_BACKENDS, auto_cuda="flex-flash",
              families=("wanva",))
register_mask("valid", build=valid_document_mask, backends=KNOWN_BACKENDS, auto_cuda="flex-flash")
