"""Latents and decoded frames as pictures a reader can take in: large, labelled, context marked.

- :func:`latent_rgb`: cached latents (C, F, H, W) as RGB images. A ``pool`` cache (flexpack's
  stand-in encoder: a fixed linear map of each 16×16 cell's mean colour to 48 channels) maps back
  exactly through that map's pseudo-inverse, so the images are the cell colours the latents were
  made from (a prediction is shown by its nearest colours), stretched to the full range on one
  scale. Any other cache: channels 0-2, on one min-max scale across everything shown together.
- :func:`latent_figure`: a PNG with the true latent frames above the predicted ones and their
  difference below, one column per latent frame, context columns framed in orange.
- :func:`side_by_side`: video frames predicted | true, upscaled, with a bar naming each side and
  saying whether the frame is context (true history, orange) or generated (grey), and its time.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Sequence

import numpy as np

from flexpack.atomic import atomic_path

CONTEXT_COLOR, TARGET_COLOR = (255, 170, 0), (110, 110, 110)  # frame borders: true history / generated
CELL_IN = 0.9  # inches per latent frame column of latent_figure


@functools.lru_cache(maxsize=1)
def _pool_unmix(channels: int) -> np.ndarray | None:
    """(3, C) pseudo-inverse of the pool encoder's colour map, None when its width is not ``channels``."""
    from flexpack.data.encoders import PoolEncoder

    pool = PoolEncoder()
    if pool.channels != channels:
        return None
    return np.linalg.pinv(pool.proj_C3.double().numpy())


def latent_rgb(latents_CFHW: Sequence[np.ndarray], encoder: str) -> tuple[list[np.ndarray], str]:
    """Each (C, F, H, W) latent as (F, H', W', 3) float RGB in [0, 1] (all on one scale), and a line
    saying what the colours are. A ``pool`` latent becomes its cells' colours at the video's size
    (each cell ``spatial`` pixels wide); others keep their size."""
    lats = [np.asarray(z, np.float64) for z in latents_CFHW]
    C = lats[0].shape[0]
    unmix = _pool_unmix(C) if encoder == "pool" else None
    if unmix is not None:
        from flexpack.data.encoders import PoolEncoder

        cell = PoolEncoder().spatial
        rgbs = [np.einsum("dc,cfhw->fhwd", unmix, z) for z in lats]  # the pooled colours in [-1, 1]
        lo = min(float(x.min()) for x in rgbs)
        hi = max(max(float(x.max()) for x in rgbs), lo + 1e-6)
        # one linear stretch for every frame shown: a cell's mean colour is faint where a small bright
        # object covers part of it, and equal colours must still look equal
        out = [np.clip((x - lo) / (hi - lo), 0, 1).repeat(cell, axis=1).repeat(cell, axis=2) for x in rgbs]
        return out, (f"pool latents mapped back to colour: each {cell}x{cell}-pixel cell's mean colour, "
                     "contrast stretched (one scale for all)")
    k = min(3, C)
    lo = min(float(np.nanmin(z[:k])) for z in lats)
    hi = max(float(np.nanmax(z[:k])) for z in lats)
    out = []
    for z in lats:
        x = np.nan_to_num((z[:k] - lo) / (hi - lo) if hi > lo else np.zeros_like(z[:k]))
        rgb = np.repeat(x, 3, axis=0) if k == 1 else np.concatenate([x, np.zeros((3 - k, *x.shape[1:]))])
        out.append(rgb.transpose(1, 2, 3, 0))
    return out, f"latent channels 0-{k - 1} as RGB, one scale ({lo:.3g} to {hi:.3g}) for every frame shown"


def latent_figure(path: Path, pred_FHW3: np.ndarray, true_FHW3: np.ndarray, *, context: int,
                  times: Sequence[float] | None = None, title: str = "", note: str = "") -> Path:
    """PNG: rows true, predicted and |predicted − true| (mean over colour, black = 0), one column per
    latent frame (``times``: each column's time in seconds); the first ``context`` columns are true
    history (orange frame), the rest generated (grey)."""
    from matplotlib.figure import Figure

    path = Path(path)
    pred, true = np.asarray(pred_FHW3, np.float64), np.asarray(true_FHW3, np.float64)
    if pred.ndim != 4 or pred.shape != true.shape or pred.shape[-1] != 3:
        raise ValueError(f"{path}: pred and true must both be (F, H, W, 3), got {pred.shape} and {true.shape}")
    F = true.shape[0]
    if not 0 <= context <= F:
        raise ValueError(f"{path}: context must be in [0, {F}] (the latent frames), got {context}")
    err = np.abs(pred - true).mean(-1)
    top = max(float(err.max()), 1e-12)
    width = max(6.0, CELL_IN * F + 1.0)
    fig = Figure(figsize=(width, 3 * CELL_IN + 1.3), dpi=100)
    axes = fig.subplots(3, F, squeeze=False)
    for f in range(F):
        color = np.array(CONTEXT_COLOR if f < context else TARGET_COLOR) / 255
        for row, img in enumerate((true[f], pred[f], err[f])):
            ax = axes[row, f]
            if row < 2:
                ax.imshow(np.clip(img, 0, 1), interpolation="nearest")
            else:
                ax.imshow(img, cmap="gray", vmin=0, vmax=top, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            for spine in ax.spines.values():
                spine.set_color(color)
                spine.set_linewidth(3 if row < 2 else 1)
        label = f"{f}" + (f"\n{times[f]:.2f} s" if times is not None else "")
        axes[0, f].set_title(label, fontsize=7, color="darkorange" if f < context else "0.3")
    for row, name in enumerate(("true", "predicted", f"|error|\n(max {top:.2g})")):
        axes[row, 0].set_ylabel(name, fontsize=8)
    head = title + (f"\n{note}" if note else "")
    head += ("\n" if head else "") + "latent frame (time); orange: context (true history), grey: generated"
    fig.suptitle(head, fontsize=8)
    fig.subplots_adjust(left=0.6 / width, right=1 - 0.2 / width, bottom=0.05, top=1 - 0.9 / (3 * CELL_IN + 1.3),
                        wspace=0.08, hspace=0.08)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    return path


def _font(size: int):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)
    except TypeError:  # Pillow < 10.1: the fixed bitmap font
        return ImageFont.load_default()


def side_by_side(pred_FHW3: np.ndarray, true_FHW3: np.ndarray, *, context: int, fps: float, scale: int = 1,
                 title: str = "", left: str = "predicted") -> np.ndarray:
    """(F, H', W', 3) uint8 video frames: predicted (left, named ``left``) and true (right), each
    upscaled ``scale`` times (nearest), framed orange for the first ``context`` frames (true history)
    and grey after, under a bar with ``title`` (its lines, wrapped), each side's name, "context" or
    "generated" and the frame's time."""
    from PIL import Image, ImageDraw

    pred, true = np.asarray(pred_FHW3), np.asarray(true_FHW3)
    if pred.ndim != 4 or pred.shape != true.shape or pred.dtype != np.uint8 or true.dtype != np.uint8:
        raise ValueError(f"pred and true must both be uint8 (F, H, W, 3), got {pred.dtype}{pred.shape} and "
                         f"{true.dtype}{true.shape}")
    F, H, W, _ = pred.shape
    b, gap, line = 4, 8, 14  # border, margin, title line height (pixels)
    ph, pw = H * scale + 2 * b, W * scale + 2 * b
    width = 2 * pw + 3 * gap
    font, small = _font(14), _font(11)
    lines = [w for text in (title.splitlines() if title else []) for w in _wrap(text, small, width - 2 * gap)]
    bar = gap + line * len(lines) + 36  # the title, then each side's name and state
    height = bar + ph + gap
    width, height = width + width % 2, height + height % 2  # yuv420p needs even sizes
    xs = [gap + i * (pw + gap) for i in range(2)]  # each side's left edge

    def template(color: tuple[int, int, int]) -> np.ndarray:
        """Everything of a frame but its pictures and its state line, framed in ``color``."""
        img = Image.new("RGB", (width, height), (255, 255, 255))
        draw = ImageDraw.Draw(img)
        for i, text in enumerate(lines):
            draw.text((gap, gap // 2 + i * line), text, fill=(0, 0, 0), font=small)
        for x0, name in zip(xs, (left, "true")):
            draw.text((x0, bar - 34), name, fill=(0, 0, 0), font=font)
            draw.rectangle([x0, bar, x0 + pw - 1, bar + ph - 1], fill=color)
        return np.asarray(img)

    def state(f: int) -> np.ndarray:
        """The (16, pw, 3) line "context (true history), 0.30 s" / "generated, 1.20 s" of frame ``f``."""
        text = f"{'context (true history)' if f < context else 'generated'}, {f / fps:.2f} s"
        img = Image.new("RGB", (pw, 16), (255, 255, 255))
        ImageDraw.Draw(img).text((0, 1), text, fill=CONTEXT_COLOR if f < context else TARGET_COLOR, font=small)
        return np.asarray(img)

    templates = {True: template(CONTEXT_COLOR), False: template(TARGET_COLOR)}
    out = np.empty((F, height, width, 3), np.uint8)
    for f in range(F):
        out[f] = templates[f < context]
        line_f = state(f)
        for x0, frame in zip(xs, (pred[f], true[f])):
            out[f, bar - 16:bar, x0:x0 + pw] = line_f
            out[f, bar + b:bar + b + H * scale, x0 + b:x0 + b + W * scale] = frame.repeat(scale, 0).repeat(scale, 1)
    return out


def _wrap(text: str, font, width: int) -> list[str]:
    """``text`` in lines no wider than ``width`` pixels in ``font`` (words kept whole)."""
    from PIL import Image, ImageDraw

    measure = ImageDraw.Draw(Image.new("RGB", (1, 1))).textlength
    lines: list[str] = []
    for word in text.split(" "):
        if lines and measure(f"{lines[-1]} {word}", font=font) <= width:
            lines[-1] = f"{lines[-1]} {word}"
        else:
            lines.append(word)
    return lines


def video_rate(latent_FHW3: np.ndarray, stride: int) -> np.ndarray:
    """Latent frames at the video's rate: frame 0 once (it covers one video frame), every later one
    ``stride`` times (it covers ``stride``), as the causal VAE counts them."""
    x = np.asarray(latent_FHW3)
    return np.concatenate([x[:1], x[1:].repeat(stride, axis=0)])


def to_uint8(rgb: np.ndarray) -> np.ndarray:
    """Float RGB in [0, 1] as uint8."""
    return np.round(np.clip(rgb, 0, 1) * 255).astype(np.uint8)
