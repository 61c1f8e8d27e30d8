"""In-memory episodes shaped like :class:`~flexpack.data.LatentEpisodeDataset`'s items, with the
run (sampler, collate, geometry: :mod:`flexpack.run.root`) a config builds: ``flexpack verify
--synthetic`` (and benchmarks) run the training configuration without a LeRobot dataset on disk.

Each item is drawn from a generator seeded by its index (latent, text, actions), so a rank, a
re-run and a per-episode pass all see the same episode.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from flexpack.run.compose import compose
from flexpack.run.config import TrainConfig
from flexpack.run.resolve import check
from flexpack.run.root import Run, geometry_for

REFERENCE_FRAMES = Path(__file__).resolve().parents[2] / "data" / "episode_frames_ref.txt"


class RandomEpisodes(torch.utils.data.Dataset):
    """Items with ``latent`` (C, F, H, W), ``text`` (L, Dt), ``text_len`` and, for ``action_channels``
    > 0, ``action`` / ``action_mask`` (Ca, F, A), drawn from a seed per episode. ``mask_drop``: the share
    of action values masked out at random (0: every value counts)."""

    def __init__(self, lengths: list[int], *, channels: int, hw: tuple[int, int], action_channels: int,
                 action_steps: int, text_len: int, text_dim: int, mask_drop: float = 0.1) -> None:
        self.frames, self.c, self.hw = list(lengths), channels, hw
        self.ca, self.a, self.text_len, self.text_dim = action_channels, action_steps, text_len, text_dim
        self.mask_drop = mask_drop

    def __len__(self) -> int:
        return len(self.frames)

    def lengths(self) -> list[int]:
        return list(self.frames)

    def __getitem__(self, i: int) -> dict:
        g = torch.Generator().manual_seed(i)
        f = self.frames[i]
        item = {"latent": torch.randn(self.c, f, *self.hw, generator=g), "episode_index": i, "segment": -1,
                "text": torch.randn(self.text_len, self.text_dim, generator=g), "text_len": self.text_len}
        if self.ca:
            item["action"] = torch.randn(self.ca, f, self.a, generator=g)
            item["action_mask"] = (torch.rand(self.ca, f, self.a, generator=g) > self.mask_drop if self.mask_drop
                                   else torch.ones(self.ca, f, self.a, dtype=torch.bool))
        return item


def episode_lengths(budget_frames: int, *, count: int = 64, seed: int = 0) -> list[int]:
    """Latent frames per episode: the reference lengths (``data/episode_frames_ref.txt``) where the
    budget holds the longest of them, else ``count`` seeded lengths in ``[1, budget / 2]`` (several
    episodes per pack, as on a real dataset of short episodes)."""
    from flexpack.packing.lengths import read_frames_file

    ref = read_frames_file(REFERENCE_FRAMES)
    if budget_frames >= max(ref):
        return ref
    rng = random.Random(seed)
    return [rng.randint(1, max(1, budget_frames // 2)) for _ in range(count)]


def synthetic_run(cfg: TrainConfig, *, hw: tuple[int, int] | None = None, text_len: int = 16, rank: int = 0,
                  world_size: int = 1, device: torch.device | None = None) -> Run:
    """The config's :class:`~flexpack.run.root.Run` over :class:`RandomEpisodes` shaped for its model.

    ``hw``: latent height and width (default: one patch, one video token per frame); must be a
    multiple of the model's patch. Pack and pad mode as :func:`flexpack.run.compose.build_run`."""
    cfg, model_cfg = check(cfg)  # resolved once: the run below takes it
    d = cfg.data
    _, ph, pw = model_cfg.patch_size
    hw = (ph, pw) if hw is None else tuple(hw)
    if len(hw) != 2 or min(hw) <= 0 or hw[0] % ph or hw[1] % pw:
        raise ValueError(f"--synthetic-hw {hw} must be two positive multiples of the model's patch ({ph}, {pw})")
    if text_len <= 0:
        raise ValueError(f"synthetic text_len must be >= 1, got {text_len}")
    if d.mode == "pack":
        geometry = geometry_for(model_cfg, hw, cfg)
        if d.max_tokens < geometry.tokens_per_frame:
            raise ValueError(f"data.max_tokens = {d.max_tokens} is less than one latent frame "
                             f"({geometry.tokens_per_frame} tokens)")
        lengths = episode_lengths(geometry.frame_budget, seed=d.seed)
    else:
        rng = random.Random(d.seed)  # short episodes: pad mode's shapes follow the longest of each batch
        lengths = [rng.randint(1, 24) for _ in range(8 * d.batch_size)]
    dataset = RandomEpisodes(lengths, channels=model_cfg.in_channels, hw=hw, action_channels=model_cfg.action_channels,
                             action_steps=d.action_steps, text_len=text_len, text_dim=model_cfg.text_dim)
    return compose(cfg, "train", dataset=dataset, rank=rank, world_size=world_size, device=device,
                   checked=(cfg, model_cfg))
