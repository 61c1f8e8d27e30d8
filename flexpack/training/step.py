"""One optimizer step of the train loop, shared by ``flexpack train`` and ``benchmarks/train_step.py``.

:func:`accumulate` runs the step's micro-batches forward and backward; :func:`train_step` adds
clipping and the optimizer update (AdamW from :func:`flexpack.training.optim.build_optimizer`).
The model is called with the run's forward options (:class:`~flexpack.run.root.ForwardOptions`:
mask, chunk size, text slots) under its autocast rule (:meth:`~flexpack.run.root.Run.autocast`); the
run's objective (the model family's: :mod:`flexpack.flow.objectives`) makes its inputs and its loss.
Nothing here waits for the GPU: loss counts come from the host-side layout, the batch and its
layout go to the device from pinned memory without blocking and host-side code reads the layout's
host copy (:mod:`flexpack.packing.transfer`), noise is drawn on the device
(:mod:`flexpack.flow.noise`), loss parts and the gradient norm stay device tensors until the
caller logs them, so the host can queue the next step while the GPU runs this one
(``tests/test_step_syncs_gpu.py`` checks it on CUDA, ``tests/test_loop_syncs.py`` on CPU).

Loss parts are the objective's, by name: whatever ``objective.counts`` names (and the loss's ``parts()``
gives) is accumulated, after the loss itself, in one device tensor; :func:`part_names` says which value
is which (``("loss", *counts)``), so the loop's metrics row, validation and the trackers log every part
without a list of names here.
"""

from __future__ import annotations

from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from flexpack.flow.noise import noise_seeds
from flexpack.packing.collate import Batch
from flexpack.parallel import float8
from flexpack.parallel.parallelize import is_sharded
from flexpack.run.root import Run
from flexpack.training.observe.profiling import NO_PROFILER, StepProfiler


def part_names(objective: Any, batch: Batch) -> tuple[str, ...]:
    """The names of :func:`accumulate`'s values (before the per-source ones): ``"loss"``, then the parts the
    objective counts in a (host) ``batch``, in its order (``latent_loss``, ``action_loss``, any extra)."""
    return ("loss", *objective.counts(batch))


def accumulate(model: nn.Module, batches: Sequence[Batch], run: Run, *, step: int,
               prof: StepProfiler = NO_PROFILER) -> torch.Tensor:
    """Forward + backward one optimizer step's micro-batches (on the host, before ``.to(device)``);
    returns this rank's shares of the loss and of each part (:func:`part_names`: loss, latent, action, any
    part the objective adds) as a device tensor, detached (summed over ranks they are the step's loss and its
    parts), then the per-source sums where the dataset has several sources."""
    cfg, device, size, forward, objective = run.config, run.device, run.world_size, run.forward, run.objective
    per_batch = [objective.counts(b) for b in batches]
    names = list(per_batch[0])
    counts = torch.stack([torch.stack([c[n] for n in names]).float().cpu() for c in per_batch]).sum(0)
    if size > 1:
        dist.all_reduce(counts)  # the objective is over every rank's episodes
    totals = {n: float(counts[i]) for i, n in enumerate(names)}
    sharded = is_sharded(model)
    out = torch.zeros(1 + len(names), device=device)
    sources = episode_sources(run.dataset)
    by_source = torch.zeros(len(sources[0]) if sources else 0, 3, device=device)  # latent sum, action sum, frames
    for i, batch in enumerate(batches):
        if sharded:  # reduce-scatter gradients once per step, not per micro-batch
            model.set_requires_gradient_sync(i == len(batches) - 1)
        seeds = noise_seeds(batch.layout, cfg.runtime.seed, step)  # from the host-side layout
        slot_source = source_slots(batch.layout, sources[1]) if sources else None  # host-side too
        prof.phase("data")
        batch = batch.to(device, non_blocking=True)
        prof.phase("forward", batch)
        sample = objective.sample(batch, seeds)
        with run.autocast():
            pred = forward(model, sample)
        fl = objective.loss(pred, sample, batch)
        share = fl.accumulation_loss(totals)
        prof.phase("backward")
        (share * size).backward()  # FSDP averages gradients over ranks; the objective sums them
        prof.phase(None)
        named = fl.parts()
        if set(named) != set(names):
            raise ValueError(f"the objective's loss parts {sorted(named)} differ from the parts it counts "
                             f"{sorted(names)}: counts() and loss() must name the same parts")
        parts = [named[n].sum / max(totals[n], 1.0) for n in names]
        out += torch.stack([share.detach(), *(p.detach() for p in parts)]).float()
        if slot_source is not None:
            pin = device.type == "cuda"  # a copy from pageable memory would wait for the GPU
            src, frames = ((t.pin_memory() if pin else t).to(device, non_blocking=True) for t in slot_source)
            per = fl.episode_sums.detach().float() if fl.episode_sums is not None else torch.full(
                (src.shape[0], 2), float("nan"), device=device)
            by_source.index_add_(0, src, torch.cat([per, frames[:, None]], dim=1))
    return torch.cat([out, by_source.reshape(-1)]) if sources else out


def episode_sources(dataset: Any) -> tuple[list[str], dict[int, int]] | None:
    """(source names, episode index -> source) of a dataset that reads several sources (a bundle's datasets, a
    mixture's), for the per-source loss parts and tokens of the metrics; None for one source."""
    return getattr(dataset, "episode_sources", None)


def source_slots(layout: Any, source_of: dict[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per episode slot of ``layout`` (host): its source and its valid frames."""
    src = torch.tensor([source_of.get(int(e), 0) for e in layout.episode_index.tolist()], dtype=torch.int64)
    return src, layout.episode_frames.float()


def train_step(model: nn.Module, opt: torch.optim.Optimizer, batches: Sequence[Batch], run: Run, *, step: int,
               prof: StepProfiler = NO_PROFILER,
               guard: Callable[[int, torch.Tensor, torch.Tensor, Sequence[Batch]], bool] | None = None,
               ema: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`accumulate` → clip → ``guard`` (:class:`~flexpack.run.state.faults.StepGuard`: may the
    weights change?) → optimizer step → EMA → zero grads; returns (loss parts, grad norm), both
    device tensors."""
    sums = accumulate(model, batches, run, step=step, prof=prof)
    prof.phase("optimizer")
    norm = nn.utils.clip_grad_norm_(model.parameters(), run.config.optim.grad_clip or float("inf"), foreach=True)
    if guard is None or guard(step, norm, sums, batches):
        opt.step()
        float8.after_optimizer_step(model)  # FSDP2 float8 all-gather: all weight scales in one pass
        if ema is not None:
            ema.update()
    opt.zero_grad(set_to_none=True)
    prof.phase(None)
    return sums, norm
