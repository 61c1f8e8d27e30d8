"""``memory.budget_gb``: the run plans its own memory before any weights load.

Given a budget (GB of GPU memory, or ``"auto"``: the device's), the planner estimates the peak of every
combination of the three memory levers and picks the one with the shortest estimated step that fits:

- ``parallel.activation_checkpointing``: 0 to all blocks checkpointed (each costs one more forward of the block);
- ``optim.states``: AdamW states in ``float32``, ``8bit`` or ``4bit`` (torchao);
- ``optim.offload``: ``none``, ``optimizer`` (states and update on the host) or ``optimizer+gradients``
  (gradients leave the GPU during the backward; only without gradient accumulation, and only on CUDA). On one
  GPU that is torchao's ``CPUOffloadOptimizer`` (no clipping); under FSDP2 only ``optimizer+gradients``, as
  FSDP2's ``CPUOffloadPolicy``: the parameter shards live on the host too, one gathered block at a time on the
  GPU, and clipping stays.

A lever the config sets to a value other than its default is kept as set: the planner chooses the others.
``parallel.float8`` and LoRA (``lora.rank``) are the user's choices; the plan counts them. The run then
prints one line (``budget 48 GB: float8, checkpointing all 30 blocks, AdamW 8-bit states, optimizer on the
host: est. 44 GB``); a budget nothing reaches is one line naming the least it would take.

Estimates (``estimate``): weights, gradients and optimizer states from the model's parameter count (built on
the meta device: no memory, no weights read), sharded over the ranks; activations from the tokens of one
micro-batch (``data.max_tokens`` × copies) and the block shape, with per-token costs fitted to the H200's
measured peaks (:data:`COSTS`); the peak is the larger of the forward's end and the backward's; a share of the
budget is left for the allocator's reserve. The step time is
relative: the blocks' compute, their recomputation, and the optimizer's update (on the host: the host's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from flexpack.run.config import TrainConfig
    from flexpack.run.root import Run

STATES = ("float32", "8bit", "4bit")
OFFLOADS = ("none", "optimizer", "optimizer+gradients")
GB = 1e9


@dataclass(frozen=True)
class Costs:
    """Per-token activation bytes and optimizer costs, fitted to the H200's peaks of the 30-block LingBot-VA-5B step
    at 65 536 tokens under float8 (``benchmarks/results/memory_budget_h200.json``, ``memory_budget_refit_h200.json``,
    ``memory_lora_h200.json``; ``tests/test_memory_plan.py`` holds them): 93.2 GB with AdamW and every block
    checkpointed, 63.7 GB with 8-bit states and 28, 112.0 GB with 8-bit states and 22, 45.3 GB with the optimizer
    and gradients on the host and 30 (the estimates: 93.1, 63.3, 113.5, 44.8); out of memory at 130 GB with 8-bit
    states and 19 blocks, at 48 GB on the host with 28, and with LoRA rank 32 at 24 GB with 32 688 tokens (the
    estimates: 138.6, 53.0, 24.5). ``recompute`` from WanVA-5B's step times (24 blocks 4.9 % faster than 30); the
    optimizer's update times are estimates until ``benchmarks/memory_budget.py --stage calibrate`` measures them.
    Under gradient accumulation (``memory_mfu_h200.json``: 8,136 tokens a copy in four micro-batches, 116.2 GB with
    8-bit states and no block checkpointed, 87.7 GB with AdamW and every block) the estimates are 8.5 and 9.8 %
    above the peaks.

    ``kept_per_dim``: bytes per token and model dimension a checkpointed block keeps (its input);
    ``block_per_dim`` / ``block_per_ffn``: bytes per token, per model dimension and per FFN dimension, a block
    keeps when not checkpointed, and one checkpointed block holds while the backward recomputes it (bf16
    autocast; float8 matmuls keep ``float8_share`` of it);
    ``adapter_input_bytes``: bytes per token and adapted input feature of a LoRA adapter: its float32 input kept
    (peft casts the input to the adapters' dtype) and, in the backward, that input's float32 gradient beside it;
    fitted to the 24 GB LoRA runs on an H100 (``memory_lora24_h100.json``: 20.8 and 19.2 GB at 9,504 and 7,920
    tokens a copy, estimated 21.5 and 20.0; out of memory at 12,672, estimated 24.4);
    ``cast_bytes``: bytes per float32-stored parameter of its low-precision copies during the step;
    ``recompute``: the share of a step one more forward of every block adds;
    ``update_s_per_gparam``: seconds per 10⁹ trained parameters of the update, per states and offload;
    ``fixed_gb``: buffers outside the blocks; ``margin``: multiplicative slack; ``headroom``: the share of a
    budget a plan leaves free above the peak allocation (the 48 GB run peaked at 45.3 GB allocated, 47.7 GB
    reserved: the allocator returns its cache before it gives up under a cap)."""

    kept_per_dim: float = 0.7
    block_per_dim: float = 35.7
    block_per_ffn: float = 3.0
    float8_share: float = 0.85
    recompute: float = 0.25
    update_s_per_gparam: tuple[tuple[str, float], ...] = (
        ("float32", 0.004), ("8bit", 0.012), ("4bit", 0.016),
        ("optimizer", 0.45), ("optimizer+gradients", 0.5))
    fixed_gb: float = 1.5
    cast_bytes: float = 2.0
    adapter_input_bytes: float = 6.5
    margin: float = 1.0
    headroom: float = 0.06
    # fewer bits in AdamW's states only where the step gets this much faster (their updates are coarser)
    states_preference: tuple[tuple[str, float], ...] = (("float32", 0.0), ("8bit", 0.01), ("4bit", 0.03))

    def update_s(self, key: str) -> float:
        return dict(self.update_s_per_gparam)[key]

    def states_penalty(self, states: str) -> float:
        return dict(self.states_preference)[states]


COSTS = Costs()


@dataclass(frozen=True)
class Shape:
    """What the estimate needs of a model and a run."""

    params: int  # every parameter
    trained: int  # parameters with gradients and optimizer states (all, or the LoRA weights)
    frozen_bytes: int  # bytes per frozen parameter (LoRA's base weights; 4 without LoRA)
    layers: int
    dim: int
    ffn_dim: int
    tokens: int  # computed tokens of one micro-batch (every copy)
    act_bytes: int  # 2 under bf16 autocast or FSDP bf16, else 4
    float8: bool
    world_size: int = 1
    accum_steps: int = 1
    tokens_per_step: int = 0  # computed tokens of one optimizer step (all ranks)
    adapter_inputs: int = 0  # LoRA: input features of a block's adapted linears (each adapter keeps its input)
    flops_per_s: float = 4e14  # what the blocks reach (for the update's share of the step)


@dataclass(frozen=True)
class Choice:
    checkpointed: int  # blocks checkpointed
    states: str
    offload: str


@dataclass(frozen=True)
class Estimate:
    choice: Choice
    gpu_gb: float
    host_gb: float
    step_s: float
    parts: dict[str, float]


def optimizer_bytes(states: str, offload: str) -> tuple[float, float, float]:
    """(GPU gradient, GPU state, host) bytes per trained parameter (the fp32 weights on the GPU not counted)."""
    per_state = {"float32": 8.0, "8bit": 2.0 + 2.0 * 4 / 256, "4bit": 1.0 + 2.0 * 4 / 128}[states]
    if offload == "none":
        return 4.0, per_state, 0.0
    # torchao's CPUOffloadOptimizer: fp32 weights, gradients and states on the host (pinned)
    return (0.0 if offload == "optimizer+gradients" else 4.0), 0.0, 4.0 + 4.0 + per_state


def estimate(shape: Shape, choice: Choice, costs: Costs = COSTS) -> Estimate:
    """The peak GPU memory (GB), host memory (GB) and relative step time of ``choice`` on ``shape``.

    Two moments bound the peak: the end of the forward (the activations, no gradients yet) and the end of the
    backward (every gradient, the activations freed); weights, optimizer states and the weights' bf16 casts are
    there at both. Under gradient accumulation every micro-batch after the first runs its forward and backward
    beside the gradients accumulated so far."""
    n, s = shape.world_size, shape
    grad_b, state_b, host_b = optimizer_bytes(choice.states, choice.offload)
    frozen = s.params - s.trained
    weights = (4.0 * s.trained + s.frozen_bytes * frozen) / n
    casts = costs.cast_bytes * (s.trained + (frozen if s.frozen_bytes == 4 else 0)) / n
    if n > 1 and choice.offload != "none":  # FSDP2's CPUOffloadPolicy: the shards themselves on the host
        weights, casts = 0.0, 0.0
    if n > 1:  # FSDP2: one block gathered (bf16) beside the shards, the next prefetched
        weights += 2 * 2.0 * (s.params / max(s.layers, 1)) * (s.act_bytes / 2)
    states = state_b * s.trained / n
    grads = grad_b * s.trained / n
    if choice.offload == "optimizer+gradients":  # one block's gradients at a time on their way out
        grads = 4.0 * s.trained / max(s.layers, 1)
    full = s.tokens * (costs.block_per_dim * s.dim + costs.block_per_ffn * s.ffn_dim) * s.act_bytes / 2
    if s.float8:
        full *= costs.float8_share
    full += s.tokens * s.adapter_inputs * costs.adapter_input_bytes
    kept = s.tokens * costs.kept_per_dim * s.dim * s.act_bytes / 2
    c, layers = choice.checkpointed, max(s.layers, 1)
    acts = c * kept + (s.layers - c) * full
    # the backward reaches the checkpointed blocks with every kept input, the gradients of the blocks after them
    # and one block's activations recomputed
    held = c * kept + full if c else 0.0
    recomputing = held + grads * (s.layers - c) / layers if c else 0.0
    parts = {"weights": weights / GB, "optimizer": states / GB, "gradients": grads / GB, "casts": casts / GB,
             "activations": max(acts, recomputing) / GB, "fixed": costs.fixed_gb}
    if s.accum_steps > 1:  # the gradients of the earlier micro-batches stay beside every later one's activations
        resident = grads + max(acts, held)
    else:
        resident = max(grads, acts, recomputing)
    gpu = (weights + states + casts + resident) / GB * costs.margin + costs.fixed_gb
    compute = 6.0 * s.params * max(s.tokens_per_step, s.tokens) / max(n, 1) / s.flops_per_s
    update_key = choice.states if choice.offload == "none" else choice.offload
    step = compute * (1 + costs.recompute * c / max(s.layers, 1)) + costs.update_s(update_key) * s.trained / GB / n
    return Estimate(choice, gpu, host_b * s.trained / n / GB, step, parts)


def choices(cfg: TrainConfig, layers: int, cuda: bool, world_size: int = 1) -> list[Choice]:
    """Every combination the planner may pick: the levers the config leaves at their defaults vary. The
    optimizer goes to the host only where it runs there: on one CUDA GPU torchao's CPUOffloadOptimizer, without
    clipping; under FSDP2 on CUDA its CPUOffloadPolicy (``optimizer+gradients``), without accumulation."""
    ac = cfg.parallel.activation_checkpointing
    if ac is False:
        blocks = range(layers + 1)
    elif ac is True:
        blocks = [layers]
    elif isinstance(ac, int):
        blocks = [min(ac, layers)]
    else:  # "selective": per-op, not a block count; planned as half the blocks' activations
        blocks = [layers // 2]
    states = STATES if _states(cfg) == "float32" else (_states(cfg),)
    if _offload(cfg) != "none":
        offloads: tuple[str, ...] = (_offload(cfg),)
    elif not cuda:
        offloads = ("none",)
    elif world_size > 1:
        offloads = ("none", "optimizer+gradients") if cfg.optim.accum_steps == 1 else ("none",)
    elif cfg.optim.grad_clip > 0:
        offloads = ("none",)
    else:
        offloads = OFFLOADS if cfg.optim.accum_steps == 1 else OFFLOADS[:2]
    return [Choice(b, st, off) for off in offloads for st in states for b in blocks]


def _states(cfg: TrainConfig) -> str:
    return getattr(cfg.optim, "states", "float32")


def _offload(cfg: TrainConfig) -> str:
    return getattr(cfg.optim, "offload", "none")


@dataclass(frozen=True)
class Plan:
    budget_gb: float
    best: Estimate
    config: Any  # the TrainConfig with the chosen levers

    def line(self, float8: str, layers: int, lora: int = 0) -> str:
        c = self.best.choice
        ck = ("no checkpointing" if c.checkpointed == 0 else
              f"checkpointing all {layers} blocks" if c.checkpointed == layers else
              f"checkpointing {c.checkpointed} of {layers} blocks")
        parts = [("float8" if float8 != "off" else "bf16"), ck]
        if lora:
            parts.append(f"LoRA rank {lora}")
        parts.append({"float32": "AdamW", "8bit": "AdamW 8-bit states", "4bit": "AdamW 4-bit states"}[c.states])
        if c.offload != "none":
            parts.append("optimizer on the host" + (" with the gradients" if "gradients" in c.offload else ""))
        host = f", host {self.best.host_gb:.0f} GB" if self.best.host_gb else ""
        return f"budget {self.budget_gb:.3g} GB: {', '.join(parts)}: est. {self.best.gpu_gb:.0f} GB{host}"


def budget_gb(cfg: TrainConfig, device: torch.device) -> float | None:
    """The budget in GB (``"auto"``: the device's total memory), or None when the run plans nothing."""
    b = cfg.memory.budget_gb
    if b == 0:
        return None
    if b != "auto":
        return float(b)
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory / GB
    import os

    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB


def host_gb() -> float:
    """The memory this host has available now (GB; what an optimizer on the host may take)."""
    try:
        with open("/proc/meminfo") as f:
            info = dict(line.split(":", 1) for line in f)
        return int(info["MemAvailable"].split()[0]) * 1024 / GB
    except (OSError, KeyError, ValueError):
        import os

        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB


def shape_of(run: Run, *, flops_per_s: float | None = None) -> Shape:
    """The :class:`Shape` of ``run``'s model and micro-batches (the model built on the meta device)."""
    cfg = run.config
    with torch.device("meta"):
        model = run.family.build(run.model_config)
    params = sum(p.numel() for p in model.parameters())
    layers = len(run.family.block_list(model))
    trained, frozen_bytes, adapter_inputs = params, 4, 0
    lora = getattr(cfg, "lora", None)
    if lora is not None and lora.rank:
        adapted = lora_linears(model, run)
        trained = sum(lora.rank * (m.in_features + m.out_features) for m in adapted)
        adapter_inputs = sum(m.in_features for m in adapted) // max(layers, 1)
        frozen_bytes = 2 if lora.base_dtype == "bfloat16" else 4
    tokens = (cfg.data.max_tokens * run.geometry.copies if cfg.data.mode == "pack"
              else cfg.data.batch_size * run.geometry.computed_tokens(max(run.dataset.lengths())))
    bf16 = cfg.runtime.dtype == "bfloat16"
    return Shape(params=params, trained=trained, frozen_bytes=frozen_bytes, layers=layers,
                 dim=int(run.model_config.dim), ffn_dim=int(run.model_config.ffn_dim), tokens=tokens,
                 act_bytes=2 if bf16 else 4, float8=cfg.parallel.float8 != "off", world_size=run.world_size,
                 accum_steps=cfg.optim.accum_steps, tokens_per_step=tokens * cfg.optim.accum_steps * run.world_size,
                 flops_per_s=flops_per_s or 4e14, adapter_inputs=adapter_inputs)


def lora_linears(model: torch.nn.Module, run: Run) -> list[torch.nn.Linear]:
    """The Linear layers LoRA's targets name (peft's suffix match)."""
    targets = tuple(run.config.lora.targets) or tuple(getattr(run.family, "lora_targets", ()) or ())
    return [mod for name, mod in model.named_modules()
            if isinstance(mod, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)]



class BudgetError(ValueError):
    """A memory budget no combination of the levers reaches."""


def plan(cfg: TrainConfig, shape: Shape, budget: float, *, cuda: bool, host_available: float | None = None,
         costs: Costs = COSTS) -> Plan:
    """The fastest :class:`Choice` whose estimate fits ``budget`` GB (and the host's memory), with ``cfg``
    set to it; :class:`BudgetError` naming the least any choice needs when none fits."""
    options = [estimate(shape, c, costs) for c in choices(cfg, shape.layers, cuda, shape.world_size)]
    host_ok = [e for e in options if host_available is None or e.host_gb <= 0.9 * host_available]
    fits = [e for e in host_ok if e.gpu_gb <= budget * (1 - costs.headroom)]
    if not fits:
        least = min(host_ok or options, key=lambda e: e.gpu_gb)
        hint = "" if getattr(getattr(cfg, "lora", None), "rank", 0) else "; LoRA (lora.rank) trains far fewer"
        most = _most_tokens(cfg, shape, budget, cuda, host_available, costs)
        lower = (f"lower data.max_tokens (to {most} it fits; longer episodes then need data.crop = true)" if most
                 else "lower data.max_tokens")
        raise BudgetError(
            f"memory.budget_gb = {budget:g}: no combination of checkpointing, optimizer states and offload fits; "
            f"the least is {least.gpu_gb:.0f} GB ({describe(least.choice, shape.layers)}) for data.max_tokens = "
            f"{cfg.data.max_tokens}: raise the budget or {lower}{hint}"
            f"{_unclipped_hint(cfg, shape, budget, cuda, host_available, costs)}")
    best = min(fits, key=lambda e: (e.step_s * (1 + costs.states_penalty(e.choice.states)), e.gpu_gb))
    return Plan(budget, best, configured(cfg, best.choice, shape.layers))


def _most_tokens(cfg: TrainConfig, shape: Shape, budget: float, cuda: bool, host_available: float | None,
                 costs: Costs) -> int | None:
    """The largest ``data.max_tokens`` (a multiple of 16, as float8 takes) some choice fits ``budget`` with, in pack
    mode; None where none does (or in pad mode, which ``data.batch_size`` sizes)."""
    if cfg.data.mode != "pack" or cfg.data.max_tokens < 16:
        return None
    copies = shape.tokens / cfg.data.max_tokens
    options = choices(cfg, shape.layers, cuda, shape.world_size)

    def fits(per_copy: int) -> bool:
        s = replace(shape, tokens=int(per_copy * copies), tokens_per_step=int(per_copy * copies) * shape.accum_steps)
        return any(e.gpu_gb <= budget * (1 - costs.headroom)
                   and (host_available is None or e.host_gb <= 0.9 * host_available)
                   for e in (estimate(s, c, costs) for c in options))

    lo, hi = 0, cfg.data.max_tokens // 16  # fits(16 lo) holds, fits(16 hi) does not (the budget refused it)
    if not fits(16):
        return None
    lo = 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(16 * mid) else (lo, mid)
    return 16 * lo


def _unclipped_hint(cfg: TrainConfig, shape: Shape, budget: float, cuda: bool, host_available: float | None,
                    costs: Costs) -> str:
    """What the optimizer on the host would reach were clipping off (it cannot clip), where that is the way."""
    if not cuda or shape.world_size > 1 or cfg.optim.grad_clip <= 0 or _offload(cfg) != "none":
        return ""
    unclipped = replace(cfg, optim=replace(cfg.optim, grad_clip=0.0))
    try:
        p = plan(unclipped, shape, budget, cuda=cuda, host_available=host_available, costs=costs)
    except BudgetError:
        return ""
    return (f"; with optim.grad_clip = 0 (now {cfg.optim.grad_clip:g}) the optimizer can go to the host: "
            f"{describe(p.best.choice, shape.layers)}, est. {p.best.gpu_gb:.0f} GB")


def describe(choice: Choice, layers: int) -> str:
    return (f"{choice.checkpointed} of {layers} blocks checkpointed, optim.states = {choice.states}, "
            f"optim.offload = {choice.offload}")


def configured(cfg: TrainConfig, choice: Choice, layers: int) -> TrainConfig:
    """``cfg`` with the levers of ``choice`` set (an all-blocks choice as ``true``)."""
    ac: bool | int | str = cfg.parallel.activation_checkpointing
    if not isinstance(ac, str):
        ac = True if choice.checkpointed == layers else (choice.checkpointed or False)
    optim = cfg.optim
    if any(f.name == "states" for f in dataclasses.fields(optim)):
        optim = replace(optim, states=choice.states, offload=choice.offload)
    return replace(cfg, parallel=replace(cfg.parallel, activation_checkpointing=ac), optim=optim)


def apply(run: Run, *, say: bool = True, flops_per_s: float | None = None) -> Run:
    """``run`` with its memory levers planned (``memory.budget_gb``), the plan's line printed; unchanged
    without a budget. Raises :class:`BudgetError` (one line) when nothing fits — before any weights load."""
    budget = budget_gb(run.config, run.device)
    if budget is None:
        return run
    shape = shape_of(run, flops_per_s=flops_per_s)
    p = plan(run.config, shape, budget, cuda=run.device.type == "cuda", host_available=host_gb())
    if say and run.rank == 0:
        lora = getattr(getattr(run.config, "lora", None), "rank", 0)
        print(p.line(run.config.parallel.float8, shape.layers, lora), flush=True)
    return replace(run, config=p.config)
