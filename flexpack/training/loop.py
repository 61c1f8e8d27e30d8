"""``flexpack train CONFIG``: the train loop, a plain function over a :class:`~flexpack.training.config.TrainConfig`.

Order of one optimizer step (nanoGPT's): lr → checkpoint → micro-steps → clip → step → log.

- Data: LatentEpisodeDataset; pack mode = TokenBudgetBatchSampler + PackCollate, pad mode =
  LengthBucketBatchSampler + PadCollate. The sampler is sharded by rank and resumes mid-epoch.
- Accumulation: ``optim.accum_steps`` micro-batches per step, each back-propagating
  ``FlowLoss.accumulation_loss(totals)`` with ``totals`` = Σ ``loss_counts`` over the step's
  micro-batches of all ranks, so a step equals one batch of all its episodes.
- Noise is drawn per episode from ``(runtime.seed, step, episode index)`` (:mod:`flexpack.training.noise`):
  how episodes are batched never changes their x_t, and a resumed run draws what it would have.
- Multi-GPU: under ``torchrun`` with several ranks the model is FSDP2-sharded
  (:mod:`flexpack.training.parallel`); checkpoints (:mod:`flexpack.training.checkpoint`) are sharded (DCP) and
  resume on any number of ranks (:mod:`flexpack.training.resume`).
- The run folder has one owner, a metrics log cut back to the weights' step on resume and a config history
  (:mod:`flexpack.training.runfolder`); signals, data errors and non-finite steps end a run cleanly
  (:mod:`flexpack.training.faults`).
- ``LINGBOT_PROFILE=n`` profiles n steps (:mod:`flexpack.training.profiling`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn
from tqdm import tqdm

from flexpack.training import checkpoint, faults, resume, runfolder
from flexpack.training.build import build_data, build_model, model_kwargs, noise_seeds
from flexpack.packing.collate import Batch
from flexpack.training.config import ScheduleConfig, TrainConfig, load_config
from flexpack.training.noise import episode_flow_sample
from flexpack.training.objective import flow_loss, loss_counts
from flexpack.training.parallel import is_sharded, parallelize, world
from flexpack.training.profiling import StepProfiler


def lr_at(step: int, base_lr: float, sched: ScheduleConfig, resumed_at: int | None = None) -> float:
    """LR of optimizer step ``step`` (0-based): warmup, cosine/constant, re-warmup after a resume."""
    if step < sched.warmup_steps:
        lr = base_lr * (step + 1) / sched.warmup_steps
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


def accumulate(model: nn.Module, batches: Sequence[Batch], cfg: TrainConfig, *, step: int, device: torch.device) -> torch.Tensor:
    """Forward + backward one optimizer step's micro-batches; returns this rank's (loss, latent, action)
    shares, detached (summed over ranks they are the step's loss and its parts)."""
    _, size = world()
    counts = torch.tensor([[float(c) for c in loss_counts(b)] for b in batches]).sum(0)
    if size > 1:
        dist.all_reduce(counts)  # the objective is over every rank's episodes
    totals = (float(counts[0]), float(counts[1]))
    sharded = is_sharded(model)
    bf16 = cfg.runtime.dtype == "bfloat16" and not sharded  # under FSDP its mixed precision casts instead
    out = torch.zeros(3)
    for i, batch in enumerate(batches):
        if sharded:  # reduce-scatter gradients once per step, not per micro-batch
            model.set_requires_gradient_sync(i == len(batches) - 1)
        batch = batch.to(device, non_blocking=True)
        sample = episode_flow_sample(batch, cfg.objective, noise_seeds(batch, cfg.runtime.seed, step))
        with torch.autocast(device.type, torch.bfloat16) if bf16 else contextlib.nullcontext():
            pred = model(sample.inputs, **sample.model_kwargs(), **model_kwargs(cfg))
        fl = flow_loss(pred, sample, batch, cfg.objective)
        share = fl.accumulation_loss(totals)
        (share * size).backward()  # FSDP averages gradients over ranks; the objective sums them
        parts = [fl.latent_sum / max(totals[0], 1.0), fl.action_sum / max(totals[1], 1.0)]
        out += torch.stack([share.detach(), *(p.detach() for p in parts)]).float().cpu()
    return out


def _stream(loader: Any, sampler: Any) -> Iterator[tuple[Batch, dict]]:
    """Micro-batches forever, epoch after epoch, each with the sampler state right after it."""
    while True:
        epoch, pos = sampler.epoch, sampler.state_dict()["position"]
        for batch in loader:
            pos += 1  # count batches trained on, not drawn: loader workers prefetch
            yield batch, sampler.state_dict(position=pos)
        sampler.set_epoch(epoch + 1)


def _device(spec: str) -> torch.device:
    if spec == "auto":
        spec = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}" if torch.cuda.is_available() else "cpu"
    device = torch.device(spec)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


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


def train(cfg: TrainConfig, *, stop_after: int | None = None) -> TrainResult:
    """Train ``cfg.schedule.steps`` optimizer steps (resuming from the run folder's newest checkpoint);
    ``stop_after`` ends early after that step, with a checkpoint, as an interruption would.
    Faults (:mod:`flexpack.training.faults`): a signal saves and raises ``Interrupted``, a non-finite
    step raises ``NonFiniteError`` (or is skipped), a data error on any rank saves the steps done and re-raises."""
    rank, size = world()
    found = resume.find(cfg, rank)
    if found is not None and resume.step_of(found) >= cfg.schedule.steps:  # nothing to do: touch nothing
        done = resume.step_of(found)
        if rank == 0:
            print(f"{cfg.runtime.out_dir}: already at step {done} of schedule.steps={cfg.schedule.steps}; "
                  "nothing to train (raise schedule.steps to continue)", file=sys.stderr)
        return TrainResult(step=done, start_step=done, checkpoint=found)
    with runfolder.RunLock(cfg.runtime.out_dir, active=rank == 0), faults.GracefulStop() as stop:
        _barrier()  # the other ranks wait for rank 0's lock (a refusal ends torchrun through rank 0)
        return _train(cfg, found, stop, stop_after)


def _train(cfg: TrainConfig, found: Path | None, stop: faults.GracefulStop, stop_after: int | None) -> TrainResult:
    rank, size = world()
    device = _device(cfg.runtime.device)
    data = build_data(cfg, rank, size)
    param_dtype = torch.bfloat16 if cfg.runtime.dtype == "bfloat16" else None
    with device:  # built where it runs: no full fp32 copy of a 5B model in host memory per rank
        model = build_model(cfg)
    model = parallelize(model, device=device, param_dtype=param_dtype,
                        activation_checkpointing=cfg.runtime.activation_checkpointing)
    o, run = cfg.optim, Path(cfg.runtime.out_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)
    start, resumed_at = 0, None
    if found is not None:
        start = resumed_at = int(resume.restore(found, cfg, model, opt, data, rank)["step"])
    if rank == 0:
        _prepare_run(run, cfg, start, size)
    loader = torch.utils.data.DataLoader(data.dataset, batch_sampler=data.sampler, collate_fn=data.collate,
                                         num_workers=cfg.data.num_workers)
    stream = _stream(loader, data.sampler)
    end = cfg.schedule.steps if stop_after is None else min(stop_after, cfg.schedule.steps)
    result = TrainResult(step=start, start_step=start, checkpoint=found, model=model)
    sampler_state, step, tpf, signum = data.sampler.state_dict(), start, data.tokens_per_frame, 0
    saver = checkpoint.Checkpointer(run / "checkpoints", keep=cfg.checkpoint.keep, async_save=cfg.checkpoint.async_save)
    extra = {"action_normalizer": resume.normalizer_state(data.dataset)}

    def save() -> Path:
        return saver.save(step, model, opt, sampler_state=sampler_state, extra=extra, config=cfg.to_dict())

    bar = tqdm(total=cfg.schedule.steps, initial=start, desc="train", unit="step",
               disable=rank != 0 or not cfg.runtime.progress)
    with StepProfiler(run, rank) as prof:
        while step < end and not signum:
            lr = lr_at(step, o.lr, cfg.schedule, resumed_at)
            for group in opt.param_groups:
                group["lr"] = lr
            if step > start and cfg.checkpoint.every and step % cfg.checkpoint.every == 0:
                result.checkpoint = save()
            t0 = time.perf_counter()
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
            sums = accumulate(model, batches, cfg, step=step, device=device)
            norm = nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip or float("inf"))
            nonfinite, signum = faults.check_step(norm, sums, stop)
            if nonfinite and not o.skip_nonfinite:
                raise faults.NonFiniteError(step + 1, float(sums[0]), float(norm), batches)
            if not nonfinite:  # a skipped step leaves weights and optimizer moments as they were
                opt.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            prof.step()
            bar.update(1)
            result.lrs.append(lr)
            result.episodes += [b.layout.episode_index.tolist() for b in batches]
            if step % cfg.runtime.log_every == 0 or step == end or nonfinite:
                rec = _log(run, rank, step, lr, sums, norm, batches, tpf, time.perf_counter() - t0,
                           extra={"skipped": True} if nonfinite else None)
                result.losses.append(rec["loss"])
                result.metrics.append(rec)
                bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{lr:.2e}", tok_s=f"{rec['tokens_per_s']:.0f}")
    bar.close()
    result.step = step
    if step > start:
        result.checkpoint = save()
    saver.wait()
    if signum:
        raise faults.Interrupted(signum, step, result.checkpoint if step > start else None)
    return result


def _barrier() -> None:
    if world()[1] > 1:
        dist.barrier()


def _prepare_run(run: Path, cfg: TrainConfig, start: int, size: int) -> None:
    """Rank 0, before the first step: clear interrupted saves, cut metrics.jsonl back to ``start``
    (the weights' step), record this start in the config history (:mod:`flexpack.training.runfolder`)."""
    for tmp in checkpoint.remove_temporary(run / "checkpoints"):
        print(f"removed {tmp} (an interrupted save)", file=sys.stderr)
    if dropped := runfolder.cut_metrics(run, start):
        print(f"{run}/metrics.jsonl: removed {dropped} line(s) after step {start} (steps of a run that was "
              "stopped before checkpointing them)", file=sys.stderr)
    changed = runfolder.record_start(run, cfg.to_dict(), start_step=start, world_size=size)
    if changed and start > 0:
        print(f"resuming at step {start} with changed config: "
              + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items())
              + f" (recorded in {run}/config_history.jsonl)", file=sys.stderr)


def _log(run: Path, rank: int, step: int, lr: float, sums: torch.Tensor, norm: torch.Tensor,
         batches: Sequence[Batch], tpf: int, seconds: float, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Global loss parts, LR, grad norm, tokens/s and waste of this step; rank 0 appends metrics.jsonl."""
    valid = sum(int(b.layout.episode_frames.sum()) for b in batches) * tpf
    computed = sum(b.layout.frame_doc.numel() for b in batches) * tpf
    stats = torch.cat([sums, torch.tensor([valid, computed], dtype=torch.float32)])
    if world()[1] > 1:
        dist.all_reduce(stats)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor under FSDP
    rec = {"step": step, "loss": float(stats[0]), "latent_loss": float(stats[1]), "action_loss": float(stats[2]),
           "lr": lr, "grad_norm": float(norm), "tokens_per_s": float(stats[3]) / max(seconds, 1e-9),
           "waste": 1.0 - float(stats[3]) / float(stats[4]), **(extra or {})}
    if rank == 0:
        run.mkdir(parents=True, exist_ok=True)
        with open(run / "metrics.jsonl", "a") as f:  # an append-only log: one line per logged step
            f.write(json.dumps(rec) + "\n")
    return rec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", type=Path, help="TOML or JSON config (configs/tiny_cpu.toml, ...)")
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config value, e.g. --set schedule.steps=40 (repeatable)")
    parser.add_argument("--stop-after", type=int, default=None, help="stop (with a checkpoint) after this step")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
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
    return 0
