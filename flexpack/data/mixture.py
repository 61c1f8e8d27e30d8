"""``MixtureDataset``: several sources (upstream bundles, or v2.1 datasets with ``.pth`` latents) in one run.

Each source is a :class:`~flexpack.data.bundle.BundleDataset` with its own cameras, channel map, statistics and
transform; the mixture concatenates their items. Episode ids run over the sources in order (source ``s``'s
episode ``e`` is ``offset[s] + e``), so a held-out split and the per-episode noise see one id space; an item's
``dataset`` is ``"<source name>/<dataset>"``. Sources that name one ``embodiment`` share q01/q99 pooled exactly
over all their segments' rows (per model channel, over the sources that fill it); the others pool within
themselves. ``weights`` (per source, or None: natural shares) go to the packed sampler
(:class:`~flexpack.packing.weighted.WeightedTokenBudgetBatchSampler`) through :attr:`mixture_weights`.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import torch

from flexpack.data.bundle import BundleDataset, check_channels


class MixtureDataset(torch.utils.data.Dataset):
    def __init__(self, sources: list[BundleDataset | None], names: list[str], episode_counts: list[int],
                 weights: list[float] | None = None) -> None:
        """``sources``: one per entry (None where the episodes asked for leave it empty); ``episode_counts``:
        every entry's episode count, for stable ids whatever the split."""
        if not any(s is not None for s in sources):
            raise ValueError("data.datasets: no source has an episode to read here")
        self.names, self.weights = list(names), weights
        self.offsets = np.concatenate([[0], np.cumsum(episode_counts)]).astype(int).tolist()
        kept = [(k, s) for k, s in enumerate(sources) if s is not None]
        self.source_ids = [k for k, _ in kept]
        self.sources = [s for _, s in kept]
        self.starts = np.concatenate([[0], np.cumsum([len(s) for s in self.sources])]).astype(int).tolist()
        # every item's record as its source holds it, with its mixture-wide episode id
        self.items = [replace(it, global_episode=self.offsets[self.source_ids[k]] + it.global_episode)
                      for k, s in enumerate(self.sources) for it in s.items]
        check_channels("data.datasets", self.latent_grids)

    @property
    def latent_grids(self) -> dict[str, list[tuple[int, int, int]]]:
        """Every source's datasets' composed latent grids ``(C, H, W)``, keyed ``"<source>/<dataset>"``."""
        return {f"{self.names[self.source_ids[k]]}/{name}": g for k, s in enumerate(self.sources)
                for name, g in s.latent_grids.items()}

    def item_grids(self) -> list[tuple[int, int]]:
        """The composed latent grid (H, W) of every item."""
        return [g for s in self.sources for g in s.item_grids()]

    def __len__(self) -> int:
        return self.starts[-1]

    def lengths(self) -> list[int]:
        return [n for s in self.sources for n in s.lengths()]

    def locate(self, i: int) -> tuple[int, int]:
        """(position in ``sources``, the item's index in it)."""
        k = bisect_right(self.starts, i) - 1
        return k, i - self.starts[k]

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"item {i} out of range for {len(self)} items")
        k, j = self.locate(i % len(self))
        item = dict(self.sources[k][j])
        item["episode_index"] = self.offsets[self.source_ids[k]] + int(item["episode_index"])
        item["dataset"] = f"{self.names[self.source_ids[k]]}/{item['dataset']}"
        return item

    @property
    def episode_sources(self) -> tuple[list[str], dict[int, int]]:
        """(``"<source>/<dataset>"`` names, mixture episode id -> name index) for per-dataset metrics."""
        names: list[str] = []
        of: dict[int, int] = {}
        for k, s in enumerate(self.sources):
            base = self.names[self.source_ids[k]]
            for it in s._every:
                name = f"{base}/{s.names[it.dataset]}"
                if name not in names:
                    names.append(name)
                of[self.offsets[self.source_ids[k]] + it.global_episode] = names.index(name)
        return names, of

    def set_epoch(self, epoch: int) -> None:
        for s in self.sources:
            s.set_epoch(epoch)

    @property
    def source_of_item(self) -> np.ndarray:
        """Entry index of every item."""
        return np.concatenate([np.full(len(s), self.source_ids[k]) for k, s in enumerate(self.sources)])

    @property
    def mixture_weights(self) -> tuple[np.ndarray, list[float]] | None:
        """(source of every item, weight of every source present) for the sampler; None for natural shares."""
        if self.weights is None:
            return None
        present = {k: n for n, k in enumerate(self.source_ids)}
        return np.array([present[g] for g in self.source_of_item]), [self.weights[k] for k in self.source_ids]

    @property
    def normalizer(self) -> Any:
        """The sources' statistics where they all share them (what a checkpoint records); None otherwise."""
        first = self.sources[0].normalizer
        for s in self.sources[1:]:
            n = s.normalizer
            if (n is None) != (first is None) or (n is not None and not (
                    np.array_equal(n.low, first.low) and np.array_equal(n.high, first.high))):
                return None
        return first

    @normalizer.setter
    def normalizer(self, value: Any) -> None:
        for s in self.sources:
            s.normalizer = value

    @property
    def entry_normalizers(self) -> list[Any]:
        """Every entry's statistics in config order (an ActionNormalizer over the model's action space; None for an
        entry with no item here or a run without normalization): what a checkpoint records per entry, so that an
        export of one entry writes the statistics that entry trained with."""
        out: list[Any] = [None] * (len(self.offsets) - 1)
        for k, s in zip(self.source_ids, self.sources):
            out[k] = s.normalizer
        return out

    @entry_normalizers.setter
    def entry_normalizers(self, values: list[Any]) -> None:
        """Keep a checkpoint's per-entry statistics (``values`` in config order; None leaves an entry's own)."""
        for k, s in zip(self.source_ids, self.sources):
            if values[k] is not None:
                s.normalizer = values[k]

    # the sampling path reads these of a bundle: the first source speaks for the mixture
    def __getattr__(self, name: str) -> Any:
        if name in ("stride", "fps", "encoder", "channels", "empty_text", "root"):
            return getattr(self.__dict__["sources"][0], name)
        raise AttributeError(name)


def entry_name(entry: Any) -> str:
    """A ``[[data.datasets]]`` entry's name in metrics, checkpoints and ``export --dataset``: its ``name``, else its
    folder's name."""
    return entry.name or Path(entry.root).name


def pooled_model_space(sources: list[BundleDataset]) -> tuple[np.ndarray, np.ndarray]:
    """q01/q99 per model channel over every segment row of ``sources`` that fills it (0 and 0 where none does)."""
    dim = sources[0].action_dim
    cols: list[list[np.ndarray]] = [[] for _ in range(dim)]
    for s in sources:
        rows = s.segment_rows()
        inv = s.inverse[0]
        for ch in range(dim):
            if inv[ch] < rows.shape[1]:
                cols[ch].append(rows[:, inv[ch]])
    q01, q99 = np.zeros(dim), np.zeros(dim)
    for ch, parts in enumerate(cols):
        if parts:
            v = np.concatenate(parts)
            q01[ch], q99[ch] = np.quantile(v, 0.01), np.quantile(v, 0.99)
    return q01, q99
