"""How a bundle's cameras compose into one latent grid, as upstream LingBot-VA training composes them.

``width_concat`` (upstream's default, and LeRobot's port): every camera side by side on width, in camera
order. ``tshape`` (upstream's ``robotwin_tshape``): the wrist cameras (every camera after the first) side by
side on width, stacked over the first (main) camera on height. ``auto``: ``width_concat`` when all cameras'
latent heights agree, else ``tshape`` when the wrists' widths add up to the main camera's, else one line naming
the cameras and their grids.
"""

from __future__ import annotations

import torch

LAYOUTS = ("auto", "width_concat", "tshape")


def resolve_layout(layout: str, grids: list[tuple[int, int]], cameras: list[str], where: str) -> str:
    """The concrete layout for cameras of latent grids ``grids`` (h, w); ValueError naming them otherwise."""
    if layout not in LAYOUTS:
        raise ValueError(f"data.camera_layout = {layout!r}: expected one of {LAYOUTS}")
    shown = ", ".join(f"{c} {h}x{w}" for c, (h, w) in zip(cameras, grids))
    same_h = len({h for h, _ in grids}) == 1
    wrists_fit = (len(grids) >= 2 and len({h for h, _ in grids[1:]}) == 1
                  and sum(w for _, w in grids[1:]) == grids[0][1])
    if layout == "width_concat" and not same_h:
        raise ValueError(f"{where}: data.camera_layout = 'width_concat' needs one latent height, the cameras are "
                         f"{shown}")
    if layout == "tshape" and not wrists_fit:
        raise ValueError(f"{where}: data.camera_layout = 'tshape' needs wrist cameras of one height whose widths "
                         f"add up to the main camera's, the cameras are {shown}")
    if layout != "auto":
        return layout
    if same_h:
        return "width_concat"
    if wrists_fit:
        return "tshape"
    raise ValueError(f"{where}: the cameras' latent grids compose neither side by side (one height) nor as a "
                     f"T (wrists' widths adding up to the main camera's): {shown}; set data.camera_layout or "
                     "data.cameras")


def grid_of(layout: str, grids: list[tuple[int, int]]) -> tuple[int, int]:
    """The composed grid (H, W)."""
    if layout == "width_concat":
        return grids[0][0], sum(w for _, w in grids)
    return grids[0][0] + grids[1][0], grids[0][1]


def compose(latents_FHWC: list[torch.Tensor], layout: str) -> torch.Tensor:
    """The cameras' ``(F, h, w, C)`` latents as one ``(C, F, H, W)`` grid."""
    if layout == "width_concat":
        joined = torch.cat(latents_FHWC, dim=2)
    else:  # tshape: wrists side by side, over the main camera
        joined = torch.cat([torch.cat(latents_FHWC[1:], dim=2), latents_FHWC[0]], dim=1)
    return joined.permute(3, 0, 1, 2).contiguous()
