"""Pad and pack collates: dataset items → :class:`Batch` with one :class:`SequenceLayout`.

Items are dicts as :class:`flexpack.data.LatentEpisodeDataset` returns them:

- ``latent``: (C, F, H, W) float — required;
- ``action``: (Ca, F, A) float and ``action_mask``: (Ca, F, A) bool — optional (a missing mask
  means every value is real);
- ``text``: (L, Dt) float and ``text_len``: int — optional;
- ``episode_index``: int — optional (``-1`` when absent);
- ``segment``: int — optional, the item's segment inside its episode (``-1`` when absent: a whole
  episode); the layout carries both (``episode_index``, ``episode_segment``).

Items of different latent grids (H, W) share a micro-batch where the collate is given the run's grid
(``grid=``, the largest (H, W) of the run): each sits at the top-left of its frames, the rest is spatial padding
(:mod:`flexpack.packing.grids`); without ``grid`` the items' grids must agree, as before.

Pad mode (:class:`PadCollate`): one episode per row, ``F_pad = round_up(max F, pad_multiple)``.
Pack mode (:class:`PackCollate`): all items back to back in one row of ``frame_budget`` frames,
the rest padding — one shape for every micro-batch. Both zero the padding and return the same
kind of layout, so the model cannot tell them apart.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping, Sequence

import torch
from torch import Tensor

from .geometry import frame_budget
from .layout import SequenceLayout, hf_packing_kwargs

Item = Mapping[str, Any]


@dataclass(frozen=True, eq=False)
class Batch:
    """One micro-batch: ``R`` rows × ``Fr`` latent frames, ``E`` episodes.

    Attributes:
        latent:      (R, C, Fr, H, W), zero on padding frames.
        action:      (R, Ca, Fr, A) or None, zero where ``action_mask`` is False.
        action_mask: (R, Ca, Fr, A) bool or None — True where a real action value exists.
        text:        (E, L, Dt) or None, zero beyond each episode's ``text_len``.
        layout:      the :class:`SequenceLayout` (doc ids, positions, valid frames, text lengths).
        tokens_per_frame: the model's tokens of one latent frame (video + action, one copy) as the
                     collate knows them (:meth:`PackCollate.from_token_budget`), or None.

    HF-style callers get packing keys (``position_ids``, ``seq_idx``, ``cu_seq_lens_q/k``,
    ``max_length_q/k``) from the layout when they ask: :meth:`hf_packing_kwargs`.
    """

    latent: Tensor
    action: Tensor | None
    action_mask: Tensor | None
    text: Tensor | None
    layout: SequenceLayout
    tokens_per_frame: int | None = None

    @property
    def valid_frames(self) -> Tensor:
        return self.layout.valid_frames

    @property
    def doc_ids(self) -> Tensor:
        """(R, Fr) episode slot per frame, -1 for padding."""
        return self.layout.frame_doc

    @property
    def cu_seqlens(self) -> Tensor:
        return self.layout.cu_seqlens

    @property
    def text_len(self) -> Tensor:
        return self.layout.text_len

    def hf_packing_kwargs(self, tokens_per_frame: int | None = None) -> dict[str, Tensor | int]:
        """HF-compatible packing keys of this batch's layout, counted in tokens of ``tokens_per_frame`` per
        latent frame (:func:`~flexpack.packing.layout.hf_packing_kwargs`; pack mode). Default: the tokens per
        frame the collate recorded (:attr:`tokens_per_frame`); without a record, one per frame (the keys then
        count latent frames, not the model's tokens), with a warning."""
        if tokens_per_frame is None:
            tokens_per_frame = self.tokens_per_frame
        if tokens_per_frame is None:
            warnings.warn("Batch.hf_packing_kwargs(): the batch records no tokens per frame (its collate was not "
                          "made by PackCollate.from_token_budget), so the keys count latent frames; pass "
                          "tokens_per_frame= to count the model's tokens", UserWarning, stacklevel=2)
            tokens_per_frame = 1
        return hf_packing_kwargs(self.layout, tokens_per_frame)

    @property
    def extras(self) -> dict[str, Tensor | int]:
        """Deprecated (goes in flexpack 0.3): :meth:`hf_packing_kwargs` (pack mode; ``{}`` in pad mode, as before)."""
        warnings.warn("Batch.extras is deprecated (it goes in flexpack 0.3): use Batch.hf_packing_kwargs(), which "
                      "counts the tokens per frame the collate recorded", DeprecationWarning, stacklevel=2)
        return self.hf_packing_kwargs(self.tokens_per_frame or 1) if self.layout.mode == "pack" else {}

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "Batch":
        """The batch on ``device``. To a GPU the layout always copies without blocking, from page-locked
        memory (:func:`~flexpack.packing.transfer.to_device`), and keeps its host copy, which host-side
        code reads instead of the device tensors."""
        moved = {
            f.name: getattr(self, f.name).to(device, non_blocking=non_blocking)
            for f in fields(self)
            if isinstance(getattr(self, f.name), Tensor)
        }
        return replace(self, layout=self.layout.to(device), **moved)

    def pin_memory(self) -> "Batch":
        """The batch in page-locked memory (``DataLoader(pin_memory=True)`` calls this, in its pinning
        thread), so ``to(device, non_blocking=True)`` copies without blocking the host. The layout
        is pinned too: it is copied every step, and pinned tensors read on the host as any other."""
        pinned = {f.name: getattr(self, f.name).pin_memory() for f in fields(self)
                  if isinstance(getattr(self, f.name), Tensor)}
        return replace(self, layout=self.layout.pin_memory(), **pinned)


def _name(item: Item, i: int) -> str:
    return f"item {i} (episode {item.get('episode_index', '?')})"


def _check_items(items: Sequence[Item], grid: tuple[int, int] | None = None) -> tuple[list[int], bool, bool]:
    """Validate shapes against the first item (``grid``: the run's latent grid, which each item's must fit);
    return frame counts, has-action, has-text."""
    if len(items) == 0:
        raise ValueError("cannot collate an empty list of items")
    first = items[0]
    for key in ("latent",):
        if key not in first:
            raise ValueError(f"{_name(first, 0)} has no '{key}' field")
    c, _, h, w = _shape(first, 0, "latent", 4)
    has_action, has_text = "action" in first, "text" in first
    frames = []
    for i, it in enumerate(items):
        ci, f, hi, wi = _shape(it, i, "latent", 4)
        if grid is not None:
            if ci != c or hi > grid[0] or wi > grid[1]:
                raise ValueError(f"{_name(it, i)}: latent (C,H,W)={(ci, hi, wi)} does not fit the run's grid "
                                 f"(C,H,W)={(c, *grid)}")
        elif (ci, hi, wi) != (c, h, w):
            raise ValueError(f"{_name(it, i)}: latent (C,H,W)={(ci, hi, wi)} differs from item 0's {(c, h, w)}")
        frames.append(f)
        if ("action" in it) != has_action or ("text" in it) != has_text:
            raise ValueError(f"{_name(it, i)}: items disagree on having 'action'/'text' fields")
        if has_action:
            ca, fa, a = _shape(it, i, "action", 3)
            if fa != f:
                raise ValueError(f"{_name(it, i)}: action has {fa} frames but latent has {f}")
            if (ca, a) != tuple(first["action"].shape[::2]):
                raise ValueError(f"{_name(it, i)}: action (Ca, A)={(ca, a)} differs from item 0's")
            if "action_mask" in it and tuple(it["action_mask"].shape) != tuple(it["action"].shape):
                raise ValueError(f"{_name(it, i)}: action_mask shape {tuple(it['action_mask'].shape)} != action shape")
        if has_text:
            _, dt = _shape(it, i, "text", 2)
            if dt != first["text"].shape[1]:
                raise ValueError(f"{_name(it, i)}: text width {dt} differs from item 0's {first['text'].shape[1]}")
    return frames, has_action, has_text


def _shape(item: Item, i: int, key: str, ndim: int) -> tuple[int, ...]:
    x = item[key]
    if not isinstance(x, Tensor) or x.ndim != ndim:
        got = tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__
        raise ValueError(f"{_name(item, i)}: '{key}' must be a {ndim}-d tensor, got {got}")
    if key == "latent" and x.shape[1] <= 0:
        raise ValueError(f"{_name(item, i)}: latent has no frames")
    return tuple(x.shape)


def _segments(items: Sequence[Item]) -> list[int]:
    return [int(it.get("segment", -1)) for it in items]


def _text(items: Sequence[Item]) -> tuple[Tensor, list[int]]:
    L = max(it["text"].shape[0] for it in items)
    dt = items[0]["text"].shape[1]
    text = torch.zeros(len(items), L, dt, dtype=items[0]["text"].dtype)
    lens = []
    for e, it in enumerate(items):
        n = int(it.get("text_len", it["text"].shape[0]))
        if not 0 <= n <= it["text"].shape[0]:
            raise ValueError(f"{_name(it, e)}: text_len={n} outside 0..{it['text'].shape[0]}")
        text[e, :n] = it["text"][:n]
        lens.append(n)
    return text, lens


def _grids(items: Sequence[Item], grid: tuple[int, int] | None) -> dict[str, Any]:
    """The layout's spatial-padding arguments: the run's grid and each item's, or none without a run grid."""
    if grid is None:
        return {}
    return {"grid_hw": grid, "episode_hw": [tuple(it["latent"].shape[2:]) for it in items]}


def _place(
    items: Sequence[Item], rows: list[list[int]], frames_per_row: int, has_action: bool,
    grid: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Copy items into zeroed (R, C, Fr, H, W) / (R, Ca, Fr, A) grids following ``rows`` (item ids); each item's
    latent at the top-left of the run's ``grid`` where given."""
    lat0 = items[0]["latent"]
    C, _, H, W = lat0.shape
    if grid is not None:
        H, W = grid
    R = len(rows)
    latent = torch.zeros(R, C, frames_per_row, H, W, dtype=lat0.dtype)
    action = mask = None
    if has_action:
        ca, _, a = items[0]["action"].shape
        action = torch.zeros(R, ca, frames_per_row, a, dtype=items[0]["action"].dtype)
        mask = torch.zeros(R, ca, frames_per_row, a, dtype=torch.bool)
    for r, ids in enumerate(rows):
        start = 0
        for i in ids:
            it = items[i]
            f = min(it["latent"].shape[1], frames_per_row - start)
            h, w = it["latent"].shape[2:]
            latent[r, :, start : start + f, :h, :w] = it["latent"][:, :f]
            if has_action:
                m = it.get("action_mask")
                m = torch.ones_like(it["action"], dtype=torch.bool) if m is None else m.bool()
                mask[r, :, start : start + f] = m[:, :f]
                # values outside the mask are zeroed so nothing unmasked can leak through
                action[r, :, start : start + f] = torch.where(m[:, :f], it["action"][:, :f], 0)
            start += f
    return latent, action, mask


class PadCollate:
    """Pad mode: one episode per row, frames rounded up to ``pad_multiple``.

    ``F_pad = round_up(max F, pad_multiple)`` — few distinct shapes, as the bucket sampler plans.
    ``grid``: the run's latent grid (H, W) where its items' grids differ (see the module docstring).
    """

    def __init__(self, pad_multiple: int = 8, *, grid: tuple[int, int] | None = None) -> None:
        if pad_multiple <= 0:
            raise ValueError(f"pad_multiple must be positive, got {pad_multiple}")
        self.pad_multiple = pad_multiple
        self.grid = None if grid is None else (int(grid[0]), int(grid[1]))

    def __call__(self, items: Sequence[Item]) -> Batch:
        frames, has_action, has_text = _check_items(items, self.grid)
        f_pad = -(-max(frames) // self.pad_multiple) * self.pad_multiple
        latent, action, mask = _place(items, [[i] for i in range(len(items))], f_pad, has_action, self.grid)
        text, text_len = _text(items) if has_text else (None, None)
        layout = SequenceLayout.from_rows(
            [[f] for f in frames], f_pad,
            episode_index=[int(it.get("episode_index", -1)) for it in items], text_len=text_len, mode="pad",
            segment=_segments(items), **_grids(items, self.grid),
        )
        return Batch(latent, action, mask, text, layout)


class PackCollate:
    """Pack mode: items concatenated along the frame axis into one row of ``frame_budget`` frames.

    Every micro-batch has the same shape ``(1, C, frame_budget, H, W)``. Items that do not fit are
    an error naming them (the token-budget sampler never produces such a micro-batch); with
    ``crop=True`` a single item longer than the budget is cut to it instead. A collate made by
    :meth:`from_token_budget` records its tokens per frame in every batch (``Batch.tokens_per_frame``).
    ``tokens_per_frame=`` here is deprecated (it goes in flexpack 0.3): use :meth:`from_token_budget`.
    ``grid``: the run's latent grid (H, W) where its items' grids differ (see the module docstring).
    """

    def __init__(self, frame_budget: int, *, crop: bool = False, tokens_per_frame: int | None = None,
                 grid: tuple[int, int] | None = None) -> None:
        if frame_budget <= 0:
            raise ValueError(f"frame_budget must be positive, got {frame_budget}")
        if tokens_per_frame is not None:
            warnings.warn("PackCollate(frame_budget, tokens_per_frame=...) is deprecated (it goes in flexpack 0.3): "
                          "use PackCollate.from_token_budget(max_tokens, tokens_per_frame)", DeprecationWarning,
                          stacklevel=2)
            if tokens_per_frame <= 0:
                raise ValueError(f"tokens_per_frame must be positive, got {tokens_per_frame}")
        self.frame_budget = frame_budget
        self.crop = crop
        self.tokens_per_frame = tokens_per_frame
        self.grid = None if grid is None else (int(grid[0]), int(grid[1]))

    @staticmethod
    def from_token_budget(max_tokens: int, tokens_per_frame: int, *, crop: bool = False,
                          grid: tuple[int, int] | None = None) -> "PackCollate":
        """The collate matching a token-budget sampler: ``frame_budget = max_tokens // tokens_per_frame``; its
        batches record ``tokens_per_frame`` (the unit of :meth:`Batch.hf_packing_kwargs`)."""
        if tokens_per_frame <= 0 or max_tokens < tokens_per_frame:
            raise ValueError(f"need 0 < tokens_per_frame <= max_tokens, got {tokens_per_frame}, {max_tokens}")
        out = PackCollate(frame_budget(max_tokens, tokens_per_frame), crop=crop, grid=grid)
        out.tokens_per_frame = tokens_per_frame
        return out

    def __call__(self, items: Sequence[Item]) -> Batch:
        frames, has_action, has_text = _check_items(items, self.grid)
        if self.crop and len(items) == 1:
            frames = [min(frames[0], self.frame_budget)]
        if sum(frames) > self.frame_budget:
            who = ", ".join(f"episode {it.get('episode_index', i)} ({f} frames)"
                            for i, (it, f) in enumerate(zip(items, frames)))
            raise ValueError(f"{sum(frames)} frames do not fit the frame budget {self.frame_budget}: {who}")
        latent, action, mask = _place(items, [list(range(len(items)))], self.frame_budget, has_action, self.grid)
        text, text_len = _text(items) if has_text else (None, None)
        layout = SequenceLayout.from_rows(
            [frames], self.frame_budget,
            episode_index=[int(it.get("episode_index", -1)) for it in items], text_len=text_len, mode="pack",
            segment=_segments(items), **_grids(items, self.grid),
        )
        return Batch(latent, action, mask, text, layout, tokens_per_frame=self.tokens_per_frame)
