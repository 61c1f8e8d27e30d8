"""Mask conventions pinned on tiny layouts, and every mask vs an independent reference rule."""

from __future__ import annotations

import random

import pytest
import torch
from torch.nn.attention.flex_attention import and_masks, or_masks

from flexpack.attention.masks import (
    chunk_causal_mask,
    dense_mask,
    document_mask,
    make_mask,
    teacher_forcing_mask,
    text_mask,
    valid_frame_mask,
)
from flexpack.packing.layout import SequenceLayout, TokenLayout


def grid(mod, tq: int, tk: int | None = None) -> list[list[int]]:
    return dense_mask(mod, tq, tk or tq).int().tolist()


def test_document_mask_pinned() -> None:
    lay = SequenceLayout.from_lengths([2, 3], pad_to=6).tokens()
    assert lay.doc.tolist() == [0, 0, 1, 1, 1, -1]
    m = document_mask(lay)
    assert m.__name__ == "document" and "Note" in (m.__doc__ or "")
    assert grid(m, 6) == [
        [1, 1, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 0],  # padding sees nothing and is seen by nothing
    ]


def test_chunk_causal_pinned() -> None:
    # one episode of 4 frames, 1 token per frame, chunks of 2 frames: {0,1}, {2,3}
    lay = SequenceLayout.from_rows([[4]], 5).tokens()
    assert grid(chunk_causal_mask(lay, 2), 5) == [
        [1, 1, 0, 0, 0],
        [1, 1, 0, 0, 0],
        [1, 1, 1, 1, 0],
        [1, 1, 1, 1, 0],
        [0, 0, 0, 0, 0],
    ]
    assert chunk_causal_mask(lay, 2).__name__ == "chunk_causal_2"


def test_teacher_forcing_pinned() -> None:
    # one episode, 3 frames, chunk 1, copies 2: tokens n0 n1 n2 c0 c1 c2
    lay = SequenceLayout.from_rows([[3]], 3).tokens(copies=2)
    assert lay.copy.tolist() == [0, 0, 0, 1, 1, 1] and lay.frame.tolist() == [0, 1, 2, 0, 1, 2]
    assert grid(teacher_forcing_mask(lay, 1), 6) == [
        # noisy -> noisy same chunk; noisy -> clean strictly earlier
        [1, 0, 0, 0, 0, 0],
        [0, 1, 0, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        # clean -> clean same or earlier; clean -> noisy never
        [0, 0, 0, 1, 0, 0],
        [0, 0, 0, 1, 1, 0],
        [0, 0, 0, 1, 1, 1],
    ]
    # window counts earlier chunks: window=1 drops chunk distance 2
    assert grid(teacher_forcing_mask(lay, 1, window=1), 6)[5] == [0, 0, 0, 0, 1, 1]
    assert grid(teacher_forcing_mask(lay, 1, window=1), 6)[2] == [0, 0, 1, 0, 1, 0]
    assert grid(teacher_forcing_mask(lay, 1, window=0), 6)[5] == [0, 0, 0, 0, 0, 1]


def test_text_mask_pinned() -> None:
    lay = SequenceLayout.from_rows([[1, 2]], 4, text_len=[2, 0]).tokens()
    # text: 3 tokens per episode, episode 0 has 2 valid, episode 1 none
    assert grid(text_mask(lay, 3), 4, 6) == [
        [1, 1, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
        [0, 0, 0, 0, 0, 0],
    ]


def test_valid_frame_mask_pad_mode() -> None:
    lay = SequenceLayout.from_rows([[2], [3]], 3, mode="pad").tokens()
    v = [1, 1, 0, 1, 1, 1]
    assert grid(valid_frame_mask(lay), 6) == [[a * b for b in v] for a in v]
    # composed with the document mask this is the "valid" mask: no cross-row attention
    assert dense_mask(make_mask(lay, "valid"), 6, 6).equal(dense_mask(document_mask(lay), 6, 6))


def test_masks_compose_with_torch_and_or() -> None:
    lay = SequenceLayout.from_rows([[3, 2]], 6).tokens(2, 1)
    doc, cc = document_mask(lay), chunk_causal_mask(lay, 1)
    T = lay.num_tokens
    assert dense_mask(and_masks(doc, cc), T, T, "cpu").equal(dense_mask(cc, T, T))
    assert dense_mask(or_masks(doc, cc), T, T, "cpu").equal(dense_mask(doc, T, T))


@pytest.mark.parametrize("bad", [
    lambda lay: chunk_causal_mask(lay, 0),
    lambda lay: teacher_forcing_mask(lay, 2, window=-1),
    lambda lay: text_mask(lay, 0),
    lambda lay: make_mask(lay, "causal"),
    lambda lay: make_mask(lay, "chunk_causal"),
    lambda lay: chunk_causal_mask(SequenceLayout.from_rows([[2]], 2).tokens(copies=2), 1),
    lambda lay: text_mask(lay, 1),  # text_len 2 does not fit
])
def test_bad_arguments_raise(bad) -> None:
    lay = SequenceLayout.from_rows([[2]], 3, text_len=[2]).tokens()
    with pytest.raises(ValueError):
        bad(lay)


# ---------------------------------------------------------------- reference rule
def reference_mask(lay: TokenLayout, kind: str, chunk: int = 1, window: int | None = None, L: int = 0) -> torch.Tensor:
    """The spec written pair by pair in plain Python (independent of flexpack.attention.masks)."""
    doc, fr, cp = lay.doc.tolist(), lay.frame.tolist(), lay.copy.tolist()
    T = len(doc)
    if kind == "text":
        tl = lay.text_len.tolist()
        kdoc = [e if j < tl[e] else -1 for e in range(len(tl)) for j in range(L)]
        return torch.tensor([[doc[i] >= 0 and doc[i] == kdoc[j] for j in range(len(kdoc))] for i in range(T)])
    out = torch.zeros(T, T, dtype=torch.bool)
    for i in range(T):
        for j in range(T):
            if doc[i] < 0 or doc[i] != doc[j]:
                continue
            cq, ck = fr[i] // chunk, fr[j] // chunk
            if kind in ("document", "valid"):
                ok = True
            elif kind == "chunk_causal":
                ok = ck <= cq
            else:
                ok = {(0, 0): ck == cq, (0, 1): ck < cq, (1, 1): ck <= cq, (1, 0): False}[(cp[i], cp[j])]
                ok = ok and (window is None or cq - ck <= window)
            out[i, j] = ok
    return out


def random_layout(rng: random.Random, copies: int) -> TokenLayout:
    E = rng.randint(1, 12)
    lens = [rng.randint(1, 4) for _ in range(E)]
    if rng.random() < 0.5:  # pad mode: one episode per row, padded rows
        Fr = max(lens) + rng.randint(0, 2)
        sl = SequenceLayout.from_rows([[n] for n in lens], Fr, mode="pad", text_len=[rng.randint(0, 3) for _ in lens])
    else:
        sl = SequenceLayout.from_rows([lens], sum(lens) + rng.randint(0, 3), text_len=[rng.randint(0, 3) for _ in lens])
    return sl.tokens(rng.choice([1, 2, 3]), rng.choice([0, 1]), copies=copies)


@pytest.mark.parametrize("seed", range(12))
def test_every_mask_matches_reference_rule(seed: int) -> None:
    rng = random.Random(seed)
    for kind in ("document", "valid", "chunk_causal", "teacher_forcing", "text"):
        copies = 1 if kind == "chunk_causal" else rng.choice([1, 2])
        lay = random_layout(rng, copies)
        chunk = rng.randint(1, 3)
        window = rng.choice([None, 0, 1]) if kind == "teacher_forcing" else None
        kw = {"chunk_size": chunk} if kind in ("chunk_causal", "teacher_forcing") else {}
        if window is not None:
            kw["window"] = window
        L = 3 if kind == "text" else 0
        if L:
            kw["text_tokens"] = L
        mod = make_mask(lay, kind, **kw)
        T = lay.num_tokens
        got = dense_mask(mod, T, L * lay.text_len.numel() if L else T)
        want = reference_mask(lay, kind, chunk, window, L)
        assert got.equal(want), (kind, seed)
