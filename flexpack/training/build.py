"""Build what a config describes: the dataset with its sampler and collate, and the model.

Shared by :mod:`flexpack.training.loop` and :mod:`flexpack.training.verify`, so both see the same micro-batches.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch
from torch import nn

from flexpack.packing.collate import Batch, PackCollate, PadCollate
from flexpack.training.checks import check_token_budget, config_terms
from flexpack.training.config import TrainConfig
from flexpack.training.noise import episode_seed
from flexpack.training.parallel import world


class _Collate:
    """The sampler's collate, plus ``extras["noise_keys"]``: (episode, segment) per episode slot, which
    seed its noise; drops actions for a model without action channels."""

    def __init__(self, collate: Any, actions: bool) -> None:
        self.collate, self.actions = collate, actions

    def __call__(self, items: Sequence[dict]) -> Batch:
        if not self.actions:
            items = [{k: v for k, v in it.items() if k not in ("action", "action_mask")} for it in items]
        batch = self.collate(items)
        keys = [(int(it.get("episode_index", -1)), int(it.get("segment", -1))) for it in items]
        return replace(batch, extras={**batch.extras, "noise_keys": keys})


def noise_seeds(batch: Batch, seed: int, step: int) -> list[int]:
    """One seed per episode slot from (run seed, step, episode, segment)."""
    keys = batch.extras.get("noise_keys") or [(e, -1) for e in batch.layout.episode_index.tolist()]
    return [episode_seed(seed, step, e, s + 1) for e, s in keys]


@dataclass
class Data:
    dataset: Any
    sampler: Any
    collate: Any
    tokens_per_frame: int
    text_slots: int | None = None  # text key slots for the whole run (one compiled shape per pack)


def tokens_per_frame(m: Any, latent_hw: tuple[int, int], action_steps: int) -> int:
    """Tokens of one latent frame, the unit of ``data.max_tokens``: the frame's video patches plus
    its action steps (none for a model without actions). ``m``: the resolved ``WanVAConfig``."""
    _, ph, pw = m.patch_size
    return (latent_hw[0] // ph) * (latent_hw[1] // pw) + (action_steps if m.action_channels else 0)


def open_dataset(cfg: TrainConfig, episodes: Sequence[int] | None = None, *, segments: bool | str | None = None) -> Any:
    """The config's ``LatentEpisodeDataset`` over ``episodes`` (dataset episode indices; all by default);
    ``segments`` overrides ``data.segments`` (sampling takes whole episodes)."""
    from flexpack.data import LatentEpisodeDataset

    d, m = cfg.data, cfg.model.wan_config()
    if not d.root:
        raise ValueError("data.root is empty: set it to a LeRobot dataset folder with a latent cache")
    return LatentEpisodeDataset(
        d.root, latents_dir=d.latents_dir, action_dim=max(m.action_channels, 1), action_steps=d.action_steps,
        stride=d.stride, cameras=list(d.cameras) if d.cameras else None, normalize=d.normalize,
        segments=d.segments if segments is None else segments,
        episodes=list(episodes) if episodes is not None else None, action_stats=d.action_stats,
    )


def batching(cfg: TrainConfig, lengths: Sequence[int], tpf: int, rank: int = 0, world_size: int = 1) -> tuple[Any, Any]:
    """(sampler, collate) of ``data.mode`` over episode ``lengths`` (latent frames): the token-budget
    sampler with its pack collate, or the length-bucket sampler with the pad collate."""
    from flexpack.packing.sampler import LengthBucketBatchSampler, TokenBudgetBatchSampler

    d = cfg.data
    common = dict(rank=rank, world_size=world_size, seed=d.seed)
    if d.mode == "pack":
        sampler = TokenBudgetBatchSampler(lengths, d.max_tokens, tokens_per_frame=tpf, crop=d.crop, **common)
        return sampler, PackCollate.from_token_budget(d.max_tokens, tpf, crop=d.crop)
    sampler = LengthBucketBatchSampler(lengths, d.batch_size, pool_factor=d.pool_factor,
                                       pad_multiple=d.pad_multiple, tokens_per_frame=tpf, **common)
    return sampler, PadCollate(d.pad_multiple)


def build_data(cfg: TrainConfig, rank: int = 0, world_size: int = 1, *, split: str = "train") -> Data:
    """Dataset, this rank's sampler and the matching collate; checks the data fits the model.
    ``split``: the training episodes or the held-out ``"val"`` ones (:mod:`flexpack.training.validation`)."""
    from flexpack.data.episodes import EpisodeSource
    from flexpack.training.holdout import split_episodes

    d, m = cfg.data, cfg.model.wan_config()
    if not d.root:
        raise ValueError("data.root is empty: set it to a LeRobot dataset folder with a latent cache")
    episodes = None
    with config_terms(cfg):
        if d.val_fraction or d.val_episodes:
            episodes = split_episodes(EpisodeSource(d.root).episodes, d, d.root)[split == "val"]
        ds = open_dataset(cfg, episodes)
    item = ds[0]
    C, _, H, W = item["latent"].shape
    _, ph, pw = m.patch_size
    if C != m.in_channels or H % ph or W % pw or item["text"].shape[1] != m.text_dim:
        raise ValueError(
            f"{d.root}: latents (C, H, W)={(C, H, W)} with text width {item['text'].shape[1]} do not fit the model "
            f"(in_channels={m.in_channels}, patch={m.patch_size}, text_dim={m.text_dim}); set model.overrides"
        )
    tpf = tokens_per_frame(m, (H, W), d.action_steps)
    if d.mode == "pack":
        check_token_budget(cfg, ds, tpf)
    sampler, collate = batching(cfg, ds.lengths(), tpf, rank, world_size)
    return Data(ds, sampler, _Collate(collate, actions=m.action_channels > 0), tpf, text_slots=run_text_slots(sampler))


def run_text_slots(sampler: Any) -> int:
    """Text key slots for a run: the next power of two of the most episodes in one micro-batch of
    the sampler's first epoch. A later micro-batch with more episodes gets more slots (one more
    compiled shape), never fewer."""
    from flexpack.attention.masks import text_slots

    return text_slots(max(1, sampler.max_batch_size()))


def build_model(cfg: TrainConfig) -> nn.Module:
    """The config's WanVA: random init, or ``model.pretrained`` loaded. Under several ranks a
    pretrained model comes back on the meta device: :func:`materialize` fills it once sharded."""
    from flexpack.models import WanVA
    from flexpack.training.pretrained import load_single

    torch.manual_seed(cfg.runtime.seed)  # every rank starts from the same weights
    wcfg = cfg.model.wan_config()
    if not cfg.model.pretrained:
        return WanVA(wcfg)
    if world()[1] > 1:
        with torch.device("meta"):
            return WanVA(wcfg)
    return load_single(WanVA, cfg.model.pretrained, wcfg, cfg.runtime.seed)


def materialize(model: nn.Module, cfg: TrainConfig, device: torch.device) -> None:
    """After ``parallelize``: load ``model.pretrained`` into a model left on the meta device, each
    rank reading only its shards (a no-op for a model that holds weights already)."""
    from flexpack.training.pretrained import is_meta, load_pretrained

    if is_meta(model):
        load_pretrained(model, cfg.model.pretrained, cfg.model.wan_config(), device=device, seed=cfg.runtime.seed)


def model_kwargs(cfg: TrainConfig) -> dict[str, Any]:
    return {"mask": cfg.model.mask, "chunk_size": cfg.model.chunk_size}
