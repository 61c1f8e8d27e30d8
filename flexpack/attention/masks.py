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
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from flexpack.packing.layout import CLEAN, NOISY, TokenLayout

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def _tag(
    fn: MaskMod,
    name: str,
    q_keys: tuple[Tensor, ...],
    kv_keys: tuple[Tensor, ...],
    doc: str | None = None,
    runs: int | None = None,
    segments: tuple[int, int] | None = None,
) -> MaskMod:
    fn.__name__ = name
    fn.__doc__ = doc  # the factory's docstring: its Note pins the convention
    fn.__qualname__ = name
    fn.q_keys = q_keys  # type: ignore[attr-defined]
    fn.kv_keys = kv_keys  # type: ignore[attr-defined]
    fn.runs = runs  # type: ignore[attr-defined]
    fn.segments = segments  # type: ignore[attr-defined]
    return fn


def _segment_bound(layout: TokenLayout, per_episode: Callable[[int], int]) -> int | None:
    """Upper bound on key segments in token order: ``per_episode(frames)`` per episode run, one
    per padding run, plus one spare; ``None`` for layouts without host-side runs."""
    if not layout.runs:
        return None
    return sum(per_episode(n) if d >= 0 else 1 for d, n in layout.runs) + 1


def _both(bound: int | None) -> tuple[int, int] | None:
    return None if bound is None else (bound, bound)


def _chunk_key(layout: TokenLayout, chunk_size: int, inside: Tensor | None = None) -> Tensor:
    """frame // chunk_size inside episodes, -1 on padding (one segment per padding run).
    ``inside`` is ``layout.doc >= 0`` when the caller has it already."""
    return torch.where(layout.valid if inside is None else inside, layout.frame // chunk_size, -1)


def _check_chunk(chunk_size: int, window: int | None = None) -> None:
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if window is not None and (not isinstance(window, int) or window < 0):
        raise ValueError(f"window must be None or an int >= 0 (earlier chunks visible), got {window!r}")


def document_mask(layout: TokenLayout) -> MaskMod:
    """Bidirectional attention inside each episode.

    Note: ``doc[q] == doc[kv]`` and ``doc[q] >= 0``. With ``doc = [0, 0, 1, -1]`` token 2 sees
    only itself, token 3 (padding) sees nothing and is seen by nothing.
    """
    doc = layout.doc

    def document(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return (doc[q_idx] == doc[kv_idx]) & (doc[q_idx] >= 0)

    seg = _both(_segment_bound(layout, lambda n: 1))
    return _tag(document, "document", (doc,), (doc,), document_mask.__doc__, runs=1, segments=seg)


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

    return _tag(valid_frame, "valid_frame", (valid,), (valid,), valid_frame_mask.__doc__)


def chunk_causal_mask(layout: TokenLayout, chunk_size: int) -> MaskMod:
    """Chunk-causal attention inside each episode (LingBot-VA style, one copy).

    Note: same episode and ``frame[kv] // chunk_size <= frame[q] // chunk_size``. With
    ``chunk_size=2`` frame 3 sees frames 0-3, frame 1 sees frames 0-1. Video and action tokens of
    a frame are treated alike. Layouts with a clean copy need :func:`teacher_forcing_mask`.
    """
    _check_chunk(chunk_size)
    if layout.copies != 1:
        raise ValueError(f"chunk_causal_mask needs copies=1, got copies={layout.copies}; use teacher_forcing_mask")
    doc = layout.doc
    chunk = _chunk_key(layout, chunk_size)
    seg = _both(_segment_bound(layout, lambda n: -(-n // chunk_size)))

    def chunk_causal(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        same = (doc[q_idx] == doc[kv_idx]) & (doc[q_idx] >= 0)
        return same & (chunk[kv_idx] <= chunk[q_idx])

    return _tag(chunk_causal, f"chunk_causal_{chunk_size}", (doc, chunk), (doc, chunk), chunk_causal_mask.__doc__,
                runs=1, segments=seg)


def teacher_forcing_mask(layout: TokenLayout, chunk_size: int, window: int | None = None) -> MaskMod:
    """Teacher forcing with a noisy and a clean copy of each episode (chunks of ``chunk_size`` frames).

    Note: inside one episode, with ``cq``/``ck`` the query/key chunks:
    clean -> clean: ``ck <= cq``; noisy -> clean: ``ck < cq`` (strictly earlier);
    noisy -> noisy: ``ck == cq``; clean -> noisy: never. With ``window=W`` additionally
    ``cq - ck <= W``. With copies=1 every token is noisy, so only same-chunk attention remains.
    """
    _check_chunk(chunk_size, window)
    doc = layout.doc
    inside = layout.valid
    copy = torch.where(inside, layout.copy, NOISY)
    chunk = _chunk_key(layout, chunk_size, inside)
    seg = _both(_segment_bound(layout, lambda n: layout.copies * -(-n // chunk_size)))
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
    return _tag(teacher_forcing, name, (doc, copy, chunk), (doc, copy, chunk), teacher_forcing_mask.__doc__,
                runs=layout.copies, segments=seg)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1): sizes that take few values as n varies."""
    return 1 << max(n - 1, 0).bit_length()


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

    q_bound = _segment_bound(layout, lambda n: 1)
    seg = None if q_bound is None else (q_bound, 2 * (tdoc.numel() // text_tokens) + 1)  # valid + padding per slot
    return _tag(text, f"text_{text_tokens}", (doc,), (tdoc,), text_mask.__doc__, runs=1, segments=seg)


def all_of(*mask_mods: MaskMod) -> MaskMod:
    """Intersection of masks that keeps the ``q_keys``/``kv_keys`` needed by fast block masks."""
    if not mask_mods:
        raise ValueError("all_of needs at least one mask_mod")

    def intersection(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        out = mask_mods[0](b, h, q_idx, kv_idx)
        for m in mask_mods[1:]:
            out = out & m(b, h, q_idx, kv_idx)
        return out

    q_keys: tuple[Tensor, ...] = ()
    kv_keys: tuple[Tensor, ...] = ()
    for m in mask_mods:
        if not hasattr(m, "q_keys"):
            raise ValueError(f"all_of needs masks from flexpack.attention.masks (with q_keys), got {m!r}")
        q_keys += m.q_keys  # type: ignore[attr-defined]
        kv_keys += m.kv_keys  # type: ignore[attr-defined]
    name = "_and_".join(m.__name__ for m in mask_mods)
    # an intersection of ranges is a range, but a union of ranges intersected with one is not:
    # the bound holds when at most one operand has more than one range
    bounds = [getattr(m, "runs", None) for m in mask_mods]
    runs = None if None in bounds or sum(b > 1 for b in bounds) > 1 else max(bounds)
    return _tag(intersection, name, q_keys, kv_keys, "Intersection of: " + ", ".join(m.__name__ for m in mask_mods),
                runs)


def _per_episode(value: int | Tensor, layout: TokenLayout, name: str, least: int) -> Tensor:
    """(E,) int64 on the layout's device: one value per episode slot (an int is every episode's)."""
    E = layout.text_len.numel()
    dev = layout.doc.device
    if isinstance(value, Tensor):
        if value.shape != (E,) or value.is_floating_point():
            raise ValueError(f"{name} must be an int or an (E,)=({E},) integer tensor, got {tuple(value.shape)} "
                             f"{value.dtype}")
        if value.device.type == "cpu" and value.numel() and int(value.min()) < least:  # no check (sync) on a GPU
            raise ValueError(f"{name} values must be >= {least}, got {value.tolist()}")
        return value.to(dev, torch.int64)
    if not isinstance(value, int) or value < least:
        raise ValueError(f"{name} must be an int >= {least} or an (E,) tensor, got {value!r}")
    return torch.full((E,), value, dtype=torch.int64, device=dev)


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
    chunk_E = _per_episode(chunk_size, layout, "chunk_size", 1)
    win_E = _per_episode(window, layout, "window", 0)
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
    seg = _both(_segment_bound(layout, lambda n: layout.copies * n * per_cell))
    mod = _tag(lingbot, "lingbot", (doc, copy, fid), (doc, copy, fid), lingbot_mask.__doc__, runs=None, segments=seg)
    mod.segments_per_cell = per_cell  # type: ignore[attr-defined]
    return mod


MASK_KINDS = ("document", "valid", "chunk_causal", "teacher_forcing", "text", "lingbot")


def make_mask(
    layout: TokenLayout,
    kind: str,
    *,
    chunk_size: int | Tensor | None = None,
    window: int | Tensor | None = None,
    text_tokens: int | None = None,
    text_slots: int | None = None,
) -> MaskMod:
    """The mask_mod for one of :data:`MASK_KINDS` ("valid" = document ∧ valid-frame)."""
    if kind == "document":
        return document_mask(layout)
    if kind == "valid":
        mod = all_of(document_mask(layout), valid_frame_mask(layout))
        mod.runs = layout.copies  # type: ignore[attr-defined]  # each copy's valid frames are one run
        # keys (doc, valid): per episode and copy a valid prefix and an invalid rest
        mod.segments = _both(_segment_bound(layout, lambda n: 2 * layout.copies))  # type: ignore[attr-defined]
        return mod
    if kind in ("chunk_causal", "teacher_forcing"):
        if chunk_size is None:
            raise ValueError(f"mask {kind!r} needs chunk_size")
        if kind == "chunk_causal":
            if window is not None:
                raise ValueError(f"window={window} is only supported by the teacher_forcing mask")
            return chunk_causal_mask(layout, chunk_size)
        return teacher_forcing_mask(layout, chunk_size, window)
    if kind == "lingbot":
        if chunk_size is None or window is None:
            raise ValueError("mask 'lingbot' needs chunk_size and window (ints or one per episode)")
        return lingbot_mask(layout, chunk_size, window)
    if kind == "text":
        if text_tokens is None:
            raise ValueError("mask 'text' needs text_tokens (text tokens per episode)")
        return text_mask(layout, text_tokens, text_slots)
    raise ValueError(f"unknown mask {kind!r}; expected one of {MASK_KINDS}")


def dense_mask(mask_mod: MaskMod, q_len: int, kv_len: int, device: torch.device | str | None = None) -> Tensor:
    """(q_len, kv_len) bool: the mask evaluated on the full index grid (the reference)."""
    if device is None:  # the device of the tensors the closure reads (keys, or range bounds)
        keys = getattr(mask_mod, "q_keys", ()) or [c.cell_contents for c in mask_mod.__closure__ or ()
                                                     if isinstance(c.cell_contents, Tensor)]
        device = keys[0].device if keys else "cpu"
    q = torch.arange(q_len, device=device)[:, None]
    kv = torch.arange(kv_len, device=device)[None, :]
    zero = torch.zeros((), dtype=torch.int64, device=device)
    return mask_mod(zero, zero, q, kv).expand(q_len, kv_len)
