"""The typed :class:`Run`: one frozen record of what a config trains on and where, made once by
:func:`flexpack.run.compose.compose` (the only code that turns a config's names into objects), and its parts.

A run holds:

- the config (checked, defaults filled in), the model family (:mod:`flexpack.models.registry`) and its resolved
  model config (``model.pretrained``'s ``config.json`` read once, by compose);
- the :class:`~flexpack.packing.geometry.TokenGeometry`: video and action tokens of a latent frame,
  copies (the family's: 2 under teacher forcing, or always 2) and the pack's frame budget;
- the :class:`~flexpack.flow.objectives.Objective` the family trains with (its sample, loss and counts);
- where it runs: the device, this rank and the world size, the bf16 autocast rule (:meth:`Run.autocast`), and the
  :class:`~flexpack.parallel.parallelize.ParallelOptions` the model is wrapped with (:meth:`Run.build_model`);
- the :class:`ForwardOptions` of every model call (mask, chunk size, text slots);
- the train / held-out :class:`Split`, and the :class:`Data` of its role: the dataset, the sampler of
  ``data.mode`` and the collate matching it (:class:`ModelCollate`: the items as the family's data
  conventions want them), and the run's latent grid where its items' grids differ.

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

from flexpack.errors import moved_names
from flexpack.flow.objectives import Objective
from flexpack.models.registry import DataConventions, ModelFamily, ModelShape
from flexpack.packing.collate import Batch, PackCollate, PadCollate
from flexpack.packing.geometry import TokenGeometry
from flexpack.parallel.parallelize import ParallelOptions
from flexpack.run.config import TrainConfig
from flexpack.run.resolve import config_family

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
    """What a run trains on and where, resolved once by :func:`flexpack.run.compose.compose` (see the module
    docstring). ``geometry`` and ``data`` are None for an ``"export"`` run (no data), ``data`` for a ``"sample"`` run
    of pairs made in memory."""

    config: TrainConfig
    family: ModelFamily
    model_config: ModelShape  # the family's resolved model config (WanVAConfig for "wanva")
    objective: Objective  # the family's objective (flexpack.flow.objectives)
    geometry: TokenGeometry | None
    device: torch.device
    rank: int = 0
    world_size: int = 1
    forward: ForwardOptions
    split: Split
    data: Data | None
    grid: tuple[int, int] | None = None  # the run's latent grid where its items' grids differ (run_grid)
    # bf16 autocast of the model calls (compose's rule, flexpack.run.compose.autocast_dtype); None: none
    autocast_dtype: torch.dtype | None = None
    role: str = "train"  # what it was composed for (flexpack.run.compose.ROLES)

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
        return parallel_options(self.config, self.device, self.family)

    def autocast(self) -> ContextManager[Any]:
        """The model calls' autocast context (:attr:`autocast_dtype`)."""
        dtype = self.autocast_dtype
        return torch.autocast(self.device.type, dtype) if dtype is not None else contextlib.nullcontext()

    # -------------------------------------------------------------- derived runs and parts
    def batching(self, lengths: Sequence[int], *, rank: int | None = None,
                 world_size: int | None = None) -> tuple[BatchSampler, ModelCollate]:
        """(sampler, collate) of ``data.mode`` over episode ``lengths`` with this run's geometry."""
        sampler, collate = batching(self.config, lengths, self.geometry, self.rank if rank is None else rank,
                                    self.world_size if world_size is None else world_size, grid=self.grid)
        return sampler, model_collate(collate, self.model_config, self.family)

    def with_dataset(self, dataset: EpisodeDataset) -> "Run":
        """This run over other episodes (the held-out ones, say): their own sampler and collate, the same
        geometry, model and options."""
        check_fits_model(dataset, self.model_config, self.config)
        sampler, collate = batching(self.config, dataset.lengths(), self.geometry, self.rank, self.world_size,
                                    mixture=getattr(dataset, "mixture_weights", None), grid=self.grid)
        collate = model_collate(collate, self.model_config, self.family)
        return replace(self, data=Data(dataset=dataset, sampler=sampler, collate=collate))

    def build_model(self) -> nn.Module:
        """The model as training runs it (the start-up train and verify share): float8's token multiple checked,
        built (random init, or ``model.pretrained``), LoRA adapters injected
        where ``lora.rank`` > 0 (:mod:`flexpack.run.lora`: the base frozen), parallelized (float8 → compile →
        activation checkpointing → FSDP2 under several ranks) and materialized (a sharded pretrained model loads
        its shards after ``fully_shard``)."""
        from flexpack.parallel import float8
        from flexpack.parallel.parallelize import parallelize
        from flexpack.run.model import build_model, materialize

        if self.geometry is not None:  # float8 GEMMs take multiples of 16 tokens
            float8.check_tokens(self.config.parallel.float8, self.config.data, self.geometry, self.device)
        with self.device:  # built where it runs: no full fp32 copy of a 5B model in host memory per rank
            model = build_model(self.config, self.model_config, self.family)
            if self.config.lora.rank:  # after the weights load, before any wrapping
                from flexpack.run import lora

                model = lora.apply(model, self.config, record=lora.lora_record(self.config, self.family))
        model = parallelize(model, device=self.device, options=self.parallel)
        materialize(model, self.config, self.device, self.model_config, self.family)
        return model


def use_compile(cfg: TrainConfig, device: torch.device) -> bool:
    """``parallel.compile``: ``"auto"`` compiles the blocks on CUDA in pack mode (one shape per pack;
    pad mode's many shapes would each compile)."""
    if cfg.parallel.compile == "auto":
        return device.type == "cuda" and cfg.data.mode == "pack"
    return bool(cfg.parallel.compile)


def parallel_options(cfg: TrainConfig, device: torch.device, family: ModelFamily) -> ParallelOptions:
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
                           blocks=family.blocks,
                           host_offload=cfg.optim.offload == "optimizer+gradients")


def model_collate(collate: PackCollate | PadCollate, model_cfg: ModelShape, family: ModelFamily) -> ModelCollate:
    """``collate`` for ``model_cfg`` of ``family``: actions where it has them, text as its conventions want it."""
    return ModelCollate(collate, actions=model_cfg.action_channels > 0,
                        text_tokens=family.conventions(model_cfg).text_tokens)


def forward_options(cfg: TrainConfig, text_slots: int | None = None) -> ForwardOptions:
    """The config's :class:`ForwardOptions` (``model.mask``, ``model.chunk_size``)."""
    return ForwardOptions(mask=cfg.model.mask, chunk_size=cfg.model.chunk_size, text_slots=text_slots)


def geometry_for(model_cfg: ModelShape, latent_hw: tuple[int, int], cfg: TrainConfig,
                 family: ModelFamily | None = None) -> TokenGeometry:
    """The token geometry of latents of ``latent_hw`` (H, W) for ``model_cfg`` under ``cfg``: the
    frame's patches, ``data.action_steps`` action tokens (none for a model without actions; the
    family's, where its conventions fix them), the family's copies (``objective.teacher_forcing``
    decides where the family leaves it open), ``data.max_tokens`` per pack in pack mode."""
    family = config_family(cfg) if family is None else family
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
             grid: tuple[int, int] | None = None, mode: str | None = None
             ) -> tuple[BatchSampler, PackCollate | PadCollate]:
    """(sampler, collate) of ``data.mode`` over episode ``lengths`` (latent frames): the token-budget
    sampler with its pack collate, or the length-bucket sampler with the pad collate; ``mixture`` (the source
    of every item, the weight of every source): the weighted token-budget sampler; ``grid``: the run's latent
    grid where its items' grids differ (:func:`run_grid`; the collate pads smaller ones spatially); ``mode``: another
    mode than ``data.mode`` (sampling always packs)."""
    from flexpack.packing.batch_sampler import LengthBucketBatchSampler, TokenBudgetBatchSampler

    d, tpf = cfg.data, geometry.tokens_per_frame
    mode = d.mode if mode is None else mode
    if mode == "pack" and mixture is not None:
        from flexpack.packing.weighted import WeightedTokenBudgetBatchSampler

        sampler = WeightedTokenBudgetBatchSampler(lengths, d.max_tokens, tokens_per_frame=tpf, groups=mixture[0],
                                                  weights=mixture[1], crop=d.crop, rank=rank,
                                                  world_size=world_size, seed=d.seed)
        return sampler, PackCollate.from_token_budget(d.max_tokens, tpf, crop=d.crop, grid=grid)
    if mode == "pack":
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
    tokens = config_family(cfg).conventions(model_cfg).text_tokens
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


# run_for moved to flexpack.run.compose (which imports this module)
__getattr__ = moved_names(__name__, {"run_for": "flexpack.run.compose"})
