"""The pictures of one sampling, per episode (its first cut point, all K samples of it):

- ``episode_EEEEEE.mp4`` for every sampled episode: predicted next to true at the video's frame
  rate, labelled, context frames framed orange; decoded through the Wan VAE when the cache was made
  with it, otherwise the latents rendered large (:func:`flexpack.sampling.frames.latent_rgb`);
- for the first ``plots`` episodes ``episode_EEEEEE_actions.png``: every action dimension over
  time in seconds (one unit: each step at its video frame's time), the context's true actions,
  the K samples thin and their mean dashed, the ``last`` / ``mean`` baselines as thin dotted lines,
  chunk boundaries as thin vertical lines, in the dataset's original units; and
  ``episode_EEEEEE_latents.png``: true, predicted and error per latent frame.

Titles say forecast or rollout, the episode, the context and the horizon in latent frames and seconds.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from flexpack.data.actions import step_frames
from flexpack.data.normalization import ActionStats
from flexpack.sampling import frames, media
from flexpack.sampling.metrics import Metrics, denormalize
from flexpack.sampling.pairs import Pair

if TYPE_CHECKING:
    from flexpack.data.dataset import LatentEpisodeDataset

PANEL_PX = 192  # the shorter side of each video panel, at least (latents are upscaled to it)


def first_groups(pairs: Sequence[Pair]) -> list[list[Pair]]:
    """Per episode (in order) the K samples of its first cut point."""
    out: dict[int, list[Pair]] = {}
    for p in pairs:
        group = out.setdefault(p.episode, [])
        if not group or p.cut == group[0].cut:
            group.append(p)
    return list(out.values())


def title(pair: Pair, mode: str, stride: int, fps: float, samples: int) -> str:
    """Two lines: "forecast | episode 9 | 4 samples" and "context: 2 latent frames (0.50 s); predicted:
    the next 4 (1.60 s)" (a rollout's: "..., each stage from the model's own output")."""
    ctx_s = (stride * (pair.cut - 1) + 1) / fps  # video frames of latent frames [0, cut)
    k = f" | {samples} samples" if samples > 1 else ""
    stages = ", each stage from the model's own output" if mode == "rollout" else ""
    return (f"{mode} | episode {pair.episode}{k}\ncontext: {pair.cut} latent frames ({ctx_s:.2f} s); predicted: "
            f"the next {pair.horizon} ({pair.horizon * stride / fps:.2f} s){stages}")


def _columns(x_CLA: torch.Tensor, mask: torch.Tensor, channels: np.ndarray) -> np.ndarray:
    """(Ca, L, A) → (L, A, D) dataset columns, NaN where no real value exists."""
    a = torch.where(mask, x_CLA.double(), float("nan"))[torch.as_tensor(channels)]
    return a.permute(1, 2, 0).numpy()


def action_series(group: Sequence[Pair], dataset: LatentEpisodeDataset, action_stats: ActionStats | None,
                  mean_raw: Sequence[float] | None, fps: float) -> dict[str, Any]:
    """What :func:`media.action_plot` draws for the K samples of one (episode, cut), in original units:
    ``t`` (seconds), ``true`` (T, D), ``pred`` (K, T, D), ``baselines`` {name: (T, D)}, ``context``
    (steps), over the steps that exist (latent frame 0 has only its last)."""
    p = group[0]
    L, A = p.frames, p.action.shape[2]
    v_LA = step_frames(L, A, dataset.stride)
    keep = (v_LA >= 0).reshape(-1)
    cols = np.asarray(dataset.channels)
    raw = lambda y_LAD: denormalize(action_stats, y_LAD, np.arange(len(cols))).reshape(L * A, -1)[keep]  # noqa: E731
    base = {}
    for name, (act, _) in Metrics(action_stats, cols, mean_raw).baselines(p).items():
        full = torch.full_like(p.action, float("nan"), dtype=torch.float64)
        full[:, p.cut:] = torch.as_tensor(np.array(act))  # a copy: the baseline may be read-only
        base[name] = raw(_columns(full, p.action_mask, cols))
    return {"t": v_LA.reshape(-1)[keep] / fps,
            "true": raw(_columns(p.action, p.action_mask, cols)),
            "pred": np.stack([raw(_columns(q.pred_action, q.action_mask, cols)) for q in group]),
            "baselines": base, "context": int(keep.reshape(L, A)[:p.cut].sum())}


def write_media(out: Path, pairs: Sequence[Pair], dataset: LatentEpisodeDataset, plots: int,
                device: torch.device | str = "cpu", *,
                action_stats: ActionStats | None = None, mean_raw: Sequence[float] | None = None,
                names: Sequence[str] | None = None, mode: str = "forecast", chunk: int = 1
                ) -> tuple[dict[str, Path], dict[str, float]]:
    """The pictures of the module docstring (``plots`` = 0: none); returns ({tag: file}, PSNR metrics
    of the decoded target frames with a Wan VAE cache). The VAE decodes on ``device``."""
    from flexpack.data.cache import read_latent_header

    if plots <= 0:
        return {}, {}
    files: dict[str, Path] = {}
    if hasattr(dataset, "latent_file"):
        header = read_latent_header(dataset.latent_file(0))
        s, fps, encoder = dataset.stride, float(header.fps), header.encoder
    else:  # a bundle: its encoding's video frames per latent frame, its fps; no decoder named
        s, fps, encoder = dataset.stride, dataset.fps, dataset.encoder
    psnrs, base = [], []
    for n, group in enumerate(first_groups(pairs)):
        p, stem = group[0], f"episode_{group[0].episode:06d}"
        head = title(p, mode, s, fps, len(group))
        if n < plots and p.action is not None:
            series = action_series(group, dataset, action_stats, mean_raw, fps)
            edges = [(s * (f - 1) + 0.5) / fps for f in range(chunk, p.frames, chunk)]  # between latent frames
            files[f"sample/{stem}/actions"] = media.action_plot(
                out / f"{stem}_actions.png", series["pred"], series["true"], context=series["context"], title=head,
                names=names, t=series["t"], baselines=series["baselines"], boundaries=edges,
                xlabel="time (s): each action step at its video frame; dotted: baselines")
        pred = media.decode_latents(p.pred_latent, encoder, device=str(device))
        context = s * (p.cut - 1) + 1  # video frames of the context
        if pred is None:  # no decoder: the latents rendered large
            (pred_rgb, true_rgb), note = frames.latent_rgb([p.pred_latent.numpy(), p.latent.numpy()], encoder)
            if n < plots:
                times = [s * f / fps for f in range(p.frames)]
                files[f"sample/{stem}/latents"] = frames.latent_figure(
                    out / f"{stem}_latents.png", pred_rgb, true_rgb, context=p.cut, times=times, title=head, note=note)
            pred, true = (frames.to_uint8(frames.video_rate(x, s)) for x in (pred_rgb, true_rgb))
            head = f"{head}\n{note}"
        else:
            true = media.decode_latents(p.latent, encoder, device=str(device))
            to = lambda v: v[context:].astype(np.float32) / 127.5 - 1.0  # noqa: E731
            psnrs.append(media.psnr(to(pred), to(true)))
            last = np.repeat(true[context - 1:context], len(true) - context, axis=0)
            base.append(media.psnr(last.astype(np.float32) / 127.5 - 1.0, to(true)))
        scale = max(1, -(-PANEL_PX // min(pred.shape[1:3])))
        left = f"predicted (sample 1 of {len(group)})" if len(group) > 1 else "predicted"
        media.write_mp4(out / f"{stem}.mp4", frames.side_by_side(pred, true, context=context, fps=fps, scale=scale,
                                                                 title=head, left=left), fps=fps)
    # decoding is the costly part: PSNR covers one pair per episode (their count is recorded beside it)
    extra = {"psnr": float(np.mean(psnrs)), "psnr_baseline_last": float(np.mean(base)), "psnr_pairs": len(psnrs)} \
        if psnrs else {}
    return files, extra
