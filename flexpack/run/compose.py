"""``compose(config, role) -> Run``: the one place that turns a config's names into the objects of a run.

A :class:`~flexpack.run.config.TrainConfig` is plain data; this module makes, once, what every command and hook
then reads from the :class:`~flexpack.run.root.Run` and never derives again:

- the config checked where the registry and the mask table decide, with its defaults filled in
  (:func:`flexpack.run.resolve.check`), the model family and its resolved model config (``model.pretrained``'s
  config.json read here, once);
- where it runs: the device, this rank and the world size (default: the process group's) and the bf16 autocast
  rule (:func:`autocast_dtype`, written here only);
- the train / held-out :class:`~flexpack.run.root.Split` (:func:`flexpack.run.build.split_of`, read here only);
- the dataset of the role, the token geometry, the forward options, the sampler and the collate matching it.

Roles (:data:`ROLES`), each a :class:`Run` of the same config:

``"train"``
    the training episodes (``data.val_fraction`` / ``data.val_episodes`` held out), items as training draws them
    (text dropout), the sampler of ``data.mode`` sharded by rank; pack mode checks every item fits the budget.
``"val"``
    the held-out episodes (validation loss), without text dropout; composed from a training run (``parent``: the
    validation hook) it keeps that run's geometry and grid, so its frame budget packs the held-out episodes too.
``"verify"``
    what ``"train"`` gives (``flexpack verify`` checks the micro-batches training would see).
``"sample"``
    whole episodes (no task segments, no text dropout): ``episodes``, the held-out ones (``val``) or all; always
    packed (``data.max_tokens`` per pack in either mode); ``hw`` instead: no dataset, the geometry of latents of
    that grid (pairs made in memory). bf16 autocast on CUDA only (a CPU sample is float32); composed from a
    training run (``parent``: the sampling hook) it keeps that run's model config, device, ranks and autocast.
``"export"``
    no data: the family, the model config, the device (``geometry``, ``data`` are None).

``flexpack stats`` takes no config (it reads a dataset's lengths and the command line's budget), so it has no
role. A benchmark or test over in-memory episodes passes ``dataset=`` (:func:`run_for`).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch

from flexpack.flow.objectives import objective_for
from flexpack.run.build import open_dataset, sample_dataset, split_of
from flexpack.run.checks import check_token_budget, config_terms, resolve_device
from flexpack.run.config import TrainConfig
from flexpack.run.resolve import check, config_family
from flexpack.run.root import (
    Data,
    EpisodeDataset,
    Run,
    Split,
    batching,
    check_fits_model,
    forward_options,
    geometry_for,
    model_collate,
    run_grid,
    run_text_slots,
)

ROLES = ("train", "val", "verify", "sample", "export")


def autocast_dtype(cfg: TrainConfig, device: torch.device, world_size: int, role: str) -> torch.dtype | None:
    """The bf16 autocast of a run's model calls, the one rule: ``runtime.dtype = "bfloat16"`` on one rank (under
    FSDP2 its mixed-precision policy casts the parameters instead); a ``"sample"`` run autocasts on CUDA only."""
    if cfg.runtime.dtype != "bfloat16" or world_size > 1:
        return None
    if role == "sample" and device.type != "cuda":
        return None
    return torch.bfloat16


def _where(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """``rank`` and ``world_size``, each the process group's where None (0 and 1 without one)."""
    if rank is None or world_size is None:
        from flexpack.parallel.parallelize import world

        r, w = world()
        return r if rank is None else rank, w if world_size is None else world_size
    return rank, world_size


def compose(cfg: TrainConfig, role: str = "train", *, dataset: EpisodeDataset | None = None,
            episodes: Sequence[int] | None = None, val: bool = False, hw: tuple[int, int] | None = None,
            split: Split | None = None, rank: int | None = None, world_size: int | None = None,
            device: torch.device | None = None, parent: Run | None = None,
            checked: tuple[TrainConfig, Any] | None = None) -> Run:
    """The :class:`~flexpack.run.root.Run` of ``cfg`` for ``role`` (see the module docstring). ``dataset``: these
    episodes instead of ``data.root``'s (in memory, say; ``split``: the split they come from, default none);
    ``episodes`` / ``val`` / ``hw``: a ``"sample"`` run's episodes (``val``: the held-out ones) or latent grid;
    ``device``: default ``runtime.device``; ``parent``: a run this one shares its resolved parts with; ``checked``:
    what :func:`flexpack.run.resolve.check` returned for ``cfg`` already (the train loop checks before any data)."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if parent is not None:  # the resolved parts of a run already composed: nothing is resolved twice
        cfg, family, model_cfg = parent.config, parent.family, parent.model_config
        device, rank, world_size = parent.device, parent.rank, parent.world_size
        amp, split = parent.autocast_dtype, parent.split if split is None else split
    else:
        cfg, model_cfg = check(cfg) if checked is None else checked
        family = config_family(cfg)
        rank, world_size = _where(rank, world_size)
        device = resolve_device(cfg.runtime.device) if device is None else device
        amp = autocast_dtype(cfg, device, world_size, role)
    objective = objective_for(family.objective, cfg.objective, model_cfg)
    base = dict(config=cfg, family=family, model_config=model_cfg, objective=objective, device=device, rank=rank,
                world_size=world_size, autocast_dtype=amp, role=role)
    if role == "export":
        return Run(**base, geometry=None, forward=forward_options(cfg), split=split or Split(), data=None)
    if role == "sample":
        return _sample(cfg, base, dataset, episodes, val, hw, split)
    if role in ("train", "verify") and parent is None:  # torchao and an sm89+ GPU, before data and model
        from flexpack.parallel import float8

        float8.check(cfg.parallel.float8, device)
    if dataset is None:
        split = split_of(cfg) if split is None else split
        with config_terms(cfg):
            dataset = open_dataset(cfg, split.held_out if role == "val" else split.train,
                                   text_dropout=role != "val", model_cfg=model_cfg, family=family)
    hw_ = check_fits_model(dataset, model_cfg, cfg)
    if parent is not None and parent.geometry is not None:  # the parent's tokens: its frame budget packs these too
        grid, geometry = parent.grid, parent.geometry
    else:
        grid = run_grid(dataset, model_cfg, cfg)
        geometry = geometry_for(model_cfg, grid or hw_, cfg, family)  # a padded item costs the run grid's tokens
    if cfg.data.mode == "pack":
        check_token_budget(cfg, dataset, geometry)
    sampler, collate = batching(cfg, dataset.lengths(), geometry, rank, world_size,
                                mixture=getattr(dataset, "mixture_weights", None), grid=grid)
    data = Data(dataset=dataset, sampler=sampler, collate=model_collate(collate, model_cfg, family))
    return Run(**base, geometry=geometry, forward=forward_options(cfg, run_text_slots(sampler)),
               split=split or Split(), data=data, grid=grid)


def _sample(cfg: TrainConfig, base: dict[str, Any], dataset: EpisodeDataset | None,
            episodes: Sequence[int] | None, val: bool, hw: tuple[int, int] | None, split: Split | None) -> Run:
    """A ``"sample"`` run: whole episodes packed by ``data.max_tokens`` in either mode, the forward options without
    text slots (the sampler fixes them per stage)."""
    model_cfg = base["model_config"]
    if dataset is None and hw is None:
        if val and split is None:
            split = split_of(cfg)
        dataset = sample_dataset(cfg, episodes, held_out=split.held_out if val else None, model_cfg=model_cfg,
                                 family=base["family"])
    grid = None if dataset is None else run_grid(dataset, model_cfg, cfg)
    if hw is None:  # the largest grid where the dataset's grids differ
        hw = grid or tuple(dataset[0]["latent"].shape[2:])
    geometry = replace(geometry_for(model_cfg, tuple(hw), cfg, base["family"]), max_tokens=cfg.data.max_tokens)
    data = None
    if dataset is not None:
        # sampling cuts an episode within a pack's frames (its pairs): the sampler takes them so cut
        lengths = [min(n, geometry.frame_budget) for n in dataset.lengths()]
        sampler, collate = batching(cfg, lengths, geometry, base["rank"], base["world_size"], grid=grid, mode="pack")
        data = Data(dataset=dataset, sampler=sampler, collate=model_collate(collate, model_cfg, base["family"]))
    return Run(**base, geometry=geometry, forward=forward_options(cfg), split=split or Split(), data=data, grid=grid)


def run_for(dataset: EpisodeDataset, cfg: TrainConfig, *, rank: int = 0, world_size: int = 1,
            device: torch.device | None = None, split: Split | None = None) -> Run:
    """The training :class:`~flexpack.run.root.Run` of ``cfg`` over ``dataset`` (items as
    :class:`~flexpack.data.LatentEpisodeDataset` yields them, with ``lengths()``): ``compose(cfg, "train",
    dataset=dataset, ...)`` for this rank's share of the sampler."""
    return compose(cfg, "train", dataset=dataset, rank=rank, world_size=world_size, device=device, split=split)


def build_run(cfg: TrainConfig, rank: int = 0, world_size: int = 1, *, split: str = "train",
              device: torch.device | None = None) -> Run:
    """The :class:`~flexpack.run.root.Run` of ``cfg`` over ``data.root``: ``compose(cfg, "train")`` or, for
    ``split = "val"``, ``compose(cfg, "val")`` (the held-out episodes: :mod:`flexpack.training.validation`)."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be one of ('train', 'val'), got {split!r}")
    return compose(cfg, split, rank=rank, world_size=world_size, device=device)
