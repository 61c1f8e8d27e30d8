"""Which episodes are held out for validation: a pure function of the episode list and the data config
(see :mod:`flexpack.training.validation`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from flexpack.flow.noise import episode_seed

if TYPE_CHECKING:
    from flexpack.run.config import DataConfig

VAL_TAG = 0x76616C  # "val": keeps validation draws apart from any training seed


def split_episodes(episodes: Sequence[int], data_cfg: DataConfig,
                   where: str = "the dataset") -> tuple[list[int], list[int]]:
    """(training, held-out) episode indices, each in the dataset's order."""
    episodes = list(episodes)
    known = set(episodes)
    unknown = sorted(set(data_cfg.val_episodes) - known)
    if unknown:
        raise ValueError(f"data.val_episodes {unknown} are not episodes of {where} ({len(episodes)} episodes)")
    held = set(data_cfg.val_episodes)
    if data_cfg.val_fraction > 0:
        want = max(1, round(data_cfg.val_fraction * len(episodes)))
        ranked = sorted(episodes, key=lambda e: episode_seed(data_cfg.seed, VAL_TAG, e))
        held |= set(ranked[:want])
    train = [e for e in episodes if e not in held]
    if held and not train:
        raise ValueError(f"data.val_fraction={data_cfg.val_fraction} / data.val_episodes hold out all "
                         f"{len(episodes)} episodes of {where}; none is left to train on")
    return train, [e for e in episodes if e in held]
