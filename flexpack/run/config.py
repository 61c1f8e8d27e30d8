"""The training config: one tree of keyword-only dataclasses, loaded from TOML or JSON.

``TrainConfig`` holds what a run trains (``data / model / objective / optim / schedule / checkpoint``)
and how it runs (``runtime / parallel / profile / log / validation / sample``: :mod:`flexpack.run.config_sections`).
Variants are small files in ``configs/`` that name only what differs from the defaults below;
nothing is ever executed. :func:`load_config` rejects unknown keys (naming the file and the key)
and values of the wrong type, and applies ``section.key=value`` overrides (values parsed as TOML,
falling back to a plain string), e.g. ``schedule.steps=40`` or ``model.overrides.dim=128``.
Keys that once lived under ``[runtime]`` (:data:`~flexpack.run.config_renamed.RENAMED`) load at their new
place: a run folder's saved config quietly, a TOML file or ``--set`` with a note on stderr naming the new key.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from flexpack.atomic import atomic_path
from flexpack.flow.objective import FlowMatchingConfig
from flexpack.run.config_parse import apply_overrides, check_finite, from_dict
from flexpack.run.config_renamed import RENAMED, upgrade, upgrade_overrides
from flexpack.run.config_sections import (
    LogConfig,
    LoraConfig,
    MemoryConfig,
    ParallelConfig,
    ProfileConfig,
    RuntimeConfig,
    SampleConfig,
    ValidationConfig,
)

MODES = ("pack", "pad")
DECAYS = ("cosine", "constant")
REWARMUPS = ("linear", "ramp")
OPTIM_STATES = ("float32", "8bit", "4bit")  # AdamW moments: torch fp32, torchao AdamW8bit / AdamW4bit
OPTIM_OFFLOADS = ("none", "optimizer", "optimizer+gradients")  # torchao CPUOffloadOptimizer


def _positive(owner: str, **values: int | float) -> None:
    for name, v in values.items():
        if not math.isfinite(v):
            raise ValueError(f"{owner}.{name} must be a finite number, got {v!r}")
        if v <= 0:
            raise ValueError(f"{owner}.{name} must be positive, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class DatasetEntry:
    """One source of a mixture (``[[data.datasets]]``): an upstream bundle root, or one LeRobot v2.1 dataset with
    its pre-extracted ``.pth`` latents; the options a bundle's ``data.*`` keys give, per source."""

    root: str  # the source's folder
    name: str = ""  # its name in metrics and check-dataset ("" = the folder's name)
    weight: float | None = None  # its share of an epoch's tokens (relative); none set anywhere = natural shares
    # the model channel of each of its action columns (used_action_channel_ids); unset = the family's
    action_channels: tuple[int, ...] | None = None
    cameras: tuple[str, ...] | None = None  # its camera keys in composition order; unset = the family's
    camera_layout: str = "auto"  # "auto", "width_concat" or "tshape"
    norm_stat: str = ""  # a JSON file with q01/q99 in the model's action space; "" = pooled
    # sources naming one embodiment pool their statistics; "" = pooled within the source alone
    embodiment: str = ""
    action_transform: str = ""  # "" or "relative_pose:C0,C1,..."

    def __post_init__(self) -> None:
        if not self.root:
            raise ValueError("data.datasets: every entry needs a root")
        if self.weight is not None and not (math.isfinite(self.weight) and self.weight > 0):
            raise ValueError(f"data.datasets ({self.root}): weight must be a positive number, got {self.weight!r}")
        from flexpack.data.bundle_actions import parse_transform
        from flexpack.data.bundle_grid import LAYOUTS

        if self.camera_layout not in LAYOUTS:
            raise ValueError(f"data.datasets ({self.root}): camera_layout must be one of {LAYOUTS}, "
                             f"got {self.camera_layout!r}")
        parse_transform(self.action_transform)


@dataclass(frozen=True, kw_only=True)
class DataConfig:
    """Where episodes come from and how micro-batches are formed.

    ``mode = "pack"``: TokenBudgetBatchSampler + PackCollate, ``max_tokens`` per micro-batch.
    ``mode = "pad"``: LengthBucketBatchSampler + PadCollate, ``batch_size`` episodes per micro-batch.
    Tokens per latent frame (for the budget) follow from the latent's patch grid and
    ``action_steps``; the dataset's action width is the model's ``action_channels``.
    """

    root: str = ""  # LeRobot dataset folder (with a latent cache), or a repo id in lerobot's cache (HF_LEROBOT_HOME)
    latents_dir: str | None = None  # latent cache folder; unset = ROOT/latents
    cameras: tuple[str, ...] | None = None  # video keys used as cameras; unset = all of the dataset's
    action_steps: int = 4  # action steps per latent frame (must divide stride)
    stride: int = 4  # video frames per latent frame (the VAE's temporal stride)
    normalize: bool = True  # normalize actions with the dataset's action statistics
    # "pooled": exact quantiles over all frames (LATENTS/stats.json); "lerobot": meta/stats.json
    action_stats: str = "pooled"
    segments: bool | str = "auto"  # items per annotated task run ("auto", true) or whole episodes (false)
    mode: str = "pack"  # "pack": token-budget packed micro-batches; "pad": padded batches of batch_size episodes
    max_tokens: int = 65536  # pack mode: token budget of one micro-batch
    crop: bool = False  # pack mode: cut an episode longer than max_tokens to it instead of an error
    batch_size: int = 4  # pad mode: episodes per micro-batch
    pool_factor: int = 50  # pad mode: batches per length-sorted pool (larger: less padding, less shuffling)
    pad_multiple: int = 8  # pad mode: frames are padded up to a multiple of this
    num_workers: int = 0  # DataLoader worker processes (0 = load in the main process)
    seed: int = 0  # seed of the sampler's shuffling
    val_fraction: float = 0.0  # share of episodes held out for validation (flexpack.training.validation)
    val_episodes: tuple[int, ...] = ()  # episode indices held out (with val_fraction: both)
    # "auto": a LingBot-VA post-training bundle where data.root holds empty_emb.pt or v2.1 datasets with .pth
    # latents, else "lerobot" (v3 with flexpack's latent cache); or name one (flexpack.data.formats)
    format: str = "auto"
    # lingbot-bundle: how cameras compose into one latent grid: "auto", "width_concat", "tshape" (upstream's)
    camera_layout: str = "auto"
    missing: str = "error"  # lingbot-bundle: a segment whose latent file is missing: "error" or "skip" (listed)
    cfg_prob: float = 0.1  # lingbot-bundle: probability an item's text is the bundle's empty_emb.pt
    # lingbot-bundle: a JSON file {"q01": [...], "q99": [...]} in the model's action space (upstream's norm_stat);
    # "" = exact quantiles pooled over every segment's parquet rows
    norm_stat: str = ""
    # lingbot-bundle: "" or "relative_pose:C0,C1,...": each x y z qx qy qz qw slice from column C made relative
    # to the segment's first frame (upstream's RoboTwin data)
    action_transform: str = ""
    # a mixture: several sources in one run, each a bundle root or a v2.1 dataset with .pth latents, with its own
    # cameras, channel map, statistics and sampling weight ([[data.datasets]] tables; data.root stays "")
    datasets: tuple[DatasetEntry, ...] = ()

    def __post_init__(self) -> None:
        if not 0.0 <= self.val_fraction < 1.0:
            raise ValueError(f"data.val_fraction must be in [0, 1), got {self.val_fraction!r}")
        if self.mode not in MODES:
            raise ValueError(f"data.mode must be one of {MODES}, got {self.mode!r}")
        if self.action_stats not in ("pooled", "lerobot"):
            raise ValueError(f"data.action_stats must be 'pooled' or 'lerobot', got {self.action_stats!r}")
        if self.segments not in (True, False, "auto"):
            raise ValueError(f"data.segments must be true, false or 'auto', got {self.segments!r}")
        _positive("data", action_steps=self.action_steps, stride=self.stride, max_tokens=self.max_tokens,
                  batch_size=self.batch_size, pool_factor=self.pool_factor, pad_multiple=self.pad_multiple)
        if self.stride % self.action_steps:
            raise ValueError(f"data.action_steps = {self.action_steps} must divide data.stride = {self.stride}")
        from flexpack.data.formats import check_data_options  # the option values alone: no disk read

        check_data_options(self)
        if self.datasets and self.root:
            raise ValueError(f"data.root = {self.root!r} and data.datasets both name data; a mixture lists every "
                             "source under data.datasets (leave data.root empty)")
        weighted = [e.weight is not None for e in self.datasets]
        if any(weighted) and not all(weighted):
            raise ValueError("data.datasets: give every entry a weight, or none (natural shares)")
        if any(weighted) and self.mode != "pack":
            raise ValueError("data.datasets weights need data.mode = 'pack' (the packed sampler honours them)")
        if self.num_workers < 0 or self.seed < 0:
            raise ValueError(f"data.num_workers and data.seed must be >= 0, got {self.num_workers}, {self.seed}")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A model family's preset with field overrides, and the self-attention mask of the forward.

    ``family`` picks the registry entry (:mod:`flexpack.models.registry`): ``"wanva"`` (flexpack's
    Wan DiT with an action stream) or another registered family (docs/USAGE.md says how the config's keys
    apply to each: the entry maps, converts or refuses them). ``pretrained``: a checkpoint of that family
    to start from (WanVA: a diffusers ``WanTransformer3DModel`` folder or ``.safetensors`` file; each
    family reads its own layout); its config.json gives the shape, the preset and overrides the rest
    (:mod:`flexpack.run.pretrained`). The section is plain data: the family's config it resolves to is made by
    :func:`flexpack.run.resolve.model_config_of`, once per run (``Run.model_config``), never while it is built.
    """

    family: str = "wanva"  # model family: an entry of flexpack.models.registry (families() lists them)
    # the family's preset (wanva: "tiny", "small" (the CPU demo: 48-channel latents) or "wan2.2-5b")
    preset: str = "tiny"
    # any field of the family's config (or an alias it takes) but activation_checkpointing (a parallel key)
    overrides: dict[str, Any] = field(default_factory=dict)
    pretrained: str = ""  # "" = random init
    # self-attention mask, "" = the family's default (wanva: "document", "chunk_causal", "teacher_forcing" or another
    # mask of flexpack.attention.masks' table that names the family)
    mask: str = ""
    chunk_size: int | None = None  # latent frames per chunk of the chunk_causal / teacher_forcing masks (wanva)

    # the shape fields trained weights record (field -> value), over the preset where model.overrides does not set them;
    # flexpack sample sets it from the checkpoint it samples (model.pretrained then unread); {} = none
    recorded: dict[str, Any] = field(default_factory=dict)
    recorded_from: str = ""  # the file model.recorded was read from (named by its errors)

    def __post_init__(self) -> None:
        if "activation_checkpointing" in self.overrides:  # one setting, applied from outside the model
            raise ValueError("model.overrides.activation_checkpointing = "
                             f"{self.overrides['activation_checkpointing']!r} "
                             "is not a model setting: set parallel.activation_checkpointing instead (true, a block "
                             "count or 'selective')")


@dataclass(frozen=True, kw_only=True)
class OptimConfig:
    lr: float = 1e-4  # peak learning rate (AdamW)
    betas: tuple[float, float] = (0.9, 0.999)  # AdamW betas
    eps: float = 1e-8  # AdamW epsilon
    weight_decay: float = 0.01  # AdamW decoupled weight decay
    grad_clip: float = 1.0  # max global grad norm; 0 = no clipping
    accum_steps: int = 1  # micro-batches per optimizer step
    ema_decay: float = 0.0  # EMA of the weights, saved with checkpoints (flexpack.training.ema); 0 = off
    skip_nonfinite: bool = False  # a NaN/Inf loss or grad norm skips that step (logged) instead of stopping the run
    states: str = "float32"  # AdamW moments: "float32" (torch), "8bit" / "4bit" (torchao AdamW8bit / AdamW4bit)
    # "none"; "optimizer" (states and update on the host, one CUDA GPU); "optimizer+gradients" (the gradients too;
    # under FSDP2: the shards, their gradients and the step on the host)
    offload: str = "none"

    def __post_init__(self) -> None:
        _positive("optim", lr=self.lr, eps=self.eps, accum_steps=self.accum_steps)
        for name in ("weight_decay", "grad_clip"):  # `not >= 0`: NaN fails it too
            if not (math.isfinite(getattr(self, name)) and getattr(self, name) >= 0):
                raise ValueError(f"optim.{name} must be a finite number >= 0, got {getattr(self, name)!r}")
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"optim.betas must both be in [0, 1), got {list(self.betas)}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"optim.ema_decay must be in [0, 1) (0 = off), got {self.ema_decay!r}")
        if self.states not in OPTIM_STATES:
            raise ValueError(f"optim.states must be one of {OPTIM_STATES}, got {self.states!r}")
        if self.offload not in OPTIM_OFFLOADS:
            raise ValueError(f"optim.offload must be one of {OPTIM_OFFLOADS}, got {self.offload!r}")
        if self.offload == "optimizer+gradients" and self.accum_steps > 1:
            raise ValueError(f"optim.offload='optimizer+gradients' frees each gradient once it is on the host, so it "
                             f"cannot accumulate optim.accum_steps={self.accum_steps} micro-batches: set "
                             "optim.accum_steps=1 or optim.offload='optimizer'")


@dataclass(frozen=True, kw_only=True)
class ScheduleConfig:
    """LR: linear warmup to ``optim.lr``, then cosine to ``min_lr_ratio·lr`` at ``steps`` (or constant).

    After a resume the LR re-warms over ``rewarmup_steps`` = N steps (fresh optimizer moments after
    a restart are noisy; 0 = off): the s-th step after the resume (s = 0, 1, ...) gets the schedule
    times ``rewarmup_from + (1 − rewarmup_from)·s/N`` (``rewarmup_mode = "linear"``) or times
    ``min(1, (s+1)/N)`` (``"ramp"``, the reference recipe: 1/N at the first step, 1 at the N-th).
    ``warmup_from_zero``: the warmup factor of 0-based step ``t`` is ``t / warmup_steps`` (the
    reference recipe's, the first step at lr 0) instead of ``(t+1) / warmup_steps``.
    """

    steps: int = 1000  # optimizer steps of the whole run (the end of the LR decay)
    warmup_steps: int = 100  # steps of linear LR warmup from the start
    decay: str = "cosine"  # "cosine" to min_lr_ratio·lr at steps, or "constant"
    min_lr_ratio: float = 0.1  # final LR as a share of optim.lr (cosine decay)
    rewarmup_steps: int = 0  # after a resume, steps of LR re-warmup (0 = off)
    rewarmup_from: float = 0.1  # linear re-warmup: the share of the LR at the first step after a resume
    rewarmup_mode: str = "linear"  # "linear" (from rewarmup_from) or "ramp" (min(1, (s+1)/N))
    warmup_from_zero: bool = False  # warmup factor t/warmup_steps (first step at LR 0) instead of (t+1)/warmup_steps

    def __post_init__(self) -> None:
        _positive("schedule", steps=self.steps)
        if self.decay not in DECAYS:
            raise ValueError(f"schedule.decay must be one of {DECAYS}, got {self.decay!r}")
        if self.rewarmup_mode not in REWARMUPS:
            raise ValueError(f"schedule.rewarmup_mode must be one of {REWARMUPS}, got {self.rewarmup_mode!r}")
        if self.warmup_steps < 0 or self.rewarmup_steps < 0:
            raise ValueError("schedule.warmup_steps/rewarmup_steps must be >= 0, "
                             f"got {self.warmup_steps}, {self.rewarmup_steps}")
        for name in ("min_lr_ratio", "rewarmup_from"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"schedule.{name} must be in [0, 1], got {getattr(self, name)!r}")


@dataclass(frozen=True, kw_only=True)
class CheckpointConfig:
    every: int = 0  # optimizer steps between checkpoints; 0 = only at the end
    keep: int = 2  # newest checkpoints kept
    resume: bool = True  # continue from the newest checkpoint in runtime.out_dir
    async_save: bool = False  # write shards in a background thread (dcp.async_save); training goes on meanwhile

    def __post_init__(self) -> None:
        if self.every < 0 or self.keep < 1:
            raise ValueError(f"checkpoint.every must be >= 0 and checkpoint.keep >= 1, got {self.every}, {self.keep}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    objective: FlowMatchingConfig = field(default_factory=FlowMatchingConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    log: LogConfig = field(default_factory=LogConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    sample: SampleConfig = field(default_factory=SampleConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)

    def __post_init__(self) -> None:
        check_finite(self)  # every float of every section, model.overrides included
        # what needs the registry or the mask table (family, masks, chunk sizes, LoRA targets) is checked by
        # flexpack.run.resolve.check: load_config and compose call it
        if self.validation.every and not (self.data.val_fraction or self.data.val_episodes):
            raise ValueError(f"validation.every={self.validation.every} needs held-out episodes: "
                             "set data.val_fraction or data.val_episodes")
        if self.sample.every and not (self.data.val_fraction or self.data.val_episodes):
            raise ValueError(f"sample.every={self.sample.every} needs held-out episodes: "
                             "set data.val_fraction or data.val_episodes")
        if self.sample.ema and not self.optim.ema_decay:
            raise ValueError("sample.ema = true needs EMA weights: set optim.ema_decay > 0")
        if self.sample.every and self.objective.chunk_size is None:
            raise ValueError(f"sample.every={self.sample.every}: objective.chunk_size is unset, so the "
                             "model is trained with one σ per episode and can only generate jointly, not forecast "
                             "from history; set objective.chunk_size or sample.every = 0")
        if self.lora.rank:
            self._check_lora()

    def _check_lora(self) -> None:
        """The ``[lora]`` section against the rest: the dtypes the model computes in and EMA (its targets against the
        model's modules: :func:`flexpack.run.resolve.check`)."""
        if self.lora.base_dtype == "bfloat16" and self.runtime.dtype != "bfloat16":
            raise ValueError("lora.base_dtype = 'bfloat16' needs runtime.dtype = 'bfloat16' (the model then computes "
                             f"in bf16), got runtime.dtype = {self.runtime.dtype!r}; set runtime.dtype = 'bfloat16' or "
                             "lora.base_dtype = 'float32'")
        if self.optim.ema_decay:
            raise ValueError(f"optim.ema_decay = {self.optim.ema_decay} with lora.rank = {self.lora.rank}: an EMA of "
                             "the LoRA weights is not supported; set optim.ema_decay = 0")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------------- loading
def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {path} does not exist")
    if path.suffix not in (".toml", ".json"):
        raise ValueError(f"config file {path} must end in .toml or .json, got {path.suffix!r}")
    try:
        data = tomllib.loads(path.read_text()) if path.suffix == ".toml" else json.loads(path.read_text())
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text (byte {exc.start}); save the config as UTF-8") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: cannot parse: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: the top level must be a table of sections ({{\"data\": ...}}), "
                         f"got a {type(data).__name__}")
    return data


def load_config(path: str | os.PathLike | None = None, overrides: Sequence[str] = ()) -> TrainConfig:
    """The defaults, updated by the file at ``path`` (TOML/JSON) and then by ``overrides``, checked where the
    registry and the mask table decide (:func:`flexpack.run.resolve.check`: ``model.mask`` defaulted)."""
    data = read_config_file(path) if path is not None else {}
    try:
        # a JSON config is what flexpack writes (a run's config.json): its older keys move without a note
        data = upgrade(data, notes=path is not None and Path(path).suffix != ".json")
        renamed = upgrade_overrides(overrides)
        from flexpack.run.resolve import checked  # the registry and the mask table: the family's masks, ...

        return checked(from_dict(TrainConfig, apply_overrides(data, renamed)))
    except (ValueError, TypeError) as exc:
        raise ValueError(f"{_source(exc, path, overrides)}: {exc}") from None


def _source(exc: Exception, path: str | os.PathLike | None, overrides: Sequence[str]) -> str:
    """Where the value an error names came from: the last ``--set`` of a key the message names,
    else the file (else the defaults)."""
    text = str(exc)
    for item in reversed(overrides):
        key = item.partition("=")[0].strip()
        section, _, old = key.partition(".")
        key = RENAMED.get(old, key) if section == "runtime" else key  # errors name the key as it is now
        parent, _, leaf = key.rpartition(".")
        named = re.search(rf"(?<![\w.]){re.escape(key)}(?![\w])", text)
        # model.overrides.dimm is reported as "model.overrides has unknown ... fields ['dimm']",
        # num_heads as "model.overrides.dim=64 is not divisible by num_heads=5"
        if named or (parent == "model.overrides" and parent in text and re.search(rf"\b{re.escape(leaf)}\b", text)):
            return f"--set {item.strip()}"
    return str(path) if path is not None else "config"


def save_config(cfg: TrainConfig, path: str | os.PathLike) -> None:
    """Write the resolved config as JSON, atomically (load it back with :func:`load_config`)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
