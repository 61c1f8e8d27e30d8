"""The text cross-attention mask: layout tokens (queries) to the flattened text tokens of their own
episode, in a fixed number of episode slots (:func:`text_slots`) so that the key length takes few values."""

from __future__ import annotations

import torch
from torch import Tensor

from flexpack.attention.mask_table import register_mask
from flexpack.attention.maskmod import MaskMod, next_pow2, segment_bound, tag_mask
from flexpack.packing.layout import TokenLayout


def text_slots(num_episodes: int) -> int:
    """Episode slots for text cross-attention: the next power of two, so that the key length
    ``slots * text_tokens`` takes few values as the episode count per micro-batch varies (pack
    mode packs 1..N episodes into one shape; without slots every count would compile anew)."""
    if num_episodes < 0:
        raise ValueError(f"num_episodes must be >= 0, got {num_episodes}")
    return next_pow2(num_episodes)


def text_mask(layout: TokenLayout, text_tokens: int, text_slots: int | None = None) -> MaskMod:
    """Cross-attention from layout tokens (queries) to ``S * text_tokens`` flattened text tokens.

    Note: key ``j`` belongs to episode slot ``j // text_tokens`` and is valid if that slot holds
    an episode (``< E``) and ``j % text_tokens < text_len[episode]``; a query sees only its own
    episode's valid text. ``S = text_slots`` (default ``E``) may exceed ``E`` so that the key
    length stays fixed while the episode count varies (no recompiles); the extra slots are empty.
    Padding queries and episodes with ``text_len == 0`` see nothing (their output is zero).
    """
    if not isinstance(text_tokens, int) or text_tokens <= 0:
        raise ValueError(f"text_tokens must be a positive int, got {text_tokens!r}")
    E = layout.text_len.numel()
    if text_slots is not None and text_slots < E:
        raise ValueError(f"text_slots={text_slots} is fewer than the layout's {E} episodes")
    host_len = layout.on_host().text_len  # the host copy: checking the device tensor would wait for the GPU
    if E and int(host_len.max()) > text_tokens:
        raise ValueError(f"text_len {host_len.tolist()} exceeds text_tokens={text_tokens}")
    doc = layout.doc
    tdoc = layout.text_doc(text_tokens).to(doc.device)
    if text_slots is not None and text_slots > E:
        tdoc = torch.cat([tdoc, tdoc.new_full(((text_slots - E) * text_tokens,), -1)])

    def text(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (doc[q_idx] == tdoc[kv_idx]) & (doc[q_idx] >= 0)

    q_bound = segment_bound(layout, lambda n: 1)
    seg = None if q_bound is None else (q_bound, 2 * (tdoc.numel() // text_tokens) + 1)  # valid + padding per slot
    return tag_mask(text, f"text_{text_tokens}", (doc,), (tdoc,), text_mask.__doc__, runs=1, segments=seg)


def _text(layout: TokenLayout, text_tokens: int | None, text_slots: int | None) -> MaskMod:
    if text_tokens is None:
        raise ValueError("mask 'text' needs text_tokens (text tokens per episode)")
    return text_mask(layout, text_tokens, text_slots)


def _text_keys(layout: TokenLayout, text_tokens: int | None, text_slots: int | None) -> tuple[int, int]:
    """(key length, key-side segment bound): ``slots * text_tokens`` keys, a valid and a padding run per slot."""
    slots = layout.text_len.numel() if text_slots is None else text_slots
    return slots * (text_tokens or 0), 2 * slots + 1


# "text" (kv != q length) was not measured with FLASH: Triton flex
register_mask("text", build=_text, options=("text_tokens", "text_slots"), keys=_text_keys)
