"""Scores of K forecasts of the same target drawn from K noises (an ensemble), per element.

One draw from a perfect model of an uncertain future scores worse than the mean baseline (its
error is the spread of the future plus the draw's own), so a forecast is judged on its K samples
together as well:

- ``kmean``: the squared error of the K-sample mean, the model's best point forecast. For a
  calibrated ensemble its expectation is ``(1 + 1/K)`` times the spread below.
- ``spread``: the variance of the K samples around their mean (``1/K Σ (x_k − x̄)²``), what the
  model is unsure of; 0 for a deterministic model (and for the baselines).
- ``crps``: the continuous ranked probability score of the ensemble's distribution, a proper
  score (minimised in expectation only by the true distribution), in the data's units:
  ``1/K Σ_k |x_k − y| − 1/(2K²) Σ_k Σ_l |x_k − x_l|`` (Gneiting & Raftery 2007, the ensemble's
  empirical distribution). With K = 1 it is the absolute error.
"""

from __future__ import annotations

import numpy as np


def ensemble_scores(x_K: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per element of the target ``y`` (shape S): (squared error of the K-sample mean, spread, CRPS),
    each of shape S, from the K samples ``x_K`` of shape (K, *S)."""
    x = np.asarray(x_K, np.float64)
    y = np.asarray(y, np.float64)
    if x.ndim != y.ndim + 1 or x.shape[1:] != y.shape or x.shape[0] < 1:
        raise ValueError(f"ensemble_scores: samples must be (K, *target.shape) with K >= 1, got {x.shape} for a "
                         f"target of {y.shape}")
    mean = x.mean(axis=0)
    spread = ((x - mean) ** 2).mean(axis=0)
    K = x.shape[0]
    skill = np.abs(x - y).mean(axis=0)
    # Σ_k Σ_l |x_k − x_l| from the sorted samples: Σ_i (2i − K + 1) x_(i), O(K log K) per element
    ranks = np.arange(K, dtype=np.float64).reshape((K,) + (1,) * y.ndim)
    pair_sum = 2 * ((2 * ranks - K + 1) * np.sort(x, axis=0)).sum(axis=0)
    return (mean - y) ** 2, spread, skill - pair_sum / (2 * K * K)
