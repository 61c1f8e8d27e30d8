"""What every mask family shares: the ``mask_mod`` type, the tags a mask_mod carries, and helpers.

A mask_mod is a small pure function ``mask_mod(b, h, q_idx, kv_idx) -> bool`` over a layout's per-token
tensors (:mod:`flexpack.attention.masks` pins the conventions). :func:`tag_mask` names it and attaches
what the block-mask builder reads: ``q_keys`` / ``kv_keys`` (the per-token tensors its value depends on),
``segments`` (host-side bounds on the number of constant runs of those keys, or None) and ``runs`` (a
bound on the key ranges one query sees, or None). A mask family (``mask_document.py``, ``mask_chunk.py``,
``mask_text.py``, a model family's own such as ``families/lingbot/mask.py``, or one registered from outside
flexpack) builds its mask_mods with these helpers and declares itself in the mask table
(:mod:`flexpack.attention.mask_table`).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from flexpack.packing.layout import TokenLayout

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def tag_mask(
    fn: MaskMod,
    name: str,
    q_keys: tuple[Tensor, ...],
    kv_keys: tuple[Tensor, ...],
    doc: str | None = None,
    runs: int | None = None,
    segments: tuple[int, int] | None = None,
) -> MaskMod:
    """``fn`` named ``name``, with the attributes the block-mask builder reads (see the module docstring);
    ``doc``: the factory's docstring, whose Note pins the mask's convention."""
    fn.__name__ = name
    fn.__doc__ = doc  # the factory's docstring: its Note pins the convention
    fn.__qualname__ = name
    fn.q_keys = q_keys  # type: ignore[attr-defined]
    fn.kv_keys = kv_keys  # type: ignore[attr-defined]
    fn.runs = runs  # type: ignore[attr-defined]
    fn.segments = segments  # type: ignore[attr-defined]
    return fn


def segment_bound(layout: TokenLayout, per_episode: Callable[[int], int]) -> int | None:
    """Upper bound on key segments in token order: ``per_episode(frames)`` per episode run, one
    per padding run, plus one spare; ``None`` for layouts without host-side runs."""
    if not layout.runs:
        return None
    return sum(per_episode(n) if d >= 0 else 1 for d, n in layout.runs) + 1


def both_sides(bound: int | None) -> tuple[int, int] | None:
    """The same segment bound for the query and the key side (self-attention), or None."""
    return None if bound is None else (bound, bound)


def chunk_key(layout: TokenLayout, chunk_size: int, inside: Tensor | None = None) -> Tensor:
    """frame // chunk_size inside episodes, -1 on padding (one segment per padding run).
    ``inside`` is ``layout.doc >= 0`` when the caller has it already."""
    return torch.where(layout.valid if inside is None else inside, layout.frame // chunk_size, -1)


def check_chunk(chunk_size: int, window: int | None = None) -> None:
    if not isinstance(chunk_size, int) or chunk_size <= 0:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    if window is not None and (not isinstance(window, int) or window < 0):
        raise ValueError(f"window must be None or an int >= 0 (earlier chunks visible), got {window!r}")



def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1): sizes that take few values as n varies."""
    return 1 << max(n - 1, 0).bit_length()




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
    return tag_mask(intersection, name, q_keys, kv_keys, "Intersection of: " + ", ".join(m.__name__ for m in mask_mods),
                runs)


def per_episode_values(value: int | Tensor, layout: TokenLayout, name: str, least: int) -> Tensor:
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
