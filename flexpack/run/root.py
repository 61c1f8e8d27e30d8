"""The composition root: one frozen, typed :class:`Run` of what a config trains on, made once.

:func:`run_for` (over a dataset) and :func:`flexpack.run.build.build_run` (over ``data.root``) resolve,
from a :class:`~flexpack.run.config.TrainConfig`:

- the model family (:mod:`flexpack.models.registry`) and its resolved model config (``model.pretrained``'s
  ``config.json`` read once, when the config is loaded);
- the :class:`~flexpack.packing.geometry.TokenGeometry`: video and action tokens of a latent frame,
  copies (the family's: 2 under teacher forcing, or always 2) and the pack's frame budget;
- the :class:`~flexpack.flow.objectives.Objective` the family trains with (its sample, loss and counts);
- where it runs: the device, this rank and the world size, the bf16 autocast rule, and the
  :class:`~flexpack.parallel.parallelize.ParallelOptions` the model is wrapped with (:meth:`Run.build_model`);
- the :class:`ForwardOptions` of every model call (mask, chunk size, text slots);
- the train / held-out :class:`Split`, and the :class:`Data` of one split: the dataset, the sampler of
  ``data.mode`` and the collate matching it (:class:`ModelCollate`: the items as the family's data
  conventions want them).

The train loop, one step, validation, ``verify``, sampling, the step meter, the profiler and the
benchmarks take these from the run instead of deriving them again. The dataset is a LeRobot-backed
:class:`~flexpack.data.LatentEpisodeDataset` or in-memory episodes
(:func:`flexpack.run.memory_data.synthetic_run`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Any, ContextManager, Iterator, Protocol, Sequence

import torch
from torch import nn

from flexpack.flow.objectives import Objective, objective_for
from flexpack.models.registry import DataConventions, ModelFamily, ModelShape
from flexpack.packing.collate import Batch, PackCollate, PadCollate
from flexpack.packing.geometry import TokenGeometry
from flexpack.parallel.parallelize import ParallelOptions
from flexpack.run.config import TrainConfig

ACTION_KEYS = ("action", "action_mask")


class EpisodeDataset(Protocol):
    """What a run reads episodes from: items as :class:`~flexpack.data.LatentEpisodeDataset` yields
    them (``latent`` (C, F, H, W), ``text``, ``action`` ...) and their lengths in latent frames."""

    def __len__(self) -> int: ...

    def __getitem__(self, i: int) -> dict[str, Any]: ...

    def lengths(self) -> list[int]: ...


class BatchSampler(Protocol):
    """A sampler of :mod:`flexpack.packing.batch_sampler`: micro-batches of item indices, resumable."""

    epoch: int

    def __iter__(self) -> Iterator[list[int]]: ...

    def __len__(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

    def state_dict(self, position: int | None = None) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...

    def max_batch_size(self) -> int: ...

    def most_per_batch(self) -> int: ...


@dataclass(frozen=True, kw_only=True)
class ForwardOptions:
    """Options of every training-side model call besides the batch and its timesteps.

    ``mask``: ``model.mask``; ``chunk_size``: ``model.chunk_size``; ``text_slots``: text key slots
    for the whole run (one compiled shape per pack; None: the model's default per call)."""

    mask: str = "document"
    chunk_size: int | None = None
    text_slots: int | None = None

    def __call__(self, model: nn.Module, sample: Any, layout: Any = None) -> Any:
        """``model`` on an objective's sample: its inputs and timesteps, and its per-episode chunk sizes and
        windows where it draws them (``layout``: default the batch's own)."""
        return self.call(model, sample.inputs, layout, timestep=sample.timestep, action_timestep=sample.action_timestep,
                         chunk_size=sample.chunk_size, window=sample.window)

    def call(self, model: nn.Module, inputs: Any, layout: Any = None, *, timestep: torch.Tensor,
             action_timestep: torch.Tensor | None = None, chunk_size: torch.Tensor | None = None,
             window: torch.Tensor | None = None) -> Any:
        """``model(inputs, layout, ...)`` with these options (the sampler's solver steps call it so);
        ``chunk_size`` (default: ``model.chunk_size``) and ``window``: per call, e.g. one per episode."""
        return model(inputs, layout, timestep=timestep, action_timestep=action_timestep, mask=self.mask,
                     chunk_size=self.chunk_size if chunk_size is None else chunk_size, window=window,
                     text_slots=self.text_slots)


@dataclass(frozen=True, kw_only=True)
class Split:
    """Dataset episode indices that train and that are held out (``data.val_fraction`` /
    ``data.val_episodes``: :mod:`flexpack.run.holdout`); ``train`` None: every episode trains."""

    train: tuple[int, ...] | None = None
    held_out: tuple[int, ...] = ()


class ModelCollate:
    """A sampler's collate for one model: items lose their actions where the model has no action
    channels (a video-only model gets no action stream) and, where the family's data conventions say
    so (``text_tokens``), get their text zero padded to that many tokens, all of them attended; then
    ``collate`` builds the Batch."""

    def __init__(self, collate: PackCollate | PadCollate, actions: bool, text_tokens: int | None = None) -> None:
        self.collate, self.actions, self.text_tokens = collate, actions, text_tokens

    def items(self, items: Sequence[dict]) -> list[dict]:
        """``items`` as the model takes them."""
        out = list(items) if self.actions else [{k: v for k, v in it.items() if k not in ACTION_KEYS} for it in items]
        if self.text_tokens is not None:
            out = [full_text(it, self.text_tokens) for it in out]
        return out

    def __call__(self, items: Sequence[dict]) -> Batch:
        return self.collate(self.items(items))


def full_text(item: dict, tokens: int) -> dict:
    """``item`` with its text as ``tokens`` rows, the first ``text_len`` its own and the rest zeros, and
    ``text_len = tokens`` (every row attended, for a model trained on prompts padded so and attended whole)."""
    if "text" not in item:
        return item
    text = item["text"]
    n = int(item.get("text_len", text.shape[0]))
    if n > tokens:
        raise ValueError(f"episode {item.get('episode_index', '?')}: its text has {n} tokens, more than the model's "
                         f"{tokens} (the text length it was trained with)")
    out = text.new_zeros(tokens, text.shape[1])
    out[:n] = text[:n]
    return {**item, "text": out, "text_len": tokens}


@dataclass(frozen=True, kw_only=True)
class Data:
    """The episodes of one split with this rank's sampler and the collate matching it."""

    dataset: EpisodeDataset
    sampler: BatchSampler
    collate: ModelCollate


@dataclass(frozen=True, kw_only=True)
class Run:
    """What a run trains on and where, resolved once (see the module docstring)."""

    config: TrainConfig
    family: ModelFamily
    model_config: ModelShape  # the family's resolved model config (WanVAConfig for "wanva")
    objective: Objective  # the family's objective (flexpack.flow.objectives)
    geometry: TokenGeometry
    device: torch.device
    rank: int = 0
    world_size: int = 1
    forward: ForwardOptions
    split: Split
    data: Data

    # -------------------------------------------------------------- what callers read most
    @property
    def dataset(self) -> EpisodeDataset:
        return self.data.dataset

    @property
    def sampler(self) -> BatchSampler:
        return self.data.sampler

    @property
    def collate(self) -> ModelCollate:
        return self.data.collate

    @property
    def tokens_per_frame(self) -> int:
        return self.geometry.tokens_per_frame

    @property
    def text_slots(self) -> int | None:
        return self.forward.text_slots

    @property
    def parallel(self) -> ParallelOptions:
        """How the model is wrapped on this run's device (:func:`parallel_options`: the memory-budget rule
        is checked where a model is built, not where a run only reads data)."""
        return parallel_options(self.config, self.device)

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """bf16 autocast of the model calls (``runtime.dtype = "bfloat16"`` on one rank); under FSDP2
        its mixed-precision policy casts the parameters instead."""
        return torch.bfloat16 if self.config.runtime.dtype == "bfloat16" and self.world_size == 1 else None

    def autocast(self) -> ContextManager[Any]:
        """The model calls' autocast context (:attr:`autocast_dtype`)."""
        dtype = self.autocast_dtype
        return torch.autocast(self.device.type, dtype) if dtype is not None else contextlib.nullcontext()

    # -------------------------------------------------------------- derived runs and parts
    def batching(self, lengths: Sequence[int], *, rank: int | None = None,
                 world_size: int | None = None) -> tuple[BatchSampler, ModelCollate]:
        """(sampler, collate) of ``data.mode`` over episode ``lengths`` with this run's geometry."""
        sampler, collate = batching(self.config, lengths, self.geometry, self.rank if rank is None else rank,
                                    self.world_size if world_size is None else world_size)
        return sampler, model_collate(collate, self.model_config, self.family)

    def with_dataset(self, dataset: EpisodeDataset) -> "Run":
        """This run over other episodes (the held-out ones, say): their own sampler and collate, the same
        geometry, model and options."""
        check_fits_model(dataset, self.model_config, self.config)
        sampler, collate = batching(self.config, dataset.lengths(), self.geometry, self.rank, self.world_size,
                                    mixture=getattr(dataset, "mixture_weights", None))
        collate = model_collate(collate, self.model_config, self.family)
        return replace(self, data=Data(dataset=dataset, sampler=sampler, collate=collate))

    def build_model(self) -> nn.Module:
        """The model as training runs it: built (random init, or ``model.pretrained``), LoRA adapters injected
        where ``lora.rank`` > 0 (:mod:`flexpack.run.lora`: the base frozen), parallelized (float8 → compile →
        activation checkpointing → FSDP2 under several ranks) and materialized (a sharded pretrained model loads
        its shards after ``fully_shard``)."""
        from flexpack.parallel.parallelize import parallelize
        from flexpack.run.model import build_model, materialize

        with self.device:  # built where it runs: no full fp32 copy of a 5B model in host memory per rank
            model = build_model(self.config, self.model_config, self.family)
            if self.config.lora.rank:  # after the weights load, before any wrapping
                from flexpack.run import lora

                model = lora.apply(model, self.config)
        model = parallelize(model, device=self.device, options=self.parallel)
        materialize(model, self.config, self.device, self.model_config, self.family)
        return model


def use_compile(cfg: TrainConfig, device: torch.device) -> bool:
    """``parallel.compile``: ``"auto"`` compiles the blocks on CUDA in pack mode (one shape per pack;
    pad mode's many shapes would each compile)."""
    if cfg.parallel.compile == "auto":
        return device.type == "cuda" and cfg.data.mode == "pack"
    return bool(cfg.parallel.compile)


def parallel_options(cfg: TrainConfig, device: torch.device) -> ParallelOptions:
    """The config's :class:`ParallelOptions` on ``device``: ``parallel.compile = "auto"`` resolved
    there, and the memory-budget rule checked against it (once, for train, verify and benchmarks)."""
    from flexpack.parallel.parallelize import check_memory_budget

    r, compiled = cfg.runtime, use_compile(cfg, device)
    check_memory_budget(cfg.parallel.activation_memory_budget, compiled, "parallel.activation_memory_budget",
                        f", which parallel.compile = {cfg.parallel.compile!r} leaves off here "
                        f"({device.type}, {cfg.data.mode} mode); set parallel.compile = true")
    return ParallelOptions(compile=compiled, activation_checkpointing=cfg.parallel.activation_checkpointing,
                           memory_budget=cfg.parallel.activation_memory_budget, float8=cfg.parallel.float8,
                           param_dtype=torch.bfloat16 if r.dtype == "bfloat16" else None,
                           blocks=cfg.model.model_family().blocks,
                           host_offload=cfg.optim.offload == "optimizer+gradients")


def model_collate(collate: PackCollate | PadCollate, model_cfg: ModelShape, family: ModelFamily) -> ModelCollate:
    """``collate`` for ``model_cfg`` of ``family``: actions where it has them, text as its conventions want it."""
    return ModelCollate(collate, actions=model_cfg.action_channels > 0,
                        text_tokens=family.conventions(model_cfg).text_tokens)


def forward_options(cfg: TrainConfig, text_slots: int | None = None) -> ForwardOptions:
    """The config's :class:`ForwardOptions` (``model.mask``, ``model.chunk_size``)."""
    return ForwardOptions(mask=cfg.model.mask, chunk_size=cfg.model.chunk_size, text_slots=text_slots)


def geometry_for(model_cfg: ModelShape, latent_hw: tuple[int, int], cfg: TrainConfig) -> TokenGeometry:
    """The token geometry of latents of ``latent_hw`` (H, W) for ``model_cfg`` under ``cfg``: the
    frame's patches, ``data.action_steps`` action tokens (none for a model without actions; the
    family's, where its conventions fix them), the family's copies (``objective.teacher_forcing``
    decides where the family leaves it open), ``data.max_tokens`` per pack in pack mode."""
    family = cfg.model.model_family()
    check_action_steps(family.conventions(model_cfg), cfg, family)
    _, ph, pw = model_cfg.patch_size
    return TokenGeometry(video_tokens=(latent_hw[0] // ph) * (latent_hw[1] // pw),
                         action_tokens=cfg.data.action_steps if model_cfg.action_channels else 0,
                         copies=family.copies_of(cfg.objective.teacher_forcing),
                         max_tokens=cfg.data.max_tokens if cfg.data.mode == "pack" else None)


def check_action_steps(conv: DataConventions, cfg: TrainConfig, family: ModelFamily) -> None:
    """``data.action_steps`` against the action steps per latent frame the family's model takes, in one line."""
    if conv.action_steps is not None and cfg.data.action_steps != conv.action_steps:
        from flexpack.run.pretrained import field_source

        raise ValueError(f"data.action_steps = {cfg.data.action_steps}, but the {family.name} model takes "
                         f"{conv.action_steps} action steps per latent frame ({conv.action_steps_field}, from "
                         f"{field_source(cfg.model, conv.action_steps_field)}); set "
                         f"data.action_steps = {conv.action_steps}")


def batching(cfg: TrainConfig, lengths: Sequence[int], geometry: TokenGeometry, rank: int = 0,
             world_size: int = 1, *, mixture: tuple[Sequence[int], Sequence[float]] | None = None,
             grid: tuple[int, int] | None = None) -> tuple[BatchSampler, PackCollate | PadCollate]:
    """(sampler, collate) of ``data.mode`` over episode ``lengths`` (latent frames): the token-budget
    sampler with its pack collate, or the length-bucket sampler with the pad collate; ``mixture`` (the source
    of every item, the weight of every source): the weighted token-budget sampler; ``grid``: the run's latent
    grid where its items' grids differ (:func:`run_grid`; the collate pads smaller ones spatially)."""
    from flexpack.packing.batch_sampler import LengthBucketBatchSampler, TokenBudgetBatchSampler

    d, tpf = cfg.data, geometry.tokens_per_frame
    if d.mode == "pack" and mixture is not None:
        from flexpack.packing.weighted import WeightedTokenBudgetBatchSampler

        sampler = WeightedTokenBudgetBatchSampler(lengths, d.max_tokens, tokens_per_frame=tpf, groups=mixture[0],
                                                  weights=mixture[1], crop=d.crop, rank=rank,
                                                  world_size=world_size, seed=d.seed)
        return sampler, PackCollate.from_token_budget(d.max_tokens, tpf, crop=d.crop, grid=grid)
    if d.mode == "pack":
        sampler = TokenBudgetBatchSampler(lengths, d.max_tokens, tokens_per_frame=tpf, crop=d.crop, rank=rank,
                                          world_size=world_size, seed=d.seed)
        return sampler, PackCollate.from_token_budget(d.max_tokens, tpf, crop=d.crop, grid=grid)
    sampler = LengthBucketBatchSampler(lengths, d.batch_size, pool_factor=d.pool_factor,
                                       pad_multiple=d.pad_multiple, tokens_per_frame=tpf, rank=rank,
                                       world_size=world_size, seed=d.seed)
    return sampler, PadCollate(d.pad_multiple, grid=grid)


def run_text_slots(sampler: BatchSampler) -> int:
    """Text key slots for a run: the most episodes any micro-batch of any epoch can hold
    (``sampler.most_per_batch()``: in pack mode the shortest episodes that fit one budget), so that
    the text keys keep one shape, and the compiled blocks one graph, for the whole run. Not rounded
    up: every empty slot costs its text tokens' key and value projections in every block."""
    return max(1, sampler.most_per_batch())


def check_fits_model(dataset: EpisodeDataset, model_cfg: ModelShape, cfg: TrainConfig) -> tuple[int, int]:
    """The (H, W) of the dataset's latents, after checking that they and its text fit ``model_cfg``."""
    item = dataset[0]
    C, _, H, W = item["latent"].shape
    _, ph, pw = model_cfg.patch_size
    text_dim = item["text"].shape[1] if "text" in item else model_cfg.text_dim
    if C != model_cfg.in_channels or H % ph or W % pw or text_dim != model_cfg.text_dim:
        where = cfg.data.root or "the dataset"
        raise ValueError(
            f"{where}: latents (C, H, W)={(C, H, W)} with text width {text_dim} do not fit the model "
            f"(in_channels={model_cfg.in_channels}, patch={model_cfg.patch_size}, text_dim={model_cfg.text_dim}); "
            "set model.overrides"
        )
    tokens = cfg.model.model_family().conventions(model_cfg).text_tokens
    if tokens is not None:
        full_text(item, tokens)  # a text longer than the model's is refused here, before any batch
    return H, W


def run_grid(dataset: EpisodeDataset, model_cfg: ModelShape, cfg: TrainConfig) -> tuple[int, int] | None:
    """The run's latent grid (H, W) where the dataset's grids differ (``latent_grids``: bundles, mixtures): the
    largest H and W, which every micro-batch takes (smaller grids are padded spatially, :mod:`flexpack.packing.grids`);
    None where every item has one grid. One line naming a dataset the patch size does not divide."""
    grids = getattr(dataset, "latent_grids", None)
    found = {(h, w) for gs in (grids or {}).values() for _, h, w in gs}
    if len(found) < 2:
        return None
    _, ph, pw = model_cfg.patch_size
    for name, gs in grids.items():
        if bad := [g for g in gs if g[1] % ph or g[2] % pw]:
            raise ValueError(f"{cfg.data.root or 'data'}: dataset {name}'s latents (C, H, W)={bad[0]} are not a "
                             f"multiple of the model's patch {model_cfg.patch_size}")
    return max(h for h, _ in found), max(w for _, w in found)


def run_for(dataset: EpisodeDataset, cfg: TrainConfig, *, rank: int = 0, world_size: int = 1,
            device: torch.device | None = None, split: Split | None = None) -> Run:
    """The :class:`Run` of ``cfg`` over ``dataset`` (items as :class:`~flexpack.data.LatentEpisodeDataset`
    yields them, with ``lengths()``), for this rank's share of the sampler, on ``device`` (default the
    config's ``runtime.device``). Pack mode checks every item fits ``data.max_tokens`` (or ``data.crop``)."""
    from flexpack.run.checks import check_token_budget, resolve_device

    family, model_cfg = cfg.model.model_family(), cfg.model.resolved()
    device = resolve_device(cfg.runtime.device) if device is None else device
    hw = check_fits_model(dataset, model_cfg, cfg)
    grid = run_grid(dataset, model_cfg, cfg)
    geometry = geometry_for(model_cfg, grid or hw, cfg)  # a padded item costs the run grid's tokens
    if cfg.data.mode == "pack":
        check_token_budget(cfg, dataset, geometry)
    sampler, collate = batching(cfg, dataset.lengths(), geometry, rank, world_size,
                                mixture=getattr(dataset, "mixture_weights", None), grid=grid)
    data = Data(dataset=dataset, sampler=sampler, collate=model_collate(collate, model_cfg, family))
    return Run(config=cfg, family=family, model_config=model_cfg,
               objective=objective_for(family.objective, cfg.objective, model_cfg),
               geometry=geometry, device=device, rank=rank, world_size=world_size,
               forward=forward_options(cfg, run_text_slots(sampler)), split=split or Split(), data=data)
