"""Things to look at after sampling: action plots, side-by-side videos, PSNR, and the Wan VAE decode
of cached latents (latents as pictures: :mod:`flexpack.sampling.frames`).

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
# rows shrink from PLOT_ROW_IN towards PLOT_MIN_ROW_IN past 8 dimensions (30-wide action vectors);
# PLOT_TITLE_IN above the rows holds the title and the legend
PLOT_DPI, PLOT_WIDTH_IN, PLOT_ROW_IN, PLOT_MIN_ROW_IN, PLOT_TITLE_IN = 100, 8.0, 1.5, 0.5, 1.2
# thin baseline lines of the action plot, by baseline name
BASELINE_STYLE = {"last": dict(color="tab:blue", ls=":", lw=0.9), "mean": dict(color="tab:green", ls=":", lw=0.9)}


def action_plot_size(dims: int) -> tuple[int, int]:
    """(width, height) in pixels of :func:`action_plot` for ``dims`` action dimensions."""
    row = max(PLOT_MIN_ROW_IN, min(PLOT_ROW_IN, 8 * PLOT_ROW_IN / max(dims, 1)))
    return round(PLOT_WIDTH_IN * PLOT_DPI), round((row * dims + PLOT_TITLE_IN) * PLOT_DPI)


def action_plot(path: Path, pred_TD: np.ndarray, true_TD: np.ndarray, *, context: int, title: str = "",
                names: Sequence[str] | None = None, t: np.ndarray | None = None,
                baselines: dict[str, np.ndarray] | None = None, boundaries: Sequence[float] = (),
                xlabel: str = "action step") -> Path:
    """PNG with one subplot per action dimension over T time steps (latent frames × action steps).

    ``true_TD`` (T, D): the truth, context included (NaN where a step has no value). ``pred_TD``:
    (T, D), or (K, T, D) for K samples of one forecast (each drawn thin, their mean dashed). The
    first ``context`` steps are ground-truth history: shaded, and predictions are drawn only after
    them. ``t`` (T,): the x position of every step (default 0..T-1, in ``xlabel``'s unit);
    ``baselines``: name → (T, D), drawn as thin dotted lines (NaN where not shown); ``boundaries``:
    x positions of chunk boundaries, thin vertical lines. Size: :func:`action_plot_size`.
    """
    from matplotlib.figure import Figure

    path = Path(path)
    pred, true = np.asarray(pred_TD, np.float64), np.asarray(true_TD, np.float64)
    samples = pred if pred.ndim == 3 else pred[None]
    if true.ndim != 2 or samples.shape[1:] != true.shape or samples.shape[0] < 1:
        raise ValueError(f"{path}: pred must be (T, D) or (K, T, D) and true (T, D), got {pred.shape} and {true.shape}")
    T, D = true.shape
    if not 0 <= context <= T:
        raise ValueError(f"{path}: context must be in [0, {T}] (the time steps), got {context}")
    if names is not None and len(names) != D:
        raise ValueError(f"{path}: {len(names)} names for {D} action dimensions")
    x = np.arange(T, dtype=np.float64) if t is None else np.asarray(t, np.float64)
    if x.shape != (T,):
        raise ValueError(f"{path}: t must have one position per time step ({T}), got shape {x.shape}")
    for name, b in (baselines or {}).items():
        if np.shape(b) != (T, D):
            raise ValueError(f"{path}: baseline {name!r} must be (T, D) = {(T, D)}, got {np.shape(b)}")
    step = float(np.median(np.diff(x))) if T > 1 else 1.0
    ctx_end = x[0] - step / 2 if context == 0 else (x[context - 1] + (x[context] if context < T else x[-1] + step)) / 2
    w, h = action_plot_size(D)
    fig = Figure(figsize=(w / PLOT_DPI, h / PLOT_DPI), dpi=PLOT_DPI)
    axes = fig.subplots(D, 1, sharex=True, squeeze=False)[:, 0]
    K = samples.shape[0]
    for d, ax in enumerate(axes):
        if context:
            ax.axvspan(x[0] - step / 2, ctx_end, color="0.88", lw=0, label="context (true history)")
        for i, b in enumerate(boundaries):
            ax.axvline(b, color="0.75", lw=0.5, zorder=0, label="chunk boundary" if i == 0 else None)
        ax.plot(x, true[:, d], color="black", lw=1.2, label="true")
        if K > 1:
            for k in range(K):
                ax.plot(x[context:], samples[k, context:, d], color="tab:red", lw=0.6, alpha=0.35,
                        label=f"{K} samples" if k == 0 else None)
        ax.plot(x[context:], samples[:, context:, d].mean(0), color="tab:red", lw=1.2, ls="--",
                label="predicted (mean of samples)" if K > 1 else "predicted")
        for name, b in (baselines or {}).items():
            ax.plot(x, np.asarray(b, np.float64)[:, d], label=f"baseline: {name}",
                    **BASELINE_STYLE.get(name, dict(color="0.4", ls=":", lw=0.9)))
        ax.set_ylabel(names[d] if names is not None else f"a{d}", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.set_xlim(x[0] - step / 2, x[-1] + step / 2)
    # from the top: the title, the legend (up to two rows), then the axes; inches over the figure's height
    h_in = h / PLOT_DPI
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, 1 - 0.45 / h_in), fontsize=7,
               ncol=min(len(labels), 4), frameon=False)
    axes[-1].set_xlabel(xlabel, fontsize=8)
    if title:
        fig.suptitle(title, fontsize=9, y=1 - 0.06 / h_in)
    fig.subplots_adjust(left=0.09, right=0.98, bottom=0.6 / h_in, top=1 - 0.95 / h_in, hspace=0.15)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=PLOT_DPI)
    return path


def video_mp4(path: Path, pred_FHW3: np.ndarray, true_FHW3: np.ndarray, *, fps: float) -> Path:
    """H.264 mp4 (libx264, yuv420p) with the predicted frames on the left and the true on the right.

    Frames are uint8 RGB ``(F, H, W, 3)``; yuv420p needs even sizes, so an odd height or joined
    width gets one black row / column. Labelled frames: :func:`flexpack.sampling.frames.side_by_side`
    then :func:`write_mp4`.
    """
    path = Path(path)
    pred, true = np.asarray(pred_FHW3), np.asarray(true_FHW3)
    if pred.ndim != 4 or pred.shape[-1] != 3 or pred.shape != true.shape:
        raise ValueError(f"{path}: pred and true must both be (F, H, W, 3), got {pred.shape} and {true.shape}")
    if pred.dtype != np.uint8 or true.dtype != np.uint8:
        raise ValueError(f"{path}: frames must be uint8, got {pred.dtype} and {true.dtype}")
    return write_mp4(path, np.concatenate([pred, true], axis=2), fps=fps)  # (F, H, 2W, 3)


def write_mp4(path: Path, frames_FHW3: np.ndarray, *, fps: float) -> Path:
    """H.264 mp4 (libx264, yuv420p, crf 18) of uint8 RGB frames ``(F, H, W, 3)`` (odd sizes padded)."""
    import av

    path = Path(path)
    frames = np.asarray(frames_FHW3)
    if frames.ndim != 4 or frames.shape[-1] != 3 or frames.dtype != np.uint8:
        raise ValueError(f"{path}: frames must be uint8 (F, H, W, 3), got {frames.dtype} {frames.shape}")
    if frames.shape[0] < 1:
        raise ValueError(f"{path}: no frames to write")
    if not (math.isfinite(fps) and fps > 0):
        raise ValueError(f"{path}: fps must be a positive number, got {fps!r}")
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
