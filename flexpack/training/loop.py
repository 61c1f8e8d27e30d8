"""``flexpack train CONFIG``: the train loop, a plain function over a :class:`~flexpack.training.config.TrainConfig`.

Order of one optimizer step (nanoGPT's): lr → checkpoint → micro-steps → clip → step → log.

- Data: the run's plan (:mod:`flexpack.training.plan`: model config, token geometry, LatentEpisodeDataset,
  pack mode = TokenBudgetBatchSampler + PackCollate, pad mode = LengthBucketBatchSampler + PadCollate,
  forward options), made once and read by the step, meter, profiler and validation. The sampler is
  sharded by rank and resumes mid-epoch.
- Accumulation: ``optim.accum_steps`` micro-batches per step, each back-propagating
  ``FlowLoss.accumulation_loss(totals)`` with ``totals`` = Σ ``loss_counts`` over the step's
  micro-batches of all ranks, so a step equals one batch of all its episodes.
- Noise is drawn per episode from ``(runtime.seed, step, episode index)`` (:mod:`flexpack.training.flow.noise`):
  how episodes are batched never changes their x_t, and a resumed run draws what it would have.
- Multi-GPU: under ``torchrun`` with several ranks the model is FSDP2-sharded
  (:mod:`flexpack.training.parallel`); checkpoints (:mod:`flexpack.training.runstate.checkpoint`) are sharded (DCP) and
  resume on any number of ranks (:mod:`flexpack.training.runstate.resume`).
- The run folder has one owner, a metrics log cut back to the weights' step on resume and a config history
  (:mod:`flexpack.training.runstate.runfolder`); signals, data errors and non-finite steps end a run cleanly
  (:mod:`flexpack.training.runstate.faults`).
- One step (:func:`~flexpack.training.step.train_step`) queues its work without waiting for the GPU;
  on CUDA in pack mode each block is compiled once for all layers (``runtime.compile``). The host
  reads device values at logged steps only (loss, grad norm, throughput: :mod:`flexpack.training.observe.metrics`).
- ``runtime.profile_steps = n`` profiles n steps (:mod:`flexpack.training.observe.profiling`); metrics also go to
  TensorBoard / W&B (:mod:`flexpack.training.observe.tracking`).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from flexpack.packing.collate import Batch
from flexpack.sampling.hook import make_sample_hook
from flexpack.training import float8
from flexpack.training.build import build_data, build_model, materialize
from flexpack.training.checks import positive_int, preflight
from flexpack.training.config import ScheduleConfig, TrainConfig, load_config
from flexpack.training.ema import make_ema
from flexpack.training.observe import tracking
from flexpack.training.observe.metrics import StepMeter
from flexpack.training.observe.profiling import StepProfiler
from flexpack.training.optim import build_optimizer
from flexpack.training.parallel import parallelize, world
from flexpack.training.plan import Plan, parallel_options, use_compile  # noqa: F401  (use_compile: public here too)
from flexpack.training.runstate import checkpoint, faults, resume, runfolder
from flexpack.training.step import accumulate, train_step  # noqa: F401  (accumulate: public here too)
from flexpack.training.validation import make_validator


def lr_at(step: int, base_lr: float, sched: ScheduleConfig, resumed_at: int | None = None) -> float:
    """LR of optimizer step ``step`` (0-based): warmup, cosine/constant, re-warmup after a resume."""
    if step < sched.warmup_steps:
        lr = base_lr * (step + (0 if sched.warmup_from_zero else 1)) / sched.warmup_steps
    elif sched.decay == "constant":
        lr = base_lr
    else:
        progress = min(1.0, (step - sched.warmup_steps) / max(1, sched.steps - sched.warmup_steps))
        lr = base_lr * (sched.min_lr_ratio + (1 - sched.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
    s, n = (step - resumed_at if resumed_at is not None else -1), sched.rewarmup_steps  # s-th step after the resume
    if 0 <= s < n and sched.rewarmup_mode == "ramp":
        lr *= min(1.0, (s + 1) / n)
    elif 0 <= s < n:
        lr *= sched.rewarmup_from + (1 - sched.rewarmup_from) * s / n
    return lr


def _stream(loader: Any, sampler: Any) -> Iterator[tuple[Batch, dict]]:
    """Micro-batches forever, epoch after epoch, each with the sampler state right after it."""
    while True:
        epoch, pos = sampler.epoch, sampler.state_dict()["position"]
        for batch in loader:
            pos += 1  # count batches trained on, not drawn: loader workers prefetch
            yield batch, sampler.state_dict(position=pos)
        sampler.set_epoch(epoch + 1)


@dataclass
class TrainResult:
    step: int  # optimizer steps done (over all runs of this folder)
    start_step: int  # step this call started from (> 0 after a resume)
    lrs: list[float] = field(default_factory=list)  # per step of this call
    losses: list[float] = field(default_factory=list)  # per logged step
    episodes: list[list[int]] = field(default_factory=list)  # episode indices of each micro-batch (this rank)
    metrics: list[dict] = field(default_factory=list)
    checkpoint: Path | None = None
    model: nn.Module | None = None  # the trained model (FSDP-sharded under torchrun)


def train(cfg: TrainConfig, *, stop_after: int | None = None, data: Plan | None = None) -> TrainResult:
    """Train ``cfg.schedule.steps`` optimizer steps (resuming from the run folder's newest checkpoint);
    ``stop_after`` ends early after that step, with a checkpoint, as an interruption would; ``data``:
    a :class:`~flexpack.training.plan.Plan` replacing what ``cfg.data`` describes (in-memory episodes,
    :func:`flexpack.training.memory_data.synthetic_data`, e.g. ``benchmarks/profile_step.py``).
    Faults (:mod:`flexpack.training.runstate.faults`): a signal saves and raises ``Interrupted``, a non-finite
    step raises ``NonFiniteError`` (or is skipped), a data error on any rank saves the steps done and re-raises."""
    rank, size = world()
    if rank == 0:
        tracking.check(cfg)  # a missing logger package fails before any data or model work
    device = preflight(cfg, stop_after)  # device, run folder, finite numbers: before data and model
    float8.check(cfg.runtime.float8, device)  # torchao and an sm89+ GPU, before data and model
    found = resume.find(cfg, rank)
    if found is not None and resume.step_of(found) >= cfg.schedule.steps:  # nothing to do: touch nothing
        done = resume.step_of(found)
        if rank == 0:
            print(f"{cfg.runtime.out_dir}: already at step {done} of schedule.steps={cfg.schedule.steps}; "
                  "nothing to train (raise schedule.steps to continue)", file=sys.stderr)
        return TrainResult(step=done, start_step=done, checkpoint=found)
    with runfolder.RunLock(cfg.runtime.out_dir, active=rank == 0), faults.GracefulStop() as stop:
        _barrier()  # the other ranks wait for rank 0's lock (a refusal ends torchrun through rank 0)
        return _train(cfg, found, stop, stop_after, device, data)


def _train(cfg: TrainConfig, found: Path | None, stop: faults.GracefulStop, stop_after: int | None,
           device: torch.device, data: Plan | None) -> TrainResult:
    rank, size = world()
    data = build_data(cfg, rank, size) if data is None else data
    float8.check_tokens(cfg.runtime.float8, cfg.data, data.geometry, device)  # before the model is built
    with device:  # built where it runs: no full fp32 copy of a 5B model in host memory per rank
        model = build_model(cfg, data.model)
    model = parallelize(model, device=device, **parallel_options(cfg, device).kwargs())
    materialize(model, cfg, device, data.model)  # model.pretrained under FSDP2: each rank loads its shards
    o, run = cfg.optim, Path(cfg.runtime.out_dir)
    opt = build_optimizer(model, o, log=rank == 0, fused=device.type == "cuda")  # no decay on norms, biases, ...
    ema = make_ema(model, o.ema_decay)
    validator = make_validator(cfg, device, data.model)  # None unless runtime.eval_every
    start, resumed_at = 0, None
    if found is not None:
        start = resumed_at = int(resume.restore(found, cfg, model, opt, data, rank, ema=ema)["step"])
    if rank == 0:
        _prepare_run(run, cfg, start, size)
    loader = torch.utils.data.DataLoader(data.dataset, batch_sampler=data.sampler, collate_fn=data.collate,
                                         num_workers=cfg.data.num_workers, pin_memory=device.type == "cuda")
    stream = _stream(loader, data.sampler)
    end = cfg.schedule.steps if stop_after is None else min(stop_after, cfg.schedule.steps)
    result = TrainResult(step=start, start_step=start, checkpoint=found, model=model)
    sampler_state, step, tpf, signum = data.sampler.state_dict(), start, data.tokens_per_frame, 0
    saver = checkpoint.Checkpointer(run / "checkpoints", keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
    extra = {"action_normalizer": resume.normalizer_state(data.dataset)}
    sampler_hook = make_sample_hook(cfg, device, normalizer=extra["action_normalizer"], rank=rank,
                                    dataset_normalizer=getattr(data.dataset, "normalizer", None))

    guard, meter = (faults.StepGuard(stop, o.skip_nonfinite),
                    StepMeter(cfg, device, model=data.model, geometry=data.geometry))

    def save() -> Path:
        guard.flush()  # never the weights of a non-finite step
        return saver.save(step, model, opt, sampler_state=sampler_state, extra=extra, config=cfg.to_dict(), ema=ema)

    bar = tqdm(total=cfg.schedule.steps, initial=start, desc="train", unit="step",
               disable=rank != 0 or not cfg.runtime.progress)
    with (StepProfiler.for_training(cfg, rank, steps_left=end - step, first_step=step, plan=data,
                                    device=device) as prof,
          tracking.MetricSinks(run, cfg, rank=rank, start_step=start) as sinks, _QuietGC() as gc_pause):
        while step < end and not signum:
            gc_pause.step(step)
            prof.step()
            lr = lr_at(step, o.lr, cfg.schedule, resumed_at)
            for group in opt.param_groups:
                group["lr"] = lr
            if step > start and cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                result.checkpoint = save()
            prof.phase("data")
            try:
                micro, error = [next(stream) for _ in range(o.accum_steps)], None
            except Exception as exc:
                micro, error = [], exc
            if faults.any_rank_failed(error):  # keep the steps done: every rank saves, then all stop
                if step > start:
                    result.checkpoint = save()
                    saver.wait()
                    if rank == 0:
                        print(f"saved step {step} in {result.checkpoint} before the error below", file=sys.stderr)
                raise error or faults.PeerDataError(step + 1)
            batches, sampler_state = [b for b, _ in micro], micro[-1][1]
            # the plan's forward options: one text-key shape for the run, no recompiles per episode count
            sums, norm = train_step(model, opt, batches, cfg, step=step, device=device, forward=data.forward,
                                    prof=prof, guard=guard, ema=ema)
            signum, nonfinite = guard.signum, guard.skipped
            meter.add(batches)
            step += 1
            bar.update(1)
            result.lrs.append(lr)
            result.episodes += [b.layout.episode_index.tolist() for b in batches]
            if step % cfg.runtime.log_every == 0 or step == end or nonfinite:
                guard.flush()
                rec = _log(run, rank, step, lr, sums, norm, batches, tpf, meter,
                           extra={"skipped": True} if nonfinite else None)
                result.losses.append(rec["loss"])
                result.metrics.append(rec)
                sinks.log(rec)
                bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{lr:.2e}", tok_s=f"{rec['tokens_per_s']:.0f}")
            if validator is not None and (val := validator.after_step(model, step)) is not None:
                sinks.log(val)
            if sampler_hook is not None:
                sampler_hook.after_step(model, step, sinks, ema=ema)
    bar.close()
    result.step = step
    guard.flush()
    if step > start:
        result.checkpoint = save()
    saver.wait()
    if signum:
        raise faults.Interrupted(signum, step, result.checkpoint if step > start else None)
    return result


class _QuietGC:
    """Python's cyclic collector off during the loop, run explicitly every ``every`` steps: its
    automatic generation-2 passes walk every live object (the autograd graph, the loader's
    batches) and stall the host at an arbitrary point of a step, where the GPU then waits for it."""

    def __init__(self, every: int = 50) -> None:
        self.every, self.was = every, gc.isenabled()

    def __enter__(self) -> "_QuietGC":
        gc.disable()
        return self

    def step(self, step: int) -> None:
        if step % self.every == 0:  # young generations (quick: a step's garbage lands there); all now and then
            gc.collect(2 if step % (20 * self.every) == 0 else 1)

    def __exit__(self, *exc: Any) -> None:
        if self.was:
            gc.enable()


def _barrier() -> None:
    if world()[1] > 1:
        dist.barrier()


def _prepare_run(run: Path, cfg: TrainConfig, start: int, size: int) -> None:
    """Rank 0, before the first step: clear interrupted saves, cut metrics.jsonl back to ``start``
    (the weights' step), record this start in the config history (:mod:`flexpack.training.runstate.runfolder`)."""
    runfolder.mark(run)
    for tmp in checkpoint.remove_temporary(run / "checkpoints"):
        why = "an interrupted save" if tmp.name.startswith((".tmp-", ".old-")) else "an interrupted pruning"
        print(f"removed {tmp} ({why})", file=sys.stderr)
    if dropped := runfolder.cut_metrics(run, start):
        print(f"{run}/metrics.jsonl: removed {dropped} line(s) after step {start} (steps of a run that was "
              "stopped before checkpointing them)", file=sys.stderr)
    changed = runfolder.record_start(run, cfg.to_dict(), start_step=start, world_size=size)
    if changed and start > 0:
        print(f"resuming at step {start} with changed config: "
              + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())
              + f" (recorded in {run}/config_history.jsonl)", file=sys.stderr)


def _log(run: Path, rank: int, step: int, lr: float, sums: torch.Tensor, norm: torch.Tensor,
         batches: Sequence[Batch], tpf: int, meter: StepMeter, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Global loss parts, LR, grad norm, waste of this step, and the throughput of the steps since
    the last log (tokens/s, step time, peak memory, MFU); rank 0 appends metrics.jsonl. One of the
    few points where the host waits for the GPU."""
    valid = sum(int(b.layout.episode_frames.sum()) for b in batches) * tpf
    computed = sum(b.layout.frame_doc.numel() for b in batches) * tpf
    stats = torch.cat([sums.float().cpu(), torch.tensor([valid, computed], dtype=torch.float32)])
    if world()[1] > 1:
        dist.all_reduce(stats)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor under FSDP
    rec = {"step": step, "loss": float(stats[0]), "latent_loss": float(stats[1]), "action_loss": float(stats[2]),
           "lr": lr, "grad_norm": float(norm), "waste": 1.0 - float(stats[3]) / float(stats[4]), **meter.read(),
           **(extra or {})}
    if rank == 0:
        run.mkdir(parents=True, exist_ok=True)
        with open(run / "metrics.jsonl", "a") as f:  # an append-only log: one line per logged step
            f.write(json.dumps(rec) + "\n")
    return rec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="TOML or JSON config (configs/tiny_cpu.toml, ...)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set schedule.steps=40 (repeatable)")
    parser.add_argument("--stop-after", type=positive_int, default=None,
                        help="stop (with a checkpoint) after this step")
    parser.add_argument("--force", action="store_true",
                        help="train into an out_dir that holds other files (runtime.adopt_dir = true); none is changed")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, [*args.overrides, *(["runtime.adopt_dir=true"] if args.force else [])])
    started, rank = False, int(os.environ.get("RANK", "0"))
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
        started = True
    try:
        result = train(cfg, stop_after=args.stop_after)
    except faults.Interrupted as exc:
        if rank == 0:
            print(f"flexpack train: {exc}", file=sys.stderr)
        return exc.exit_code
    finally:
        if started:
            dist.destroy_process_group()
    if rank == 0 and result.step > result.start_step:  # (a finished run has said so already)
        last = result.metrics[-1] if result.metrics else {}
        print(f"trained steps {result.start_step} -> {result.step}; loss {last.get('loss', float('nan')):.4f}; "
              f"checkpoint {result.checkpoint}")
        print(tracking.outputs(cfg.runtime.out_dir, result.checkpoint, cfg))
    return 0
