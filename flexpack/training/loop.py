"""``flexpack train CONFIG``: the train loop, a plain function over a composed ``"train"``
:class:`~flexpack.run.root.Run` (:func:`flexpack.run.compose.compose`).

Order of one optimizer step (nanoGPT's): lr → checkpoint → micro-steps → clip → step → log.

- Data: the run's plan (:mod:`flexpack.run.root`: model config, token geometry, LatentEpisodeDataset,
  pack mode = TokenBudgetBatchSampler + PackCollate, pad mode = LengthBucketBatchSampler + PadCollate,
  forward options), made once and read by the step, meter, profiler and validation. The sampler is
  sharded by rank and resumes mid-epoch.
- Accumulation: ``optim.accum_steps`` micro-batches per step, each back-propagating
  ``FlowLoss.accumulation_loss(totals)`` with ``totals`` = Σ of the objective's counts over the step's
  micro-batches of all ranks, so a step equals one batch of all its episodes. Every loss part the
  objective names is logged under its name (:func:`~flexpack.training.step.part_names`).
- Noise is drawn per episode from ``(runtime.seed, step, episode index)`` (:mod:`flexpack.flow.noise`):
  how episodes are batched never changes their x_t, and a resumed run draws what it would have.
- Multi-GPU: under ``torchrun`` with several ranks the model is FSDP2-sharded
  (:mod:`flexpack.parallel.parallelize`); checkpoints (:mod:`flexpack.run.state.checkpoint`) are sharded (DCP) and
  resume on any number of ranks (:mod:`flexpack.run.state.resume`).
- The run folder has one owner, a metrics log cut back to the weights' step on resume and a config history
  (:mod:`flexpack.run.state.runfolder`); signals, data errors and non-finite steps end a run cleanly
  (:mod:`flexpack.run.state.faults`).
- One step (:func:`~flexpack.training.step.train_step`) queues its work without waiting for the GPU;
  on CUDA in pack mode each block is compiled once for all layers (``parallel.compile``). The host
  reads device values at logged steps only (loss, grad norm, throughput: :mod:`flexpack.training.observe.metrics`).
- What a person reads: a progress bar on a terminal and a plain line every ``log.every`` steps in a
  log file (:mod:`flexpack.training.observe.console`).
- ``profile.steps = n`` profiles n steps (:mod:`flexpack.training.observe.profiling`); metrics also go to
  TensorBoard / W&B (:mod:`flexpack.training.observe.tracking`).
"""

from __future__ import annotations

import gc
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.distributed as dist
from torch import nn

from flexpack.packing.collate import Batch
from flexpack.packing.grids import real_tokens
from flexpack.parallel.parallelize import world
from flexpack.run import lora, memory_plan
from flexpack.run.compose import compose
from flexpack.run.cpu_threads import cpu_threads
from flexpack.run.hooks import HookContext, HookFactory
from flexpack.run.resolve import with_default_mask
from flexpack.run.root import Run
from flexpack.run.start import StartChecks, StartUp, start_up
from flexpack.run.state import checkpoint, faults, resume, runfolder, trained
from flexpack.training import optim, resume_note
from flexpack.training.deprecated import REMOVED_IN
from flexpack.training.ema import make_ema
from flexpack.training.lr_schedule import lr_at
from flexpack.training.observe import tracking
from flexpack.training.observe.console import Console
from flexpack.training.observe.metrics import StepMeter
from flexpack.training.observe.profiling import StepProfiler
from flexpack.training.optim import build_optimizer
from flexpack.training.step import (  # noqa: F401  (accumulate: public too)
    accumulate,
    episode_sources,
    part_names,
    train_step,
)
from flexpack.training.validation import make_validator

# training's part of the start-up (flexpack.run.start): the logger packages, the optimizer on the device
START_CHECKS = StartChecks(log=tracking.check, optim=optim.check)


def _stream(loader: Any, sampler: Any) -> Iterator[tuple[Batch, dict]]:
    """Micro-batches forever, epoch after epoch, each with the sampler state right after it."""
    while True:
        epoch, pos = sampler.epoch, sampler.state_dict()["position"]
        if hasattr(loader.dataset, "set_epoch"):  # per-epoch draws of the items (a bundle's text dropout)
            loader.dataset.set_epoch(epoch)
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

    @classmethod
    def nothing_left(cls, started: StartUp) -> "TrainResult":
        """No step taken: the run folder is at ``schedule.steps`` already (``started.done``: the start-up said so)."""
        return cls(step=started.done, start_step=started.done, checkpoint=started.resume)


def train(run: Run, /, *, stop_after: int | None = None, hooks: Sequence[HookFactory] | None = None,
          started: StartUp | None = None, **legacy: Any) -> TrainResult:
    """Train ``run`` (a ``"train"`` :class:`~flexpack.run.root.Run`: ``compose(cfg, "train")``, or over in-memory
    episodes ``compose(cfg, "train", dataset=...)``) for ``schedule.steps`` optimizer steps of its config, resuming
    from the run folder's newest checkpoint; ``stop_after`` ends early after that step, with a checkpoint, as an
    interruption would. ``hooks``: what runs after each step (:mod:`flexpack.run.hooks`); default validation only.
    Sampling during training (``sample.every``) is a sibling's hook: ``flexpack train``
    (:func:`flexpack.commands.train.train`) wires it in.

    ``started``: what :func:`flexpack.run.start.start_up` found for ``run.config``, the run composed inside its block
    (``flexpack train``: device, run folder and resume checked before any data is opened); without it the start-up
    runs here, from ``run.config`` and ``run.model_config``. ``train(config)`` and ``train(config, run=run)`` still
    work, deprecated (:func:`_legacy`).
    Faults (:mod:`flexpack.run.state.faults`): a signal saves and raises ``Interrupted``, a non-finite
    step raises ``NonFiniteError`` (or is skipped), a data error on any rank saves the steps done and re-raises."""
    if not isinstance(run, Run):  # a config: the form before the Run
        if started is not None:
            raise TypeError("train(config, started=...): pass the Run composed inside the start-up")
        return _legacy(run, stop_after=stop_after, hooks=hooks, **legacy)
    if legacy:
        raise TypeError(f"train() got unexpected keyword argument(s) {sorted(legacy)}")
    hooks = _hooks(run.config, hooks)
    if started is None:
        with start_up(run.config, checks=START_CHECKS, stop_after=stop_after, checked=(run.config, run.model_config)
                      ) as started:
            return _train(run, started, stop_after, hooks)
    if started.config != run.config:  # the folder claimed and locked was started.config's; the steps run.config's
        raise ValueError("train: run was composed from another config than the one started (e.g. another "
                         "runtime.out_dir); compose it inside the start-up, from started.config")
    return _train(run, started, stop_after, hooks)


def _legacy(cfg: Any, *, stop_after: int | None, hooks: Sequence[HookFactory] | None,
            run: Run | None = None, **unknown: Any) -> TrainResult:
    """``train(config)`` / ``train(config, run=run)``: deprecated (see CHANGELOG.md), what they always did."""
    if unknown:
        raise TypeError(f"train() got unexpected keyword argument(s) {sorted(unknown)}")
    new = ("train(run), the run holding its config" if run is not None else
           'train(compose(config, "train")) (flexpack.run.compose), or flexpack.commands.train.train(config) '
           "(what flexpack train runs: the start-up before any data is opened)")
    what = "train(config, run=run)" if run is not None else "train(config)"
    warnings.warn(f"flexpack.training.loop.{what} is deprecated: call {new}; the config form goes in flexpack "
                  f"{REMOVED_IN}", DeprecationWarning, stacklevel=3)
    if run is not None and run.config != with_default_mask(cfg, run.family):
        # the folder claimed below is cfg's; the steps would run run.config's
        raise ValueError("train: run= was composed from another config than cfg (e.g. another runtime.out_dir); "
                         "compose the run from the config it trains with")
    hooks = _hooks(cfg, hooks)
    # the config checked and its model resolved once, before any data: the resume check and the run share them
    checked = (run.config, run.model_config) if run is not None else None
    with start_up(cfg, checks=START_CHECKS, stop_after=stop_after, checked=checked) as started:
        if started.done is None and run is None:
            rank, size = world()
            run = compose(started.config, "train", rank=rank, world_size=size, device=started.device,
                          checked=started.checked)
        return _train(run, started, stop_after, hooks)


def _hooks(cfg: Any, hooks: Sequence[HookFactory] | None) -> tuple[HookFactory, ...]:
    """``hooks``, validation only by default; a config that samples during training needs the sampling hook."""
    hooks = (make_validator,) if hooks is None else tuple(hooks)
    if cfg.sample.every and len(hooks) < 2:
        raise ValueError(f"sample.every={cfg.sample.every} needs the sampling hook: run "
                         "'flexpack train' (or call flexpack.commands.train.train), or pass hooks=")
    return hooks


def _train(run: Run | None, started: StartUp, stop_after: int | None, hooks: Sequence[HookFactory]) -> TrainResult:
    if started.done is not None:
        return TrainResult.nothing_left(started)
    found, stop, device = started.resume, started.stop, started.device
    rank, size = world()
    run = memory_plan.apply(run)  # memory.budget_gb: checkpointing, optimizer states, offload; before any weights
    cfg = run.config
    optim.check(cfg.optim, device, size)  # the optimizer as planned: torchao, offload on one CUDA GPU
    if found is not None:  # its states are of the checkpoint's kind: before the model is built or anything loads
        resume.check_optim(found, cfg)
    model = run.build_model()  # float8's token multiple checked; model.pretrained under FSDP2: each rank its shards
    if rank == 0 and cfg.model.pretrained and found is None:  # the weights a new run starts from, what matched
        from flexpack.run.pretrained import loaded_note

        print(loaded_note(cfg.model.pretrained, run.model_config, run.family, model), flush=True)
    o, folder = cfg.optim, Path(cfg.runtime.out_dir)
    opt = build_optimizer(model, o, log=rank == 0, fused=device.type == "cuda")  # no decay on norms, biases, ...
    ema = make_ema(model, o.ema_decay)
    start, resumed_at, old_world = 0, None, size
    if found is not None:
        state = resume.restore(found, cfg, model, opt, run, rank, ema=ema)
        start = resumed_at = int(state["step"])
        old_world = int(state.get("world_size", size))
    if rank == 0:
        _prepare_run(folder, run, start, size, old_world)
    # the loader's own generator: each epoch's iterator draws its worker seed from it, not from the global RNG that
    # the checkpoints restore (dropout, such as lora.dropout's, then draws after a resume what it would have)
    loader = torch.utils.data.DataLoader(run.dataset, batch_sampler=run.sampler, collate_fn=run.collate,
                                         num_workers=cfg.data.num_workers, pin_memory=device.type == "cuda",
                                         generator=torch.Generator().manual_seed(cfg.data.seed))
    stream = _stream(loader, run.sampler)
    sources = (episode_sources(run.dataset) or ([], {}))[0]  # per-dataset loss parts and tokens in the metrics
    end = cfg.schedule.steps if stop_after is None else min(stop_after, cfg.schedule.steps)
    result = TrainResult(step=start, start_step=start, checkpoint=found, model=model)
    sampler_state, step, tpf, signum = run.sampler.state_dict(), start, run.tokens_per_frame, 0
    saver = checkpoint.Checkpointer(folder / "checkpoints", keep=cfg.checkpoint.keep,
                                    async_save=cfg.checkpoint.async_save)
    stats = resume.normalizer_state(run.dataset)  # after a resume: the checkpoint's, which the weights learned under
    # the model the weights are of, as resolved (flexpack sample builds it, a resume compares against it)
    extra = {**resume.stats_extra(stats, run.dataset), trained.MODEL_KEY: trained.model_record(run.model_config),
             trained.LORA_KEY: lora.lora_record(cfg, run.family),  # LoRA options: a resume with others is refused
             **resume.optim_extra(o)}  # the optimizer's states and offload: a resume must match them
    context = HookContext(run=run, action_stats=stats)
    after = [h for h in (make(context) for make in hooks) if h is not None]  # built before the first step

    guard, meter = (faults.StepGuard(stop, o.skip_nonfinite),
                    StepMeter(cfg.profile, device, seed=cfg.runtime.seed, model=run.model_config,
                              geometry=run.geometry, objective=run.objective))

    def save() -> Path:
        guard.flush()  # never the weights of a non-finite step
        return saver.save(step, model, opt, sampler_state=sampler_state, extra=extra, config=cfg.to_dict(), ema=ema)

    console = Console(total=cfg.schedule.steps, start=start, end=end, log_every=cfg.log.every,
                      progress=cfg.log.progress, rank=rank)  # a bar on a terminal, plain lines in a log
    with (StepProfiler.for_training(cfg.runtime, cfg.profile, rank, steps_left=end - step, first_step=step,
                                    model=run.model_config, geometry=run.geometry, objective=run.objective,
                                    device=device) as prof,
          tracking.MetricSinks(folder, cfg.log, config=cfg.to_dict(), rank=rank, start_step=start) as sinks,
          _QuietGC() as gc_pause,
          cpu_threads(cfg.runtime.cpu_threads, device, model, say=rank == 0)):  # a tiny model: one thread, said
        while step < end and not signum:
            gc_pause.step(step)
            prof.step()
            lr = lr_at(step, o.lr, cfg.schedule, resumed_at)
            optim.set_lr(opt, lr)  # torchao's low-bit AdamW holds it as a tensor
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
            # the run's forward options: one text-key shape for the run, no recompiles per episode count
            sums, norm = train_step(model, opt, batches, run, step=step, prof=prof, guard=guard, ema=ema)
            signum, nonfinite = guard.signum, guard.skipped
            meter.add(batches, step)
            step += 1
            console.update()
            result.lrs.append(lr)
            result.episodes += [b.layout.episode_index.tolist() for b in batches]
            if step % cfg.log.every == 0 or step == end or nonfinite:
                guard.flush()
                names = part_names(run.objective, batches[0])
                rec = _log(step, lr, sums, norm, batches, tpf, meter, extra={"skipped": True} if nonfinite else None,
                           sources=sources, names=names, video_tokens=run.geometry.video_tokens)
                result.losses.append(rec["loss"])
                result.metrics.append(rec)
                sinks.log(rec)
                console.row(rec, loss_parts=names[1:])
            for hook in after:
                if (report := hook.after_step(model, step, ema=ema)) is not None:
                    sinks.log(report.row)
                    console.row(report.row)
                    if report.images:
                        sinks.log_images(step, dict(report.images))
            console.end_step(step)
    console.close()
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


def _prepare_run(folder: Path, run: Run, start: int, size: int, old_world: int) -> None:
    """Rank 0, before the first step: clear interrupted saves, cut metrics.jsonl back to ``start``
    (the weights' step), record this start in the config history (:mod:`flexpack.run.state.runfolder`);
    a resume with changed settings says which and what they do (:mod:`flexpack.training.resume_note`)."""
    cfg = run.config
    runfolder.mark(folder)
    for tmp in checkpoint.remove_temporary(folder / "checkpoints"):
        why = "an interrupted save" if tmp.name.startswith((".tmp-", ".old-")) else "an interrupted pruning"
        print(f"removed {tmp} ({why})", file=sys.stderr)
    if dropped := runfolder.cut_metrics(folder, start):
        print(f"{folder}/metrics.jsonl: removed {dropped} line(s) after step {start} (steps of a run that was "
              "stopped before checkpointing them)", file=sys.stderr)
    changed = runfolder.record_start(folder, cfg.to_dict(), start_step=start, world_size=size)
    if start > 0 and (changed or old_world != size):
        what = ("changed config: " + ", ".join(f"{k} {a!r} -> {b!r}" for k, (a, b) in changed.items()) if changed
                else f"{size} rank(s) instead of {old_world}")
        notes = resume_note.effects(cfg.data, cfg.optim, cfg.schedule, changed, step=start, world=size,
                                    old_world=old_world)
        print(f"resuming at step {start} with {what} (recorded in {folder}/config_history.jsonl)"
              + "".join(f"\n  {line}" for line in notes), file=sys.stderr)


def _log(step: int, lr: float, sums: torch.Tensor, norm: torch.Tensor, batches: Sequence[Batch], tpf: int,
         meter: StepMeter, extra: dict[str, Any] | None = None, sources: Sequence[str] = (),
         names: Sequence[str] = ("loss", "latent_loss", "action_loss"), video_tokens: int = 0) -> dict[str, Any]:
    """Global loss and loss parts (``names``: :func:`~flexpack.training.step.part_names`, whatever the
    objective gives), LR, grad norm, waste of this step, and the throughput of the steps since
    the last log (tokens/s, step time, peak memory, MFU); per source of a bundle or mixture
    (``sources``), its loss parts over its own frames and its tokens (``dataset/<name>/...``). One of the
    few points where the host waits for the GPU. Spatial padding (items of smaller grids) is waste."""
    valid = sum(real_tokens(b.layout.on_host(), tpf, video_tokens) for b in batches)
    computed = sum(b.layout.frame_doc.numel() for b in batches) * tpf
    sums = sums.float().cpu()
    P = len(names)
    stats = torch.cat([sums[:P], torch.tensor([valid, computed], dtype=torch.float32), sums[P:]])
    if world()[1] > 1:
        dist.all_reduce(stats)
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor under FSDP
    per: dict[str, float] = {}
    for k, name in enumerate(sources):
        lat, act, frames = (float(x) for x in stats[P + 2 + 3 * k: P + 5 + 3 * k])
        if frames:
            per.update({f"dataset/{name}/latent_loss": lat / frames, f"dataset/{name}/action_loss": act / frames})
        per[f"dataset/{name}/tokens"] = frames * tpf
    parts = {name: float(stats[i]) for i, name in enumerate(names)}
    return {"step": step, **parts, "lr": lr, "grad_norm": float(norm),
            "waste": 1.0 - float(stats[P]) / float(stats[P + 1]), **per, **meter.read(), **(extra or {})}
