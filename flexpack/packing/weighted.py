"""Pack mode over a mixture: each source's share of an epoch's tokens follows its weight.

:class:`WeightedTokenBudgetBatchSampler` is :class:`~flexpack.packing.batch_sampler.TokenBudgetBatchSampler` whose
epoch is not "every item once" but a weighted draw. Epoch ``e``, from ``numpy.random.default_rng([seed, e, 0x3D1])``:
source ``g`` of weight ``w_g`` gets the quota ``w_g / Σw`` of the epoch's tokens (the tokens of every item once, so
an epoch keeps its size); its items are taken in a seeded permutation, permutation after permutation, while the
next item brings the source's tokens closer to its quota (so each share is within half an item of its quota). A
source above its natural share repeats items within the epoch, one below it sees a different subset each epoch.
The draw is then packed and dealt to ranks exactly as the unweighted sampler packs an epoch.

Invariants, as the unweighted sampler's: a pure function of (arguments, epoch); every rank yields the same number
of batches; ``state_dict`` / ``load_state_dict`` resume at the exact batch on the same number of ranks. On another
number of ranks the epoch continues as the unweighted sampler's does, with the draw as a *multiset*: the draw does
not depend on the ranks, ``consumed`` lists an index once for every time the old ranks trained it (the state
records repeats), and the rest of the epoch, the draw less ``consumed`` counted per index, is packed and dealt
over the new ranks from the same epoch seed; so across old and new ranks every draw of the epoch is trained once
(plus each plan's own tail padding), and the next epoch is whole.
A pack may hold one item twice (both copies see the same noise): ``most_per_batch`` counts such repeats.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from flexpack.packing.batch_sampler import TokenBudgetBatchSampler

DRAW_TAG = 0x3D1


class WeightedTokenBudgetBatchSampler(TokenBudgetBatchSampler):
    def __init__(self, lengths: Sequence[int], max_tokens: int, *, tokens_per_frame: int, groups: Sequence[int],
                 weights: Sequence[float], rank: int = 0, world_size: int = 1, seed: int = 0,
                 crop: bool = False) -> None:
        super().__init__(lengths, max_tokens, tokens_per_frame=tokens_per_frame, rank=rank, world_size=world_size,
                         seed=seed, crop=crop)
        self.groups = np.asarray(groups, dtype=np.int64).reshape(-1)
        self.weights = np.asarray(weights, dtype=np.float64).reshape(-1)
        if self.groups.shape != (len(self.lengths),):
            raise ValueError(f"groups must give one source per item ({len(self.lengths)}), got {self.groups.shape[0]}")
        if not len(self.weights) or not np.all(np.isfinite(self.weights)) or np.any(self.weights <= 0):
            raise ValueError(f"source weights must be positive finite numbers, got {self.weights.tolist()}")
        if self.groups.min() < 0 or self.groups.max() >= len(self.weights):
            raise ValueError(f"groups must name sources 0..{len(self.weights) - 1}")
        empty = [g for g in range(len(self.weights)) if not np.any(self.groups == g)]
        if empty:
            raise ValueError(f"sources {empty} have no item but a weight; drop them from the mixture")

    def quotas(self) -> np.ndarray:
        """Tokens each source should get per epoch."""
        total = float(sum(self.effective_lengths)) * self.tokens_per_frame
        return total * self.weights / self.weights.sum()

    def epoch_draw(self, epoch: int) -> np.ndarray:
        """The items of ``epoch`` (with repeats), sorted."""
        rng = np.random.default_rng([self.seed, epoch, DRAW_TAG])
        tokens = np.asarray(self.effective_lengths, dtype=np.int64) * self.tokens_per_frame
        out: list[int] = []
        for g, quota in enumerate(self.quotas()):
            members = np.flatnonzero(self.groups == g)
            got = 0
            while True:
                for i in rng.permutation(members):
                    if got + tokens[i] / 2 > quota:
                        break
                    out.append(int(i))
                    got += int(tokens[i])
                else:
                    continue
                break
        return np.sort(np.asarray(out, dtype=np.int64))

    def _remaining(self, epoch: int, consumed: tuple[int, ...]) -> np.ndarray:
        """The draw of ``epoch`` less ``consumed``, per index: one drawn k times and trained j times is left
        max(k - j, 0) times (sorted)."""
        draw = self.epoch_draw(epoch)
        if not consumed:
            return draw
        left = np.bincount(draw, minlength=len(self.lengths)) - np.bincount(consumed, minlength=len(self.lengths))
        return np.repeat(np.arange(len(self.lengths)), np.maximum(left, 0)).astype(np.int64)

    def _trained(self, consumed: tuple[int, ...], batches: list[list[int]]) -> tuple[int, ...]:
        """``consumed`` and every index of ``batches``, each as often as it was trained (a multiset)."""
        return tuple(sorted([*consumed, *(i for b in batches for i in b)]))

    def _args(self) -> dict[str, Any]:
        digest = hashlib.sha256(self.groups.tobytes()).hexdigest()[:16]
        return {**super()._args(), "groups_sha256": digest, "weights": [float(w) for w in self.weights]}

    def most_per_batch(self) -> int:
        """The most items one pack can hold, counting each item as often as a source's draw can repeat it."""
        natural = np.bincount(self.groups, weights=np.asarray(self.effective_lengths, dtype=np.float64)
                              * self.tokens_per_frame, minlength=len(self.weights))
        repeats = [math.ceil(q / n) + 1 for q, n in zip(self.quotas(), natural)]
        pool = sorted(n for i, n in enumerate(self.effective_lengths) for _ in range(repeats[self.groups[i]]))
        used = count = 0
        for n in pool:
            if used + n > self.budget_frames:
                break
            used, count = used + n, count + 1
        return count
