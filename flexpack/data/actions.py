"""Actions: normalization from dataset stats, channel mapping, alignment to latent frames.

Alignment (the VAE is causal in time with stride ``s``, default 4). Latent frame 0 covers video
frame 0 alone; latent frame ``f >= 1`` covers video frames ``s(f-1)+1 … s·f``. Each latent frame
carries ``A`` action steps. With ``A == s`` step ``a`` of latent frame ``f`` is the action of
video frame

    v(f, a) = s·(f − 1) + (a + 1)·(s / A)

i.e. one action per video frame in order. With ``A`` a divisor of ``s`` (e.g. A = 2, s = 4) the
same formula keeps every (s/A)-th action, the last of each group of s/A frames. For latent frame
0 only step ``A − 1`` exists (v = 0); its other steps have v < 0 and are absent. Steps whose
v is at or past the episode's end are absent too (with F = (n−1)//s + 1 they never are; the
trailing (n−1) % s frames of an episode have no latent frame and their actions are dropped).
An ``offset`` of ``o`` video frames takes every step ``o`` frames earlier, ``v(f, a) − o``: with
``o = 1`` latent frame ``f`` carries the actions taken at video frames ``s(f−1) … s·f − 1``,
the ones that lead to its video frames, and latent frame 0 none.

Channels: the dataset's action columns go into the model's fixed action width ``Ca``; by default
column j -> channel j, or column j -> ``channels[j]``. The mask (Ca, F, A) is True exactly where
the channel comes from the dataset and the step exists; actions are 0 elsewhere.

Normalization: where the dataset's stats have q01/q99, ``2(x − q01)/(q99 − q01) − 1`` clipped to
[−1, 1] (a column with q99 − q01 ≈ 0 maps to 0); otherwise ``(x − mean)/std`` (std ≈ 0 -> x − mean).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flexpack.data.stats_check import CONSTANT_WIDTH as _EPS


def step_frames(frames: int, action_steps: int, stride: int, offset: int = 0) -> np.ndarray:
    """Video frame index v(f, a) − ``offset`` of every action step, shape (F, A); negative = absent."""
    if action_steps < 1 or stride % action_steps:
        raise ValueError(f"action_steps must divide stride ({stride}), got action_steps={action_steps}")
    k = stride // action_steps
    f = np.arange(frames)[:, None]
    a = np.arange(action_steps)[None, :]
    return stride * (f - 1) + (a + 1) * k - offset


@dataclass(frozen=True)
class ActionNormalizer:
    """Per-column affine map to ~[−1, 1] from a lerobot stats dict (``meta.stats['action']``)."""

    mode: str  # "quantile" | "meanstd" | "none"
    low: np.ndarray  # q01 or mean
    high: np.ndarray  # q99 or std

    @classmethod
    def from_stats(cls, stats: dict | None, columns: int, field: str = "action") -> "ActionNormalizer":
        if stats is None:
            raise ValueError(f"the dataset has no stats for {field!r}; pass normalize=False or recompute stats")
        if "q01" in stats and "q99" in stats:
            mode, low, high = "quantile", stats["q01"], stats["q99"]
        elif "mean" in stats and "std" in stats:
            mode, low, high = "meanstd", stats["mean"], stats["std"]
        else:
            raise ValueError(f"stats of {field!r} have neither q01/q99 nor mean/std (keys {sorted(stats)})")
        low = np.asarray(low, dtype=np.float64).reshape(-1)
        high = np.asarray(high, dtype=np.float64).reshape(-1)
        if low.shape != (columns,) or high.shape != (columns,):
            raise ValueError(f"stats of {field!r} have {low.shape[0]} columns, the feature has {columns}")
        return cls(mode, low, high)

    @classmethod
    def identity(cls, columns: int) -> "ActionNormalizer":
        return cls("none", np.zeros(columns), np.ones(columns))

    def __call__(self, x_TD: np.ndarray) -> np.ndarray:
        x = np.asarray(x_TD, dtype=np.float64)
        if self.mode == "none":
            return x.astype(np.float32)
        if self.mode == "quantile":
            width = self.high - self.low
            ok = width > _EPS
            y = np.where(ok, 2.0 * (x - self.low) / np.where(ok, width, 1.0) - 1.0, 0.0)
            return np.clip(y, -1.0, 1.0).astype(np.float32)
        std = np.where(self.high > _EPS, self.high, 1.0)
        return ((x - self.low) / std).astype(np.float32)


def channel_map(columns: int, action_dim: int, channels: list[int] | None) -> np.ndarray:
    """Model channel of each dataset action column; checked to be distinct and < action_dim."""
    if channels is None:
        if columns > action_dim:
            raise ValueError(f"the dataset has {columns} action columns, more than action_dim={action_dim}; "
                             "raise action_dim or pass action_channels")
        return np.arange(columns)
    out = np.asarray(list(channels), dtype=np.int64)
    if out.shape != (columns,):
        raise ValueError(f"action_channels has {out.shape[0]} entries, the dataset has {columns} action columns")
    if len(set(out.tolist())) != columns or out.min() < 0 or out.max() >= action_dim:
        raise ValueError(f"action_channels {out.tolist()} must be distinct and in [0, {action_dim})")
    return out


def align_actions(
    actions_TD: np.ndarray,
    *,
    frames: int,
    action_steps: int,
    stride: int,
    action_dim: int,
    channels: np.ndarray,
    offset: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Place an episode's (already normalized) actions (T, D) into (Ca, F, A) plus its mask (``offset``:
    video frames every step is taken earlier, see the module docstring)."""
    T, D = actions_TD.shape
    v_FA = step_frames(frames, action_steps, stride, offset)
    present_FA = (v_FA >= 0) & (v_FA < T)
    src_FAD = actions_TD[np.clip(v_FA, 0, max(T - 1, 0))]  # (F, A, D)
    action = np.zeros((action_dim, frames, action_steps), dtype=np.float32)
    mask = np.zeros((action_dim, frames, action_steps), dtype=bool)
    action[channels] = np.where(present_FA[None], np.moveaxis(src_FAD, -1, 0), 0.0)
    mask[channels] = present_FA[None]
    return torch.from_numpy(action), torch.from_numpy(mask)
