"""Things to look at after sampling: action plots, latent strips, side-by-side videos, PSNR, and
the Wan VAE decode of cached latents.

Every file is written atomically (:mod:`flexpack.atomic`): a reader never sees half a PNG or mp4.
Plots use matplotlib's Agg canvas on a private ``Figure`` (no pyplot state, no display needed);
videos are H.264 (libx264, yuv420p) through PyAV.
"""

from __future__ import annotations

import functools
import math
from fractions import Fraction
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from flexpack.atomic import atomic_path

# action plot geometry (inches at DPI): a plot's pixel size follows from its dimension count alone;
# rows shrink from PLOT_ROW_IN towards PLOT_MIN_ROW_IN past 8 dimensions (30-wide action vectors)
PLOT_DPI, PLOT_WIDTH_IN, PLOT_ROW_IN, PLOT_MIN_ROW_IN, PLOT_TITLE_IN = 100, 8.0, 1.5, 0.5, 0.6
# latent strip geometry (pixels): each latent cell is upscaled (nearest) to at least STRIP_CELL px
STRIP_CELL, STRIP_BORDER, STRIP_GAP = 32, 2, 2
CONTEXT_RGB = np.array([255, 170, 0], np.uint8)  # border of context (ground-truth history) frames
TARGET_RGB = np.array([90, 90, 90], np.uint8)  # border of generated frames
BACKGROUND_RGB = np.array([255, 255, 255], np.uint8)


def action_plot_size(dims: int) -> tuple[int, int]:
    """(width, height) in pixels of :func:`action_plot` for ``dims`` action dimensions."""
    row = max(PLOT_MIN_ROW_IN, min(PLOT_ROW_IN, 8 * PLOT_ROW_IN / max(dims, 1)))
    return round(PLOT_WIDTH_IN * PLOT_DPI), round((row * dims + PLOT_TITLE_IN) * PLOT_DPI)


def action_plot(path: Path, pred_TD: np.ndarray, true_TD: np.ndarray, *, context: int, title: str = "",
                names: Sequence[str] | None = None) -> Path:
    """PNG with one subplot per action dimension over T time steps (latent frames × action steps).

    The first ``context`` steps are ground-truth history: shaded, and the prediction is drawn only
    after them (in a forecast the predicted context is the truth itself). Size: :func:`action_plot_size`.
    """
    from matplotlib.figure import Figure

    path = Path(path)
    pred, true = np.asarray(pred_TD, np.float64), np.asarray(true_TD, np.float64)
    if pred.ndim != 2 or pred.shape != true.shape:
        raise ValueError(f"{path}: pred and true must both be (T, D), got {pred.shape} and {true.shape}")
    T, D = true.shape
    if not 0 <= context <= T:
        raise ValueError(f"{path}: context must be in [0, {T}] (the time steps), got {context}")
    if names is not None and len(names) != D:
        raise ValueError(f"{path}: {len(names)} names for {D} action dimensions")
    w, h = action_plot_size(D)
    fig = Figure(figsize=(w / PLOT_DPI, h / PLOT_DPI), dpi=PLOT_DPI)
    axes = fig.subplots(D, 1, sharex=True, squeeze=False)[:, 0]
    t = np.arange(T)
    for d, ax in enumerate(axes):
        if context:
            ax.axvspan(-0.5, context - 0.5, color="0.88", lw=0, label="context")
        ax.plot(t, true[:, d], color="black", lw=1.2, label="true")
        ax.plot(t[context:], pred[context:, d], color="tab:red", lw=1.2, ls="--", label="predicted")
        ax.set_ylabel(names[d] if names is not None else f"a{d}", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlim(-0.5, T - 0.5)
    axes[0].legend(loc="upper right", fontsize=7, ncol=3, frameon=False)
    axes[-1].set_xlabel("action step", fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.6 / (h / PLOT_DPI), top=1 - 0.45 / (h / PLOT_DPI), hspace=0.15)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=PLOT_DPI)
    return path


def latent_strip_size(frames: int, height: int, width: int) -> tuple[int, int]:
    """(width, height) in pixels of :func:`latent_strip` for F latent frames of H × W."""
    s = _cell_scale(height, width)
    cw, ch = s * width + 2 * STRIP_BORDER, s * height + 2 * STRIP_BORDER
    return frames * cw + (frames + 1) * STRIP_GAP, 2 * ch + 3 * STRIP_GAP


def _cell_scale(height: int, width: int) -> int:
    return max(1, math.ceil(STRIP_CELL / max(height, width)))


def latent_strip(path: Path, pred_CFHW: np.ndarray, true_CFHW: np.ndarray, *, context: int, channels: int = 3) -> Path:
    """PNG of latent frames: top row the truth, bottom row the prediction, one column per frame.

    The first ``channels`` (1 to 3) channels are shown as RGB (one channel: grey), min-max scaled
    over both rows together so equal values look equal; cells are upscaled by an integer factor
    (nearest) to at least ``STRIP_CELL`` pixels. Each cell has a border: ``CONTEXT_RGB`` for the
    first ``context`` frames (ground-truth history), ``TARGET_RGB`` for the rest.
    Size: :func:`latent_strip_size`.
    """
    from PIL import Image

    path = Path(path)
    pred = np.asarray(pred_CFHW, np.float64)
    true = np.asarray(true_CFHW, np.float64)
    if pred.ndim != 4 or pred.shape != true.shape:
        raise ValueError(f"{path}: pred and true must both be (C, F, H, W), got {pred.shape} and {true.shape}")
    C, F, H, W = true.shape
    if not 1 <= channels <= 3:
        raise ValueError(f"{path}: channels must be 1, 2 or 3 (shown as RGB), got {channels}")
    if not 0 <= context <= F:
        raise ValueError(f"{path}: context must be in [0, {F}] (the latent frames), got {context}")
    k = min(channels, C)
    both = np.stack([true[:k], pred[:k]])  # (2, k, F, H, W)
    lo, hi = np.nanmin(both), np.nanmax(both)
    scaled = np.nan_to_num((both - lo) / (hi - lo) if hi > lo else np.zeros_like(both))
    rgb = np.zeros((2, 3, F, H, W))
    rgb[:, :k] = scaled
    if k == 1:
        rgb[:, 1:] = scaled
    pix = np.round(rgb * 255).astype(np.uint8).transpose(0, 2, 3, 4, 1)  # (2, F, H, W, 3)
    s, b, g = _cell_scale(H, W), STRIP_BORDER, STRIP_GAP
    cw, ch = s * W + 2 * b, s * H + 2 * b
    width, height = latent_strip_size(F, H, W)
    img = np.empty((height, width, 3), np.uint8)
    img[:] = BACKGROUND_RGB
    for row in range(2):
        y0 = g + row * (ch + g)
        for f in range(F):
            x0 = g + f * (cw + g)
            img[y0 : y0 + ch, x0 : x0 + cw] = CONTEXT_RGB if f < context else TARGET_RGB
            img[y0 + b : y0 + ch - b, x0 + b : x0 + cw - b] = pix[row, f].repeat(s, 0).repeat(s, 1)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        Image.fromarray(img).save(tmp, format="PNG")
    return path


def video_mp4(path: Path, pred_FHW3: np.ndarray, true_FHW3: np.ndarray, *, fps: float) -> Path:
    """H.264 mp4 (libx264, yuv420p) with the predicted frames on the left and the true on the right.

    Frames are uint8 RGB ``(F, H, W, 3)``; yuv420p needs even sizes, so an odd height or joined
    width gets one black row / column.
    """
    import av

    path = Path(path)
    pred, true = np.asarray(pred_FHW3), np.asarray(true_FHW3)
    if pred.ndim != 4 or pred.shape[-1] != 3 or pred.shape != true.shape:
        raise ValueError(f"{path}: pred and true must both be (F, H, W, 3), got {pred.shape} and {true.shape}")
    if pred.dtype != np.uint8 or true.dtype != np.uint8:
        raise ValueError(f"{path}: frames must be uint8, got {pred.dtype} and {true.dtype}")
    if pred.shape[0] < 1:
        raise ValueError(f"{path}: no frames to write")
    if not (math.isfinite(fps) and fps > 0):
        raise ValueError(f"{path}: fps must be a positive number, got {fps!r}")
    frames = np.concatenate([pred, true], axis=2)  # (F, H, 2W, 3)
    F, H, W, _ = frames.shape
    frames = np.pad(frames, ((0, 0), (0, H % 2), (0, W % 2), (0, 0)))
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        with av.open(str(tmp), mode="w", format="mp4") as container:
            stream = container.add_stream("libx264", rate=Fraction(fps).limit_denominator(1001))
            stream.width, stream.height = frames.shape[2], frames.shape[1]
            stream.pix_fmt = "yuv420p"
            stream.options = {"crf": "18"}
            for frame in frames:
                container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24")))
            container.mux(stream.encode())  # flush the encoder's delayed frames
    return path


def psnr(pred: np.ndarray, true: np.ndarray, data_range: float = 2.0) -> float:
    """Peak signal-to-noise ratio in dB, ``10·log10(range² / MSE)``; ``inf`` when equal.

    ``data_range`` 2.0 fits values in [−1, 1] (decoded video before quantization); 255 fits uint8.
    """
    p, t = np.asarray(pred, np.float64), np.asarray(true, np.float64)
    if p.shape != t.shape:
        raise ValueError(f"psnr: pred and true shapes differ: {p.shape} vs {t.shape}")
    if not data_range > 0:
        raise ValueError(f"psnr: data_range must be positive, got {data_range!r}")
    mse = float(np.mean((p - t) ** 2))
    return math.inf if mse == 0 else 10.0 * math.log10(data_range**2 / mse)


@functools.lru_cache(maxsize=1)
def _wan_vae(path: str, device: str):
    """The encoder's loader (same checks, same normalization constants); kept for the next call,
    as a sampler decodes many pairs with one VAE."""
    from flexpack.data.encoders import WanVAEEncoder

    return WanVAEEncoder(path, device=device)


def decode_latents(latent_CFHW: torch.Tensor, encoder: str, *, device: str = "cpu") -> np.ndarray | None:
    """Video frames ``(F', H, W, 3)`` uint8 decoded from cached latents with the Wan VAE the cache's
    ``encoder`` string names (``wan-vae:PATH``); ``None`` for encoders without a decoder (``pool``).

    Inverts the encoder exactly: the cache holds ``(z − latents_mean) / latents_std`` (when the VAE
    config has them), so ``z = latent · std + mean`` is decoded; the VAE's output in [−1, 1] maps to
    ``(x + 1) · 127.5``. F' = stride·(F − 1) + 1. Several cameras joined along width decode as one
    wide frame.
    """
    prefix = "wan-vae:"
    if not encoder.startswith(prefix) or len(encoder) == len(prefix):
        return None
    if latent_CFHW.ndim != 4:
        raise ValueError(f"latent must be (C, F, H, W), got shape {tuple(latent_CFHW.shape)}")
    enc = _wan_vae(encoder[len(prefix) :], str(device))
    z = latent_CFHW.detach().float().cpu()
    if enc.mean is not None:
        z = z / enc.inv_std + enc.mean
    with torch.no_grad():
        x_13THW = enc.vae.decode(z.unsqueeze(0).to(enc.device, enc.dtype)).sample
    x = x_13THW[0].float().clamp(-1, 1).cpu()  # (3, T, H, W)
    return ((x + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()
