"""Spatial padding: episodes of smaller latent grids in micro-batches of the run's largest grid.

A run whose datasets compose to different latent grids packs them on one grid, the largest ``(H, W)``
(:attr:`~flexpack.packing.layout.SequenceLayout.grid_hw`), so every micro-batch keeps one shape. An episode of
grid ``(h, w)`` (``SequenceLayout.episode_hw``) sits at the top-left of each of its frames
(``latent[..., :h, :w]``); the rest of the frame is *spatial padding*: no loss, no noise that counts, no attention.

Tokens (:func:`spatial_tokens`): inside each frame the episode's own patches come first, in its own row-major
order, then the padding patches, so an episode's tokens have exactly the order and RoPE positions ``(f, h, w)``
they have alone, and the padding of a frame is one contiguous run (one more segment per frame for block masks,
and whole empty blocks for the kernels). Padding tokens belong to no episode (``doc = -1``): every mask already
keeps them out on both sides, and the backends give their rows zeros.

A layout without ``episode_hw`` (every episode fills the grid: a run of one grid) takes none of these paths.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def frame_grid(layout: Any) -> Tensor:
    """(R, Fr, 2) int64 latent grid ``(h, w)`` of every frame (padding frames: the full grid); host layout."""
    H, W = layout.grid_hw
    hw = layout.episode_hw
    full = torch.tensor([H, W], dtype=torch.int64, device=hw.device)
    if hw.shape[0] == 0:
        return full.expand(*layout.frame_doc.shape, 2)
    doc = layout.frame_doc.to(hw.device)
    return torch.where((doc >= 0)[..., None], hw[doc.clamp(min=0)], full)


def latent_valid(layout: Any, device: torch.device | str | None = None) -> Tensor | None:
    """(R, 1, Fr, H, W) bool: latent elements that belong to an episode (valid frame, inside its grid); None for
    a layout without spatial padding (then ``frame_valid`` says it all)."""
    if layout.episode_hw is None:
        return None
    dev = layout.frame_doc.device if device is None else device
    H, W = layout.grid_hw
    g = frame_grid(layout).to(dev)
    y = torch.arange(H, device=dev).view(1, 1, H, 1)
    x = torch.arange(W, device=dev).view(1, 1, 1, W)
    inside = (y < g[..., 0, None, None]) & (x < g[..., 1, None, None])  # (R, Fr, H, W)
    return (inside & (layout.frame_doc.to(dev) >= 0)[..., None, None])[:, None]


def latent_counter(layout: Any, C: int, H: int, W: int, device: torch.device | str) -> Tensor:
    """(R, C, Fr, H, W) int64: each latent element's index inside its episode, ``(frame, channel, y, x)`` counted
    over the episode's own grid, so counter-based noise is the same packed, padded or alone."""
    R, Fr = layout.frame_doc.shape
    pos = layout.frame_pos.to(device).view(R, 1, Fr, 1, 1)
    c = torch.arange(C, device=device).view(1, C, 1, 1, 1)
    if layout.episode_hw is None:
        yx = torch.arange(H * W, device=device).view(1, 1, 1, H, W)
        return (pos * C + c) * (H * W) + yx
    g = frame_grid(layout).to(device)
    h, w = g[..., 0].view(R, 1, Fr, 1, 1), g[..., 1].view(R, 1, Fr, 1, 1)
    y = torch.arange(H, device=device).view(1, 1, 1, H, 1)
    x = torch.arange(W, device=device).view(1, 1, 1, 1, W)
    return (pos * C + c) * (h * w) + y * w + x


def latent_elements(layout: Any, C: int, H: int, W: int) -> Tensor:
    """Latent elements that count in a loss (valid frames, inside their episode's grid), as a float scalar."""
    m = latent_valid(layout)
    if m is None:
        return layout.frame_valid.sum().float() * (C * H * W)
    return m.sum().float() * C


def frame_elements(layout: Any, C: int, H: int, W: int) -> Tensor | int:
    """(R, Fr) latent elements of every frame's episode grid (``C * h * w``), or the int ``C * H * W`` for a layout
    without spatial padding."""
    if layout.episode_hw is None:
        return C * H * W
    g = frame_grid(layout).to(layout.frame_doc.device)
    return C * g[..., 0] * g[..., 1]


def patch_grids(layout: Any, grid_hw: tuple[int, int]) -> Tensor:
    """(E, 2) patch grid of every episode, for a frame of ``grid_hw`` patches; one line naming an episode whose
    latent grid the patch size does not divide."""
    H, W = layout.grid_hw
    h, w = grid_hw
    if H % h or W % w:
        raise ValueError(f"the patch grid {grid_hw} does not divide the layout's latent grid {(H, W)}")
    ph, pw = H // h, W // w
    hw = layout.episode_hw
    bad = ((hw[:, 0] % ph) != 0) | ((hw[:, 1] % pw) != 0)
    if bool(bad.any()):
        e = int(bad.nonzero()[0, 0])
        raise ValueError(f"episode {int(layout.episode_index[e])}: latent grid {tuple(hw[e].tolist())} is not a "
                         f"multiple of the patch size {(ph, pw)}")
    if bool(((hw[:, 0] > H) | (hw[:, 1] > W)).any()):
        raise ValueError(f"an episode's latent grid exceeds the layout's {(H, W)}: {hw.tolist()}")
    return torch.stack([hw[:, 0] // ph, hw[:, 1] // pw], dim=1)


def spatial_tokens(layout: Any, grid_hw: tuple[int, int]) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Per (row, frame, video slot) of a host layout with ``episode_hw``, for frames of ``grid_hw`` patches:
    ``slot`` (R, Fr, nv) the patch (row-major over the full grid) that video slot ``j`` holds — the episode's
    patches first, in its own row-major order, then the padding patches in row-major order (a permutation of
    the frame's patches); ``real`` (R, Fr, nv) bool, slot ``j`` holds one of the episode's patches; ``hpos`` /
    ``wpos`` (R, Fr, nv) the patch row / column of slot ``j`` inside the episode's own grid (0 on padding)."""
    h, w = grid_hw
    nv = h * w
    R, Fr = layout.frame_doc.shape
    pg = patch_grids(layout, grid_hw)
    full = torch.tensor([h, w], dtype=torch.int64)
    doc = layout.frame_doc
    g = torch.where((doc >= 0)[..., None], pg[doc.clamp(min=0)], full) if pg.shape[0] else full.expand(R, Fr, 2)
    he, we = g[..., 0:1], g[..., 1:2]  # (R, Fr, 1)
    p = torch.arange(nv)
    inside = ((p // w) < he) & ((p % w) < we)  # (R, Fr, nv) patch p belongs to the episode
    slot = torch.argsort(torch.where(inside, p, nv + p), dim=-1)  # episode's patches first, each part row-major
    j = p.expand(R, Fr, nv)
    real = j < he * we
    hpos = torch.where(real, j // we, 0)
    wpos = torch.where(real, j % we, 0)
    return slot, real, hpos, wpos


def episode_video_tokens(layout: Any, video_tokens: int) -> list[int]:
    """Video tokens of one frame of each episode of a host layout: ``video_tokens`` (a full frame's) scaled by
    the episode's grid's share of the batch's."""
    E = layout.episode_frames.shape[0]
    if layout.episode_hw is None:
        return [int(video_tokens)] * E
    H, W = layout.grid_hw
    return [int(h * w * video_tokens) // (H * W) for h, w in layout.episode_hw.tolist()]


def real_tokens(layout: Any, tokens_per_frame: int, video_tokens: int) -> int:
    """Tokens of one copy that belong to an episode in a host layout: its frames' tokens less their spatial
    padding (:func:`episode_video_tokens`)."""
    n = int(layout.episode_frames.sum()) * tokens_per_frame
    own = episode_video_tokens(layout, video_tokens)
    return n - sum((video_tokens - v) * f for v, f in zip(own, layout.episode_frames.tolist()))


def padding_share(lengths: list[int], grids: list[tuple[int, int]], grid_hw: tuple[int, int]) -> float:
    """Share of the latent elements of ``lengths`` (frames of each item, at ``grids``' latent grid) that are
    spatial padding on the run's ``grid_hw``: what items of smaller grids waste."""
    H, W = grid_hw
    full = sum(n * H * W for n in lengths)
    real = sum(n * h * w for n, (h, w) in zip(lengths, grids))
    return 0.0 if full == 0 else 1.0 - real / full
