"""Attention masks as small pure ``mask_mod(b, h, q_idx, kv_idx) -> bool`` functions over a layout.

Every factory reads a :class:`~flexpack.packing.layout.TokenLayout` once and returns a closure over its
per-token tensors, so the result works with FlexAttention (``create_block_mask``, compiled
kernels), with dense evaluation on index grids (``mask_mod(b, h, q[:, None], kv[None, :])``) and
with ``torch.nn.attention.flex_attention.and_masks`` / ``or_masks``.

Conventions pinned here (and in ``tests/test_masks.py``):

* Padding (``doc == -1``) attends nowhere and is attended by none, in every mask.
* A *chunk* is ``frame // chunk_size`` (latent frames inside the episode, counted from 0).
* ``window`` (teacher forcing) counts **earlier** chunks: a key chunk ``ck`` is visible from a
  query chunk ``cq`` only if ``cq - ck <= window``; ``window=0`` keeps the query's own chunk only.

Each closure also carries ``q_keys`` / ``kv_keys``: the per-token tensors its value depends on.
The mask is constant on runs of tokens where all keys are constant, which is what
:mod:`flexpack.attention.blockmask` uses to build block masks without evaluating the ``T x T`` grid.
It also carries ``segments``: host-side upper bounds ``(q, kv)`` on the number of those runs
(computed from ``TokenLayout.runs``, no device sync; ``None`` when unknown), so the block-mask
builder works on a grid of the real size instead of one cell per frame. Keys of padding tokens
are constant (chunk ``-1``, copy ``NOISY``) so that a padding run is one segment; padding is
masked out by its ``doc == -1`` anyway.
It also carries ``runs``: an upper bound on the number of contiguous key ranges one query sees
(or ``None``). The token order of :class:`~flexpack.packing.layout.TokenLayout` (episodes contiguous,
copy by copy, frame by frame) makes every mask here but LingBot-VA's a union of at most two ranges per query,
which lets the attention kernels evaluate partial blocks with two compares per range instead of
this module's gathers (see :mod:`flexpack.attention.blockmask`).

Each mask family lives in a small module of its own and declares itself in the mask table
(:mod:`flexpack.attention.mask_table`): ``mask_document.py`` ("document", "valid"), ``mask_chunk.py``
("chunk_causal", "teacher_forcing"), ``mask_text.py`` ("text"); a family's own masks live in its folder
(lingbot-va's "lingbot": :mod:`flexpack.families.lingbot.mask`, registered with the family); the helpers
they share are in :mod:`flexpack.attention.maskmod`. This module gathers them: importing it fills the table
with the built-in masks, and :func:`make_mask` builds any registered one by name. A mask added from outside
flexpack is one :func:`register_mask` call.
"""

from __future__ import annotations

from torch import Tensor

# the built-in mask families, imported in the order they register (the order mask_names() lists)
from flexpack.attention.mask_document import document_mask, valid_document_mask, valid_frame_mask

# isort: split
from flexpack.attention.mask_chunk import chunk_causal_mask, teacher_forcing_mask

# isort: split
from flexpack.attention.mask_text import text_mask, text_slots

# isort: split
from flexpack.attention.mask_table import (
    MaskKind,
    mask_kind,
    mask_names,
    register_mask,
    unregister_mask,
    update_mask,
)
from flexpack.attention.maskmod import MaskMod, all_of, dense_mask, next_pow2, tag_mask
from flexpack.packing.layout import TokenLayout

__all__ = [
    "MASK_KINDS", "MaskKind", "MaskMod", "all_of", "chunk_causal_mask", "dense_mask", "document_mask", "make_mask",
    "mask_kind", "mask_names", "next_pow2", "register_mask", "tag_mask", "teacher_forcing_mask",
    "text_mask", "text_slots", "unregister_mask", "update_mask", "valid_document_mask", "valid_frame_mask",
]

# the generic masks (mask_names() lists every registered one; a family's own masks, such as lingbot-va's
# "lingbot", register with the family: flexpack.families.lingbot.mask)
MASK_KINDS = ("document", "valid", "chunk_causal", "teacher_forcing", "text")


def __getattr__(name: str) -> object:
    if name != "lingbot_mask":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    import warnings

    warnings.warn("flexpack.attention.masks.lingbot_mask is deprecated: it moved to flexpack.families.lingbot.mask; "
                  "import it from there (the old path goes in flexpack 0.3)", DeprecationWarning, stacklevel=2)
    return importlib.import_module("flexpack.families.lingbot.mask").lingbot_mask


def make_mask(
    layout: TokenLayout,
    kind: str,
    *,
    chunk_size: int | Tensor | None = None,
    window: int | Tensor | None = None,
    text_tokens: int | None = None,
    text_slots: int | None = None,
) -> MaskMod:
    """The mask_mod of the registered mask ``kind`` (:func:`mask_names`; "valid" = document ∧ valid-frame)
    with the options it takes; over a layout with spatial padding, with the bounds that padding needs
    (:func:`spatial_bounds`)."""
    spec = mask_kind(kind)
    mod = spec.make(layout, chunk_size=chunk_size, window=window, text_tokens=text_tokens, text_slots=text_slots)
    return spatial_bounds(mod, layout, self_attention=spec.keys is None) if layout.spatial else mod


def spatial_bounds(mod: MaskMod, layout: TokenLayout, *, self_attention: bool) -> MaskMod:
    """``mod`` over a layout with spatial padding (:mod:`flexpack.packing.grids`): every frame's padding tokens
    (``doc = -1``, between its video and action tokens) are one more key segment per (copy, row, frame) on the
    query side (and the key side of a self-attention mask), and two where a frame's video and action tokens could
    be one segment before (the padding splits them); an episode's tokens are no longer a few key ranges, so a
    self-attention mask loses its ``runs`` bound (the kernels evaluate the mask_mod itself inside partial blocks)."""
    cells = 2 * layout.copies * layout.frames.num_rows * layout.frames.frames_per_row
    per_cell = getattr(mod, "segments_per_cell", 1)
    mod.segments_per_cell = per_cell + (2 if layout.action_tokens and per_cell == 1 else 1)  # type: ignore[attr-defined]
    seg = getattr(mod, "segments", None)
    if seg is not None:
        mod.segments = (seg[0] + cells, seg[1] + (cells if self_attention else 0))  # type: ignore[attr-defined]
    if self_attention:
        mod.runs = None  # type: ignore[attr-defined]
    return mod
