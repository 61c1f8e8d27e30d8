"""Forecast metrics on the generated (target) frames, with two baselines on the same frames.

Per pair, only target frames ``[cut, cut + horizon)`` count, and of the actions only the entries
whose ``action_mask`` is True (real dataset values). Every number is a mean over elements summed
across all pairs (not a mean of per-pair means), so short and long horizons weigh by their size.

- ``action_mse`` / ``action_l1``: in the model's normalized units (what it was trained on);
  ``*_raw``: in the dataset's original units, mapping both prediction and truth back through the
  action statistics the checkpoint was trained with (:func:`denormalize`; with quantile
  normalization the truth is the clipped one, the model cannot predict beyond q01..q99 either).
- ``*_per_dim``: per dataset action column; ``*_per_step``: per latent frame of the horizon.
- ``latent_mse``: over the target latent frames (all channels and pixels).

Several samples per pair (``flexpack sample --samples K``: K noises of the same (episode, cut)):
the numbers above are those of the first sample (the noise a single-sample run draws), and
:mod:`flexpack.sampling.ensemble` adds ``action_mse_kmean`` / ``latent_mse_kmean`` (the MSE of
the K-sample mean), ``action_spread`` / ``latent_spread`` (the samples' variance around it) and
``action_crps`` / ``latent_crps`` (the ensemble's CRPS, a proper score), with ``*_kmean_per_step``
per latent frame of the horizon. The baselines carry the same keys (one deterministic forecast:
K-mean = single, spread 0, CRPS = L1).

Baselines (so a number is readable without context):

- ``last``: the last ground-truth action step of the context repeated (per channel: the last
  real value before the cut); latent: the last context frame repeated.
- ``mean``: the dataset mean action (``meta/stats.json`` mean, normalized like the data; without
  a mean, the midpoint 0 of the normalized range); latent: the per-channel mean of the pair's
  context latents (the best constant a model without dynamics could know).
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from flexpack.data.normalization import ActionStats
from flexpack.sampling.ensemble import ensemble_scores

KINDS = ("model", "last", "mean")


def denormalize(stats: ActionStats | None, y: np.ndarray, columns: np.ndarray) -> np.ndarray:
    """Normalized values ``y`` (..., n) of dataset columns ``columns`` (n,) back in original units."""
    y = np.asarray(y, dtype=np.float64)
    if stats is None or stats.mode == "none":
        return y
    low = np.asarray(stats.low, dtype=np.float64)[columns]
    high = np.asarray(stats.high, dtype=np.float64)[columns]
    if stats.mode == "quantile":
        return (y + 1.0) / 2.0 * (high - low) + low
    return y * np.where(high > 1e-8, high, 1.0) + low


def normalize(stats: ActionStats | None, x: np.ndarray) -> np.ndarray:
    """Original-unit values (..., columns) in the model's units (as ``ActionNormalizer`` maps them)."""
    x = np.asarray(x, dtype=np.float64)
    if stats is None or stats.mode == "none":
        return x
    low, high = np.asarray(stats.low, dtype=np.float64), np.asarray(stats.high, dtype=np.float64)
    if stats.mode == "quantile":
        w = high - low
        return np.clip(np.where(w > 1e-8, 2 * (x - low) / np.where(w > 1e-8, w, 1.0) - 1, 0.0), -1, 1)
    return (x - low) / np.where(high > 1e-8, high, 1.0)


class _Sums:
    def __init__(self, dims: int) -> None:
        self.d = {k: np.zeros(dims) for k in ("a2", "a1", "r2", "r1", "n", "k2", "sp", "cr")}
        self.step: dict[str, list[float]] = {k: [] for k in ("a2", "k2", "an", "l2", "lk", "ln")}
        self.lat = np.zeros(5)  # squared error, element count, K-mean squared error, spread, CRPS
        self.samples = 0

    def _grow(self, h: int) -> None:
        for v in self.step.values():
            v.extend([0.0] * (h - len(v)))

    def add(self, pa_K, ta, pr, tr, mask, pl_K, tl) -> None:
        """K samples of actions (K, Ca', H, A) already restricted to dataset columns (``pr``: the first in
        original units) and of latents (K, C, H, h, w); the truths ``ta``, ``tr``, ``tl`` without K."""
        H = tl.shape[1]
        self._grow(H)
        self.samples = max(self.samples, pl_K.shape[0])
        if mask is not None:
            e, r = (pa_K[0] - ta) * mask, (pr - tr) * mask
            k2, sp, cr = (v * mask for v in ensemble_scores(pa_K, ta))
            for key, v in (("a2", e**2), ("a1", np.abs(e)), ("r2", r**2), ("r1", np.abs(r)), ("n", mask),
                           ("k2", k2), ("sp", sp), ("cr", cr)):
                self.d[key] += v.sum(axis=(1, 2))
            for f in range(H):
                self.step["a2"][f] += float((e[:, f] ** 2).sum())
                self.step["k2"][f] += float(k2[:, f].sum())
                self.step["an"][f] += float(mask[:, f].sum())
        le = (pl_K[0] - tl) ** 2
        lk, lsp, lcr = ensemble_scores(pl_K, tl)
        self.lat += [le.sum(), le.size, lk.sum(), lsp.sum(), lcr.sum()]
        per, per_k = le.sum(axis=(0, 2, 3)), lk.sum(axis=(0, 2, 3))
        for f in range(H):
            self.step["l2"][f] += float(per[f])
            self.step["lk"][f] += float(per_k[f])
            self.step["ln"][f] += float(le[:, f].size)

    def result(self) -> dict[str, Any]:
        d, s = self.d, self.step
        n = d["n"].sum()

        def div(a, b):
            return float(a / b) if b > 0 else float("nan")

        per = lambda k: [div(a, b) for a, b in zip(d[k], d["n"])]  # noqa: E731
        steps = lambda k, count: [div(a, b) for a, b in zip(s[k], s[count])]  # noqa: E731
        return {
            "action_mse": div(d["a2"].sum(), n), "action_l1": div(d["a1"].sum(), n),
            "action_mse_raw": div(d["r2"].sum(), n), "action_l1_raw": div(d["r1"].sum(), n),
            "latent_mse": div(self.lat[0], self.lat[1]),
            "action_mse_kmean": div(d["k2"].sum(), n), "action_spread": div(d["sp"].sum(), n),
            "action_crps": div(d["cr"].sum(), n),
            "latent_mse_kmean": div(self.lat[2], self.lat[1]), "latent_spread": div(self.lat[3], self.lat[1]),
            "latent_crps": div(self.lat[4], self.lat[1]), "samples": self.samples,
            "action_mse_per_dim": per("a2"), "action_l1_per_dim": per("a1"),
            "action_mse_raw_per_dim": per("r2"), "action_l1_raw_per_dim": per("r1"),
            "action_mse_per_step": steps("a2", "an"), "latent_mse_per_step": steps("l2", "ln"),
            "action_mse_kmean_per_step": steps("k2", "an"), "latent_mse_kmean_per_step": steps("lk", "ln"),
        }


class Metrics:
    """Accumulates pairs; :meth:`result` gives the model's metrics and ``baselines``.

    ``action_stats``: the action statistics the checkpoint was trained with, or None (identity);
    ``channels``: model channel of each dataset column; ``mean_raw``: the
    dataset's mean action per column in original units (None: the normalized midpoint 0).
    """

    def __init__(
        self, action_stats: ActionStats | None, channels: Sequence[int], mean_raw: Sequence[float] | None
    ) -> None:
        self.stats, self.channels = action_stats, np.asarray(list(channels), dtype=np.int64)
        self.columns = np.arange(len(self.channels))
        cols = len(self.channels)
        self.mean_norm = (np.zeros(cols) if mean_raw is None
                          else normalize(action_stats, np.asarray(mean_raw, dtype=np.float64)))
        self.sums = {k: _Sums(cols) for k in KINDS}
        self.pairs = 0

    def baselines(self, pair: Any) -> dict[str, tuple[np.ndarray | None, np.ndarray]]:
        """(actions (Ca, H, A) or None, latents (C, H, h, w)) of each baseline for a pair's target frames."""
        c, L = pair.cut, pair.frames
        lat = pair.latent.numpy().astype(np.float64)
        H = L - c
        last_l = np.repeat(lat[:, c - 1:c], H, axis=1)
        mean_l = np.broadcast_to(lat[:, :c].mean(axis=(1, 2, 3), keepdims=True), last_l.shape)
        if pair.action is None:
            return {"last": (None, last_l), "mean": (None, mean_l)}
        act, mask = pair.action.numpy().astype(np.float64), pair.action_mask.numpy()
        Ca, _, A = act.shape
        last = np.zeros(Ca)
        for ch in range(Ca):  # the last real value before the cut, per channel
            flat_v, flat_m = act[ch, :c].reshape(-1), mask[ch, :c].reshape(-1)
            idx = np.nonzero(flat_m)[0]
            last[ch] = flat_v[idx[-1]] if idx.size else 0.0
        mean = np.zeros(Ca)
        mean[self.channels] = self.mean_norm
        return {"last": (np.broadcast_to(last[:, None, None], (Ca, H, A)), last_l),
                "mean": (np.broadcast_to(mean[:, None, None], (Ca, H, A)), mean_l)}

    def add(self, *samples: Any) -> None:
        """One pair, or the K samples of one (episode, cut) (the first is the single-sample forecast)."""
        pair = samples[0]
        assert all((p.episode, p.segment, p.cut, p.frames) == (pair.episode, pair.segment, pair.cut, pair.frames)
                   for p in samples), "samples of one (episode, cut) only"
        c, L = pair.cut, pair.frames
        true_l = pair.latent[:, c:L].numpy().astype(np.float64)
        lat_K = np.stack([p.pred_latent[:, c:L].numpy().astype(np.float64) for p in samples])
        act_K = (None if pair.pred_action is None
                 else np.stack([p.pred_action[:, c:L].numpy().astype(np.float64) for p in samples]))
        preds = {"model": (act_K, lat_K),
                 **{k: (None if a is None else a[None], l_[None]) for k, (a, l_) in self.baselines(pair).items()}}
        ta = mask = None
        if pair.action is not None:
            ta = pair.action[:, c:L].numpy().astype(np.float64)[self.channels]
            mask = pair.action_mask[:, c:L].numpy()[self.channels].astype(np.float64)
        for k, (pa_K, pl_K) in preds.items():
            if ta is None or pa_K is None:
                self.sums[k].add(pa_K=None, ta=None, pr=None, tr=None, mask=None, pl_K=pl_K, tl=true_l)  # latents only
                continue
            pa_K = pa_K[:, self.channels]
            raw = lambda y: np.moveaxis(denormalize(self.stats, np.moveaxis(y, 0, -1), self.columns), -1, 0)  # noqa: E731
            self.sums[k].add(pa_K, ta, raw(pa_K[0]), raw(ta), mask, pl_K, true_l)
        self.pairs += 1

    def result(self) -> dict[str, Any]:
        out = self.sums["model"].result()
        out["baselines"] = {k: self.sums[k].result() for k in ("last", "mean")}
        out["pairs"] = self.pairs
        return out
