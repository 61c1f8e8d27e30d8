"""The config sections that say how a run runs, not what it trains: ``[runtime]`` (the run folder and the
process), ``[parallel]`` (how the model is wrapped), ``[profile]``, ``[log]``, ``[validation]`` and
``[sample]`` (what happens beside the steps). Each is a keyword-only frozen dataclass that checks its own
values; checks that span sections live in ``TrainConfig`` (:mod:`flexpack.run.config`), and so does the
table of the keys these sections once held under ``[runtime]`` (``RENAMED``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flexpack.run import bounds
from flexpack.run.bounds import check_count
from flexpack.run.config_parse import check_device_string

DTYPES = ("float32", "bfloat16")


def _at_least_zero(section: str, **values: int) -> None:
    for name, v in values.items():
        if v < 0:
            raise ValueError(f"{section}.{name} must be >= 0, got {v!r}")


@dataclass(frozen=True, kw_only=True)
class RuntimeConfig:
    # run folder: checkpoints/, metrics.jsonl, config.json (+ config_history.jsonl), tb/, profile/
    out_dir: str = "out/run"
    adopt_dir: bool = False  # add the run to an out_dir holding other files (never changing them); train --force
    device: str = "auto"  # auto: cuda:LOCAL_RANK when available, else cpu
    dtype: str = "float32"  # bfloat16: FSDP mixed precision (params bf16, reduce fp32) or autocast
    seed: int = 0  # seed of the model init and the noise draws
    # torch threads on a CPU device (flexpack.run.cpu_threads): N, or "auto": OMP_NUM_THREADS where set, else
    # 1 for a model under 10M parameters (its ops are too small for a thread pool), else one per core
    cpu_threads: int | str = "auto"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"runtime.dtype must be one of {DTYPES}, got {self.dtype!r}")
        check_device_string(self.device)  # whether CUDA is there is checked when training starts
        if not self.out_dir:
            raise ValueError("runtime.out_dir is empty: set it to the run folder")
        if self.cpu_threads != "auto" and not (type(self.cpu_threads) is int and self.cpu_threads >= 1):
            raise ValueError(f"runtime.cpu_threads must be \"auto\" or a thread count >= 1, got {self.cpu_threads!r}")


@dataclass(frozen=True, kw_only=True)
class ParallelConfig:
    """How the model is wrapped (flexpack.parallel): applied from outside, in this order: float8, compile,
    activation checkpointing, FSDP2 (when torchrun starts several ranks)."""

    activation_checkpointing: bool | int | str = False  # true: every block; n: the first n blocks; "selective": per op
    compile: bool | str = "auto"  # compile each block (fused step); auto: on CUDA in pack mode
    # compiled blocks only: the share of the activations their default partition saves that they may
    # keep; below 1 the partitioner recomputes the cheapest ops (by FLOPs) in the backward instead
    activation_memory_budget: float = 1.0
    float8: str = "off"  # "tensorwise" / "rowwise": float8 matmuls in the blocks (flexpack.parallel.float8; torchao)

    def __post_init__(self) -> None:
        if self.compile not in (True, False, "auto"):
            raise ValueError(f"parallel.compile must be true, false or 'auto', got {self.compile!r}")
        if isinstance(self.activation_checkpointing, str) and self.activation_checkpointing != "selective":
            raise ValueError("parallel.activation_checkpointing must be true, false, a block count >= 0 or "
                             f"'selective', got {self.activation_checkpointing!r}")
        from flexpack.parallel.float8 import check_mode

        check_mode(self.float8)
        if isinstance(self.activation_checkpointing, int) and self.activation_checkpointing < 0:
            raise ValueError(f"parallel.activation_checkpointing must be true, false or a block count >= 0, "
                             f"got {self.activation_checkpointing!r}")
        if not (isinstance(self.activation_memory_budget, (int, float))
                and 0.0 <= self.activation_memory_budget <= 1.0):
            raise ValueError(f"parallel.activation_memory_budget must be between 0 and 1 (1: save what the compiled "
                             f"blocks would), got {self.activation_memory_budget!r}")
        if self.compile is False:  # known at load time; "auto" is decided where the run starts (plan.parallel_options)
            from flexpack.parallel.parallelize import check_memory_budget

            check_memory_budget(self.activation_memory_budget, False, "parallel.activation_memory_budget",
                                ", but parallel.compile = false; set parallel.compile = true (or 'auto' on CUDA)")


@dataclass(frozen=True, kw_only=True)
class MemoryConfig:
    """A GPU memory budget the run plans itself (flexpack.run.memory_plan): activation checkpointing, optimizer
    states (8/4-bit) and an optimizer on the host, chosen as the fastest combination whose estimate fits; a
    lever set to a non-default value in the config is kept. One line at start says what was chosen."""

    budget_gb: float | str = 0  # GB of GPU memory per rank; "auto": the device's; 0: no plan (the config as set)

    def __post_init__(self) -> None:
        b = self.budget_gb
        if not (b == "auto" or (isinstance(b, (int, float)) and not isinstance(b, bool) and math.isfinite(b)
                                and b >= 0)):
            raise ValueError(f"memory.budget_gb must be 0 (no plan), 'auto' (the device's memory) or a number of "
                             f"GB, got {b!r}")


@dataclass(frozen=True, kw_only=True)
class ProfileConfig:
    """torch.profiler over a few steps (flexpack.training.observe.profiling), and the peak behind MFU."""

    steps: int = 0  # steps profiled by torch.profiler into RUN/profile/; 0 = off; LINGBOT_PROFILE wins if set
    warmup: int = 2  # steps run before the profiled ones (compilation); LINGBOT_PROFILE_WARMUP wins if set
    peak_tflops: float | None = None  # bf16 peak for `mfu` (metrics.jsonl, profile); None: measured at start (CUDA)
    # set by `flexpack train` at each start (not by hand): LINGBOT_PROFILE as read then, null = unset; wins over steps
    env_steps: int | None = None
    # set by `flexpack train` likewise: LINGBOT_PROFILE_WARMUP (read only when profiling); wins over warmup
    env_warmup: int | None = None

    def __post_init__(self) -> None:
        _at_least_zero("profile", steps=self.steps, warmup=self.warmup)
        _at_least_zero("profile", **{k: v for k, v in (("env_steps", self.env_steps),
                                                       ("env_warmup", self.env_warmup)) if v is not None})
        if self.peak_tflops is not None and not (self.peak_tflops > 0 and math.isfinite(self.peak_tflops)):
            raise ValueError(f"profile.peak_tflops must be a positive number, got {self.peak_tflops!r}")

    def window(self) -> tuple[int, int, str]:
        """(profiled steps, warm-up steps, where the steps came from): the variables ``flexpack train`` read
        (``env_steps`` / ``env_warmup``) win over ``steps`` / ``warmup``; no warm-up when nothing is profiled."""
        steps = self.steps if self.env_steps is None else self.env_steps
        warmup = self.warmup if self.env_warmup is None else self.env_warmup
        return steps, warmup if steps else 0, "profile.steps" if self.env_steps is None else "LINGBOT_PROFILE"


@dataclass(frozen=True, kw_only=True)
class LogConfig:
    """Where the metrics go (metrics.jsonl always) and what a person watching sees."""

    every: int = 1  # optimizer steps between metrics.jsonl lines and plain log lines (a terminal: >= 10)
    progress: bool = True  # a progress bar on rank 0 where stderr is a terminal (log lines print either way)
    tensorboard: bool = True  # event files under RUN/tb/ (flexpack.training.observe.tracking)
    wandb: bool = False  # also log to Weights & Biases (needs the wandb package; WANDB_MODE=offline works)
    wandb_project: str = "flexpack"  # W&B project of the run
    wandb_entity: str = ""  # "" = W&B's default entity (WANDB_ENTITY or the account's)
    wandb_tags: tuple[str, ...] = ()  # W&B tags of the run

    def __post_init__(self) -> None:
        if not (math.isfinite(self.every) and self.every > 0):
            raise ValueError(f"log.every must be positive, got {self.every!r}")


@dataclass(frozen=True, kw_only=True)
class ValidationConfig:
    every: int = 0  # steps between validation losses on the held-out episodes; 0 = none

    def __post_init__(self) -> None:
        _at_least_zero("validation", every=self.every)


@dataclass(frozen=True, kw_only=True)
class SampleConfig:
    """Sampling of held-out episodes during training (flexpack.sampling.hook): RUN/samples/step_N/ and
    sample/* metrics. The ranges are flexpack.run.bounds' (hours of sampling at most)."""

    every: int = 0  # steps between samplings; 0 = none (needs held-out episodes, like validation.every)
    steps: int = 10  # Euler steps from noise to data (1 to 10,000); lingbot-va: its model's own step counts
    episodes: int = 4  # the first N held-out episodes (1 to 100,000)
    cuts: int = 2  # forecast cut points per episode (1 to 1,000)
    horizon: int = 0  # latent frames predicted per cut (up to 10,000); 0 = two context chunks (at least 4)
    # episodes plotted per sampling; every sampled episode also gets a video (0 = metrics only; up to 1,000)
    plots: int = 2
    # forecasts per (episode, cut), each from its own noise, packed together: sample/*_kmean (MSE of their mean),
    # *_spread and *_crps; 1 keeps the cost of one (flexpack sample --samples defaults to 4; up to 1,000)
    draws: int = 1
    # latent frames of context a cut point needs: frame 0 alone is one video frame and shows no motion (up to 10,000)
    min_context: int = 2
    ema: bool = False  # sample with the EMA weights (needs optim.ema_decay > 0)

    def __post_init__(self) -> None:
        _at_least_zero("sample", every=self.every)
        for name, low, high in (("steps", 1, bounds.SOLVER_STEPS), ("episodes", 1, bounds.EPISODES),
                                ("cuts", 1, bounds.CUTS), ("horizon", 0, bounds.HORIZON),
                                ("plots", 0, bounds.PLOTS), ("draws", 1, bounds.SAMPLES),
                                ("min_context", 0, bounds.HORIZON)):
            check_count(f"sample.{name}", getattr(self, name), low, high)


LORA_BASE_DTYPES = ("bfloat16", "float32")


@dataclass(frozen=True, kw_only=True)
class LoraConfig:
    """LoRA fine-tuning through peft (:mod:`flexpack.run.lora`): low-rank adapters on the blocks' linear layers,
    the base weights frozen. Checks that need the model (targets that match nothing) run where the config loads."""

    rank: int = 0  # adapter rank r; 0 = off (every weight trains)
    alpha: float = 16.0  # scaling numerator: the adapters' output is scaled by alpha / rank
    dropout: float = 0.0  # dropout on the adapters' input (0 to < 1)
    # module-name patterns as peft's target_modules (a name, or its last dotted parts: "ffn.fc1"); empty = the
    # family's default, the attention projections and FFN linears of every transformer block
    targets: tuple[str, ...] = ()
    base_dtype: str = "bfloat16"  # dtype of the frozen base weights (the adapters stay float32)

    def __post_init__(self) -> None:
        if type(self.rank) is not int or self.rank < 0:
            raise ValueError(f"lora.rank must be an integer >= 0 (0 = off), got {self.rank!r}")
        if not (math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"lora.alpha must be a positive number, got {self.alpha!r}")
        if not (math.isfinite(self.dropout) and 0.0 <= self.dropout < 1.0):
            raise ValueError(f"lora.dropout must be in [0, 1), got {self.dropout!r}")
        if self.base_dtype not in LORA_BASE_DTYPES:
            raise ValueError(f"lora.base_dtype must be one of {LORA_BASE_DTYPES}, got {self.base_dtype!r}")
        bad = [t for t in self.targets if not isinstance(t, str) or not t.strip() or t != t.strip()]
        if bad:
            raise ValueError(f"lora.targets must be module names or dotted name endings, got {bad!r}")
        if len(set(self.targets)) != len(self.targets):
            raise ValueError(f"lora.targets lists a pattern twice: {list(self.targets)!r}")
