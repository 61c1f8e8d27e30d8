"""The chunk masks over ``model.chunk_size`` latent frames: chunk-causal attention ("chunk_causal", one
copy) and teacher forcing ("teacher_forcing": a noisy and a clean copy of each episode, with an optional
window of earlier chunks)."""

from __future__ import annotations

import torch
from torch import Tensor

from flexpack.attention.mask_table import register_mask
from flexpack.attention.maskmod import MaskMod, both_sides, check_chunk, chunk_key, segment_bound, tag_mask
from flexpack.packing.layout import CLEAN, NOISY, TokenLayout


def chunk_causal_mask(layout: TokenLayout, chunk_size: int) -> MaskMod:
    """Chunk-causal attention inside each episode (LingBot-VA style, one copy).

    Note: same episode and ``frame[kv] // chunk_size <= frame[q] // chunk_size``. With
    ``chunk_size=2`` frame 3 sees frames 0-3, frame 1 sees frames 0-1. Video and action tokens of
    a frame are treated alike. Layouts with a clean copy need :func:`teacher_forcing_mask`.
    """
    check_chunk(chunk_size)
    if layout.copies != 1:
        raise ValueError(f"chunk_causal_mask needs copies=1, got copies={layout.copies}; use teacher_forcing_mask")
    doc = layout.doc
    chunk = chunk_key(layout, chunk_size)
    seg = both_sides(segment_bound(layout, lambda n: -(-n // chunk_size)))

    def chunk_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        same = (doc[q_idx] == doc[kv_idx]) & (doc[q_idx] >= 0)
        return same & (chunk[kv_idx] <= chunk[q_idx])

    return tag_mask(chunk_causal, f"chunk_causal_{chunk_size}", (doc, chunk), (doc, chunk), chunk_causal_mask.__doc__,
                runs=1, segments=seg)


def teacher_forcing_mask(layout: TokenLayout, chunk_size: int, window: int | None = None) -> MaskMod:
    """Teacher forcing with a noisy and a clean copy of each episode (chunks of ``chunk_size`` frames).

    Note: inside one episode, with ``cq``/``ck`` the query/key chunks:
    clean -> clean: ``ck <= cq``; noisy -> clean: ``ck < cq`` (strictly earlier);
    noisy -> noisy: ``ck == cq``; clean -> noisy: never. With ``window=W`` additionally
    ``cq - ck <= W``. With copies=1 every token is noisy, so only same-chunk attention remains.
    """
    check_chunk(chunk_size, window)
    doc = layout.doc
    inside = layout.valid
    copy = torch.where(inside, layout.copy, NOISY)
    chunk = chunk_key(layout, chunk_size, inside)
    seg = both_sides(segment_bound(layout, lambda n: layout.copies * -(-n // chunk_size)))
    win = window

    def teacher_forcing(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        cq, ck = chunk[q_idx], chunk[kv_idx]
        q_clean = copy[q_idx] == CLEAN
        k_clean = copy[kv_idx] == CLEAN
        same = (doc[q_idx] == doc[kv_idx]) & (doc[q_idx] >= 0)
        # a clean query keeps same-or-earlier chunks, a noisy one strictly earlier clean chunks
        to_clean = k_clean & ((ck < cq) | (q_clean & (ck == cq)))
        to_noisy = ~k_clean & ~q_clean & (ck == cq)
        ok = same & (to_clean | to_noisy)
        if win is not None:
            ok = ok & (cq - ck <= win)
        return ok

    name = f"teacher_forcing_{chunk_size}" + ("" if window is None else f"_w{window}")
    return tag_mask(teacher_forcing, name, (doc, copy, chunk), (doc, copy, chunk), teacher_forcing_mask.__doc__,
                runs=layout.copies, segments=seg)


def _chunk_causal(layout: TokenLayout, chunk_size: int | None, window: int | None) -> MaskMod:
    if chunk_size is None:
        raise ValueError("mask 'chunk_causal' needs chunk_size")
    if window is not None:
        raise ValueError(f"window={window} is only supported by the teacher_forcing mask")
    return chunk_causal_mask(layout, chunk_size)


def _teacher_forcing(layout: TokenLayout, chunk_size: int | None, window: int | None) -> MaskMod:
    if chunk_size is None:
        raise ValueError("mask 'teacher_forcing' needs chunk_size")
    return teacher_forcing_mask(layout, chunk_size, window)


# FLASH beat Triton flex by 1.2-1.4x fwd+bwd on the H200 (benchmarks/results/attention_h200.json)
register_mask("chunk_causal", build=_chunk_causal, options=("chunk_size", "window"), auto_cuda="flex-flash",
              chunked=True, families=("wanva",))
register_mask("teacher_forcing", build=_teacher_forcing, options=("chunk_size", "window"), auto_cuda="flex-flash",
              chunked=True, teacher_forcing=True, token_level=True, families=("wanva",))
