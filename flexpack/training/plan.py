"""The composition root: one frozen :class:`Plan` of what a config trains on, made once.

:func:`plan_for` resolves, from a dataset and a :class:`~flexpack.training.config.TrainConfig`:

- the model's :class:`~flexpack.models.wan_config.WanVAConfig` (``cfg.model.wan_config()`` is
  called once: with ``model.pretrained`` it reads that ``config.json`` from disk);
- the :class:`~flexpack.packing.geometry.TokenGeometry`: video and action tokens of a latent
  frame, copies (2 under teacher forcing) and the pack's frame budget;
- the dataset, the sampler of ``data.mode`` and the collate matching it (:class:`ModelCollate`);
- the :class:`ForwardOptions` of every model call (mask, chunk size, text slots).

The train loop, one step, validation, ``verify``, the step meter, the profiler and the benchmarks
take these from the plan instead of deriving them again. The dataset is a LeRobot-backed
:class:`~flexpack.data.LatentEpisodeDataset` (:func:`flexpack.training.build.build_data`) or
in-memory episodes (:func:`flexpack.training.memory_data.synthetic_data`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from flexpack.models.wan_config import WanVAConfig
from flexpack.packing.collate import Batch, PackCollate, PadCollate
from flexpack.packing.geometry import TokenGeometry

ACTION_KEYS = ("action", "action_mask")


@dataclass(frozen=True, kw_only=True)
class ForwardOptions:
    """Options of every training-side model call besides the batch and its timesteps.

    ``mask``: ``model.mask``; ``chunk_size``: ``model.chunk_size``; ``text_slots``: text key slots
    for the whole run (one compiled shape per pack; None: the model's default per call)."""

    mask: str = "document"
    chunk_size: int | None = None
    text_slots: int | None = None

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``WanVA.forward`` these options set."""
        return {"mask": self.mask, "chunk_size": self.chunk_size, "text_slots": self.text_slots}

    def __call__(self, model: Any, sample: Any, layout: Any = None) -> Any:
        """``model`` on a :class:`~flexpack.training.flow.objective.FlowSample`'s inputs and timesteps
        (``layout``: default the batch's own)."""
        return model(sample.inputs, layout, **sample.model_kwargs(), **self.kwargs())


@dataclass(frozen=True, kw_only=True)
class ParallelOptions:
    """How :func:`flexpack.training.parallel.parallelize` wraps the model on one device: the one
    activation-checkpointing setting (``runtime.activation_checkpointing``), compiled blocks with
    their memory budget, float8 and the FSDP compute dtype."""

    compile: bool
    activation_checkpointing: bool | int | str
    memory_budget: float
    float8: str
    param_dtype: Any  # torch.dtype or None

    def kwargs(self) -> dict[str, Any]:
        """The keyword arguments of ``parallelize`` (besides ``device``)."""
        return {"compile": self.compile, "activation_checkpointing": self.activation_checkpointing,
                "memory_budget": self.memory_budget, "float8": self.float8, "param_dtype": self.param_dtype}


def use_compile(cfg: Any, device: Any) -> bool:
    """``runtime.compile``: ``"auto"`` compiles the blocks on CUDA in pack mode (one shape per pack;
    pad mode's many shapes would each compile)."""
    if cfg.runtime.compile == "auto":
        return device.type == "cuda" and cfg.data.mode == "pack"
    return bool(cfg.runtime.compile)


def parallel_options(cfg: Any, device: Any) -> ParallelOptions:
    """The config's :class:`ParallelOptions` on ``device``: ``runtime.compile = "auto"`` resolved
    there, and the memory-budget rule checked against it (once, for train, verify and benchmarks)."""
    import torch

    from flexpack.training.parallel import check_memory_budget

    r, compiled = cfg.runtime, use_compile(cfg, device)
    check_memory_budget(r.activation_memory_budget, compiled, "runtime.activation_memory_budget",
                        f", which runtime.compile = {r.compile!r} leaves off here "
                        f"({device.type}, {cfg.data.mode} mode); set runtime.compile = true")
    return ParallelOptions(compile=compiled, activation_checkpointing=r.activation_checkpointing,
                           memory_budget=r.activation_memory_budget, float8=r.float8,
                           param_dtype=torch.bfloat16 if r.dtype == "bfloat16" else None)


def forward_options(cfg: Any, text_slots: int | None = None) -> ForwardOptions:
    """The config's :class:`ForwardOptions` (``model.mask``, ``model.chunk_size``)."""
    return ForwardOptions(mask=cfg.model.mask, chunk_size=cfg.model.chunk_size, text_slots=text_slots)


class ModelCollate:
    """A sampler's collate for one model: items lose their actions where the model has no action
    channels (a video-only model gets no action stream), then ``collate`` builds the Batch."""

    def __init__(self, collate: Any, actions: bool) -> None:
        self.collate, self.actions = collate, actions

    def items(self, items: Sequence[dict]) -> list[dict]:
        """``items`` as the model takes them."""
        if self.actions:
            return list(items)
        return [{k: v for k, v in it.items() if k not in ACTION_KEYS} for it in items]

    def __call__(self, items: Sequence[dict]) -> Batch:
        return self.collate(self.items(items))


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What a run trains on, resolved once (see the module docstring)."""

    model: WanVAConfig
    geometry: TokenGeometry
    dataset: Any
    sampler: Any
    collate: ModelCollate
    forward: ForwardOptions

    @property
    def tokens_per_frame(self) -> int:
        return self.geometry.tokens_per_frame

    @property
    def text_slots(self) -> int | None:
        return self.forward.text_slots


def geometry_for(model: WanVAConfig, latent_hw: tuple[int, int], cfg: Any) -> TokenGeometry:
    """The token geometry of latents of ``latent_hw`` (H, W) for ``model`` under ``cfg``: the
    frame's patches, ``data.action_steps`` action tokens (none for a model without actions), two
    copies under ``objective.teacher_forcing``, ``data.max_tokens`` per pack in pack mode."""
    _, ph, pw = model.patch_size
    return TokenGeometry(video_tokens=(latent_hw[0] // ph) * (latent_hw[1] // pw),
                         action_tokens=cfg.data.action_steps if model.action_channels else 0,
                         copies=2 if cfg.objective.teacher_forcing else 1,
                         max_tokens=cfg.data.max_tokens if cfg.data.mode == "pack" else None)


def batching(cfg: Any, lengths: Sequence[int], geometry: TokenGeometry, rank: int = 0,
             world_size: int = 1) -> tuple[Any, Any]:
    """(sampler, collate) of ``data.mode`` over episode ``lengths`` (latent frames): the token-budget
    sampler with its pack collate, or the length-bucket sampler with the pad collate."""
    from flexpack.packing.sampler import LengthBucketBatchSampler, TokenBudgetBatchSampler

    d, tpf = cfg.data, geometry.tokens_per_frame
    common = dict(rank=rank, world_size=world_size, seed=d.seed)
    if d.mode == "pack":
        sampler = TokenBudgetBatchSampler(lengths, d.max_tokens, tokens_per_frame=tpf, crop=d.crop, **common)
        return sampler, PackCollate.from_token_budget(d.max_tokens, tpf, crop=d.crop)
    sampler = LengthBucketBatchSampler(lengths, d.batch_size, pool_factor=d.pool_factor,
                                       pad_multiple=d.pad_multiple, tokens_per_frame=tpf, **common)
    return sampler, PadCollate(d.pad_multiple)


def run_text_slots(sampler: Any) -> int:
    """Text key slots for a run: the most episodes any micro-batch of any epoch can hold
    (``sampler.most_per_batch()``: in pack mode the shortest episodes that fit one budget), so that
    the text keys keep one shape, and the compiled blocks one graph, for the whole run. Not rounded
    up: every empty slot costs its text tokens' key and value projections in every block."""
    return max(1, sampler.most_per_batch())


def check_fits_model(dataset: Any, model: WanVAConfig, cfg: Any) -> tuple[int, int]:
    """The (H, W) of the dataset's latents, after checking that they and its text fit ``model``."""
    item = dataset[0]
    C, _, H, W = item["latent"].shape
    _, ph, pw = model.patch_size
    text_dim = item["text"].shape[1] if "text" in item else model.text_dim
    if C != model.in_channels or H % ph or W % pw or text_dim != model.text_dim:
        where = cfg.data.root or "the dataset"
        raise ValueError(
            f"{where}: latents (C, H, W)={(C, H, W)} with text width {text_dim} do not fit the model "
            f"(in_channels={model.in_channels}, patch={model.patch_size}, text_dim={model.text_dim}); "
            "set model.overrides"
        )
    return H, W


def plan_for(dataset: Any, cfg: Any, *, rank: int = 0, world_size: int = 1, model: WanVAConfig | None = None) -> Plan:
    """The :class:`Plan` of ``cfg`` over ``dataset`` (items as :class:`~flexpack.data.LatentEpisodeDataset`
    yields them, with ``lengths()``), for this rank's share of the sampler. ``model``: the resolved
    model config where the caller has it already (else ``cfg.model.wan_config()``, once).
    Pack mode checks every item fits ``data.max_tokens`` (or ``data.crop``)."""
    from flexpack.training.checks import check_token_budget

    model = cfg.model.wan_config() if model is None else model
    geometry = geometry_for(model, check_fits_model(dataset, model, cfg), cfg)
    if cfg.data.mode == "pack":
        check_token_budget(cfg, dataset, geometry)
    sampler, collate = batching(cfg, dataset.lengths(), geometry, rank, world_size)
    return Plan(model=model, geometry=geometry, dataset=dataset, sampler=sampler,
                collate=ModelCollate(collate, actions=model.action_channels > 0),
                forward=forward_options(cfg, run_text_slots(sampler)))
