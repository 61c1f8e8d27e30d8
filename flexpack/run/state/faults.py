"""What ends a training run early, and how it ends cleanly.

- SIGINT / SIGTERM / SIGHUP (Ctrl-C, a scheduler's preemption, a closed terminal):
  :class:`GracefulStop` records the signal; the loop finishes the current step, saves a checkpoint
  and raises :class:`Interrupted`, whose message says where the checkpoint is. A second Ctrl-C
  interrupts at once.
- A data error (a corrupt latent, a missing file) on any rank: :func:`any_rank_failed` lets every
  rank know in one tiny all-reduce per step (none on one process), so all save the last completed
  step together before the error is raised (on the other ranks as :class:`PeerDataError`).
- A non-finite loss or gradient norm: :func:`check_step` finds it once per optimizer step (from
  the grad norm the clip computes anyway and the loss shares already on the host), agreed over
  all ranks in the same small all-reduce as the stop flag. The loop raises
  :class:`NonFiniteError` before the optimizer step (the weights are still the last good ones
  and no checkpoint is written), or with ``optim.skip_nonfinite`` skips the update.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from flexpack.packing.collate import Batch
from flexpack.packing.transfer import to_device
from flexpack.parallel.parallelize import world


class Interrupted(Exception):
    """The run stopped on a signal after a completed step, with a checkpoint of that step."""

    def __init__(self, signum: int, step: int, checkpoint: Path | None) -> None:
        self.signum, self.step, self.checkpoint = signum, step, checkpoint
        self.exit_code = 128 + signum  # the shell's convention for "killed by signal N"
        where = f"checkpoint {checkpoint}" if checkpoint else "no new checkpoint (no step done since the last one)"
        super().__init__(f"interrupted by {signal.Signals(signum).name} after step {step}; {where}; "
                         "run the same command again to resume")


class NonFiniteError(ValueError):
    """A step's loss or gradient norm is NaN/Inf (a user-facing stop: lr, data or clipping)."""

    def __init__(
        self, step: int, loss: float, grad_norm: float, batches: Sequence[Batch], *, found_at: int | None = None
    ) -> None:
        episodes = [b.layout.episode_index.tolist() for b in batches]
        rank = world()[0]
        when = ("stopped before the optimizer step" if found_at is None else
                f"found at the check after step {found_at} (checks run at every logged step, log.every)")
        super().__init__(
            f"step {step}: non-finite loss {loss} / gradient norm {grad_norm} on micro-batches with episodes "
            f"{episodes} (rank {rank}); {when}, no checkpoint of these weights "
            "written; lower optim.lr, check those episodes, or set optim.skip_nonfinite=true to skip such steps")


class PeerDataError(RuntimeError):
    """Another rank's data failed at this step; that rank raises the error itself."""

    def __init__(self, step: int) -> None:
        super().__init__(f"step {step}: stopped for a data error on another rank (its message names the episode)")


def any_rank_failed(error: BaseException | None) -> bool:
    """True on every rank when ``error`` is set on any rank."""
    if world()[1] == 1:
        return error is not None
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else torch.device("cpu")
    flag = to_device(torch.tensor([0.0 if error is None else 1.0]), device)  # pinned: the read below is the one wait
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


class GracefulStop:
    """``with GracefulStop() as stop:`` — SIGINT/SIGTERM/SIGHUP set ``stop.signum`` instead of killing the
    process (installed only in the main thread; the previous handlers come back on exit)."""

    SIGNALS = tuple(getattr(signal, n) for n in ("SIGINT", "SIGTERM", "SIGHUP") if hasattr(signal, n))

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}
        self._pid = os.getpid()

    def __enter__(self) -> "GracefulStop":
        self._pid = os.getpid()
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc: Any) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._pid:
            return  # a forked DataLoader worker: it keeps loading until the main process has saved
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # asked twice: stop now, without the checkpoint
        self.signum = signum
        if world()[0] == 0:  # under torchrun every rank gets the signal; one line is enough
            try:
                print(f"\n{signal.Signals(signum).name}: finishing this step, then saving a checkpoint "
                      "(Ctrl-C again to stop at once)", file=sys.stderr, flush=True)
            except OSError:  # SIGHUP: the terminal may be gone; saving matters, the notice does not
                pass


class StepGuard:
    """Non-finite steps and signals, with as few host syncs as the options allow.

    With ``optim.skip_nonfinite`` or several ranks every step is checked before its update
    (:func:`check_step`: one host read; ranks must agree). Otherwise a step's loss and gradient norm
    stay on the device until :meth:`flush` (every logged step, every checkpoint, the end of the
    run): the run still stops at the first non-finite step, naming it, and never saves its weights,
    but the host does not wait for the GPU once per step."""

    def __init__(self, stop: GracefulStop, skip_nonfinite: bool) -> None:
        self.stop, self.skip = stop, skip_nonfinite
        self.eager = skip_nonfinite or world()[1] > 1
        self.pending: list[tuple[int, torch.Tensor, torch.Tensor, Sequence[Batch]]] = []
        self.signum = 0
        self.skipped = False

    def __call__(self, step: int, norm: torch.Tensor, sums: torch.Tensor, batches: Sequence[Batch]) -> bool:
        """Whether step ``step`` (0-based) may update the weights."""
        if not self.eager:
            self.signum = int(self.stop.signum or 0)
            self.pending.append((step, norm.detach(), sums.detach(), batches))
            self.skipped = False
            return True
        nonfinite, self.signum = check_step(norm, sums, self.stop)
        if nonfinite and not self.skip:
            raise NonFiniteError(step + 1, float(sums[0]), float(norm), batches)
        self.skipped = nonfinite
        return not nonfinite  # a skipped step leaves weights and optimizer moments as they were

    def flush(self) -> None:
        """Raise :class:`NonFiniteError` for the first non-finite step since the last flush."""
        if not self.pending:
            return
        bad = torch.stack([~(torch.isfinite(n).all() & torch.isfinite(s).all()) for _, n, s, _ in self.pending])
        flags = bad.tolist()
        pending, self.pending = self.pending, []
        if any(flags):
            step, norm, sums, batches = pending[flags.index(True)]
            raise NonFiniteError(step + 1, float(sums[0]), float(norm), batches, found_at=pending[-1][0] + 1)


def check_step(norm: torch.Tensor, sums: torch.Tensor, stop: GracefulStop) -> tuple[bool, int]:
    """(non-finite loss or grad norm on any rank, signal number asked on any rank or 0), one host
    read per optimizer step; every rank gets the same answer, so all stop or skip together."""
    norm = norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # a DTensor under FSDP
    # flags computed where the values are and the signal copied without blocking: one wait, the read below
    bad_loss = (~torch.isfinite(sums.detach().float())).any().float().reshape(1).to(norm.device)
    signum = to_device(torch.tensor([float(stop.signum or 0)]), norm.device)
    flags = torch.cat([(~torch.isfinite(norm.detach().float())).float().reshape(1), bad_loss, signum])
    if world()[1] > 1:
        dist.all_reduce(flags, op=dist.ReduceOp.MAX)
    bad_norm, bad_loss, signum = flags.tolist()
    return bool(bad_norm or bad_loss), int(signum)
