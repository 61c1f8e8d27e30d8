"""The start-up of a training run, before any data is opened: ``with start_up(cfg, checks=...) as started:``.

What can fail without data or a model fails here, cheaply, in this order: the config checked
(:func:`flexpack.run.resolve.check`: the registry, the mask table, the model config resolved), the logger packages
(rank 0), the stop step, finite numbers, the device and the run folder (:func:`flexpack.run.checks.preflight`), the
folder claimed (rank 0: flexpack's own or refused, :mod:`flexpack.run.state.runfolder`), the optimizer on that
device, and the checkpoint to resume from (:func:`flexpack.run.state.resume.find`). A run folder already at
``schedule.steps`` says so and ends there: ``started.done`` is its step, and nothing is locked, opened or written.
Otherwise the folder is locked (one ``train`` per folder) and signals are caught for the whole block, in which the
caller composes the ``"train"`` :class:`~flexpack.run.root.Run` (``compose(started.config, "train",
checked=started.checked, device=started.device)``: no second check or resolution) and trains it
(:func:`flexpack.training.loop.train` with ``started=``), as ``flexpack train`` (:mod:`flexpack.commands.train`) does.

The checks of the layer above (``training/``: the loggers, the optimizer) come in as :class:`StartChecks`, each run
at its place in that order (``flexpack.training.loop.START_CHECKS``).
"""

from __future__ import annotations

import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from flexpack.run.checks import preflight
from flexpack.run.resolve import check
from flexpack.run.state import faults, resume, runfolder

if TYPE_CHECKING:
    import torch

    from flexpack.run.config import OptimConfig, TrainConfig
    from flexpack.run.config_sections import LogConfig


@dataclass(frozen=True, kw_only=True)
class StartChecks:
    """The start-up checks of the layer above run/: ``log`` (rank 0, before the device and the folder: the logger
    packages the ``log`` section asks for), ``optim`` (after the folder is claimed: the optimizer's states and
    offload on this device and world size)."""

    log: Callable[[LogConfig], None]
    optim: Callable[[OptimConfig, torch.device, int], None]


@dataclass(frozen=True, kw_only=True)
class StartUp:
    """What the start-up found (see the module docstring)."""

    config: TrainConfig  # checked: its defaults filled in
    model_config: Any  # the family's resolved model config (a ModelShape)
    device: torch.device  # where the run trains (runtime.device on this rank)
    resume: Path | None  # the checkpoint to resume from (None: a new run)
    done: int | None = None  # the step the folder is at where that is schedule.steps or more: nothing to train
    stop: faults.GracefulStop | None = None  # the signals caught while training (None where done)

    @property
    def checked(self) -> tuple[TrainConfig, Any]:
        """``(config, model_config)``: what :func:`~flexpack.run.compose.compose` takes as ``checked=``."""
        return self.config, self.model_config


@contextmanager
def start_up(cfg: TrainConfig, *, checks: StartChecks, stop_after: int | None = None,
             checked: tuple[TrainConfig, Any] | None = None) -> Iterator[StartUp]:
    """The start-up of training ``cfg`` (the module docstring); ``stop_after``: the step the run stops after
    (checked here), ``checked``: what :func:`~flexpack.run.resolve.check` returned for ``cfg`` already (a Run's
    ``config`` and ``model_config``)."""
    import torch.distributed as dist

    from flexpack.parallel.parallelize import world

    rank, size = world()
    cfg, model_cfg = check(cfg) if checked is None else checked
    if rank == 0:
        checks.log(cfg.log)  # a missing logger package fails before any data or model work
    device = preflight(cfg, stop_after, model_cfg)  # device, run folder, finite numbers: before data and model
    if rank == 0:
        runfolder.claim(cfg.runtime.out_dir, adopt=cfg.runtime.adopt_dir)  # flexpack's own folder, or refused
    checks.optim(cfg.optim, device, size)  # torchao for low-bit states; offload on one CUDA device
    found = resume.find(cfg, rank, model_cfg)
    if found is not None and resume.step_of(found) >= cfg.schedule.steps:  # nothing to do: touch nothing
        done = resume.step_of(found)
        if rank == 0:
            print(f"{cfg.runtime.out_dir}: already at step {done} of schedule.steps={cfg.schedule.steps}; "
                  "nothing to train (raise schedule.steps to continue)", file=sys.stderr)
        yield StartUp(config=cfg, model_config=model_cfg, device=device, resume=found, done=done)
        return
    with runfolder.RunLock(cfg.runtime.out_dir, active=rank == 0), faults.GracefulStop() as stop:
        if size > 1:  # the other ranks wait for rank 0's lock (a refusal ends torchrun through rank 0)
            dist.barrier()
        yield StartUp(config=cfg, model_config=model_cfg, device=device, resume=found, stop=stop)
