"""What a person reads while a run trains (rank 0 only): a progress bar on a terminal, and plain lines that
a file, a pipe or a cluster's job log keeps readable.

- stderr is a terminal and ``log.progress`` is on: the tqdm bar, plus one line every
  :func:`line_every` steps, the smallest multiple of ``log.every`` that is at least
  :data:`TERMINAL_LINE_STEPS` (the bar shows the current step; the lines leave a record that scrolls).
- otherwise (a file, a pipe, a job log, or ``log.progress = false``): no bar (written to a file, its
  carriage-return updates pile up into one line of tens of thousands of characters) and one line every
  ``log.every`` steps.

The last step of a run and a skipped non-finite step always get a line. Lines go to stdout, flushed at
once (a job log shows them as they happen); ``metrics.jsonl`` holds the same numbers and more. A line::

    step 30/300  loss 0.4123 (latent 0.3911, action 0.0212)  val 0.4410  grad 1.21  lr 2.95e-03  tok/s 1.23k  eta 3m05s

after the loss, each part the objective returns, by name (``latent_loss`` as ``latent``);
``val`` is the newest validation loss (``validation.every``), marked with its step when it is older than
the line; ``mfu`` appears where a bf16 peak is known (CUDA, or ``profile.peak_tflops``); ``mem`` is the
peak memory of the window (the GPU's, else the process's resident set).
"""

from __future__ import annotations

import math
import sys
import time
from typing import IO, Any, Sequence

from tqdm import tqdm

TERMINAL_LINE_STEPS = 10  # with a bar on a terminal: a line at most this often (rounded up to log_every)


def line_every(log_every: int, bar: bool) -> int:
    """Steps between two lines: ``log_every`` without a bar, else its smallest multiple >= 10 (only logged
    steps have the numbers a line shows)."""
    return log_every * math.ceil(TERMINAL_LINE_STEPS / log_every) if bar else log_every


def _count(x: float) -> str:
    for unit, size in (("M", 1e6), ("k", 1e3)):
        if abs(x) >= size:
            return f"{x / size:.3g}{unit}"
    return f"{x:.3g}"


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    h, m, s = s // 3600, s // 60 % 60, s % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def format_line(rec: dict[str, Any], *, total: int, val: tuple[int, float] | None = None,
                eta_s: float | None = None, loss_parts: Sequence[str] = ()) -> str:
    """One plain log line of a training row of ``metrics.jsonl`` (see the module doc); ``loss_parts``: the
    objective's part names, each shown after the loss (``latent_loss`` as ``latent``)."""
    step = int(rec["step"])
    shown = [f"{name.removesuffix('_loss')} {rec[name]:.4f}" for name in loss_parts if name in rec]
    parts = [f"step {step}/{total}", f"loss {rec['loss']:.4f}" + (f" ({', '.join(shown)})" if shown else "")]
    if val is not None:
        parts.append(f"val {val[1]:.4f}" + ("" if val[0] == step else f" (step {val[0]})"))
    parts += [f"grad {rec['grad_norm']:.3g}", f"lr {rec['lr']:.2e}", f"tok/s {_count(rec['tokens_per_s'])}"]
    if "mfu" in rec:
        parts.append(f"mfu {rec['mfu']:.2f}")
    if "peak_mem_gb" in rec:
        parts.append(f"mem {rec['peak_mem_gb']:.1f} GB")
    if eta_s is not None:
        parts.append(f"eta {_duration(eta_s)}")
    if rec.get("skipped"):
        parts.append("(non-finite step skipped)")
    return "  ".join(parts)


class Console:
    """Rank 0's bar and lines for steps ``start`` -> ``end`` of a ``total``-step schedule: ``update()`` after
    each step, ``row(rec)`` for every row logged (training and hooks), ``end_step(step)`` once a step's rows
    are all in. A no-op off rank 0."""

    def __init__(self, *, total: int, start: int, end: int, log_every: int, progress: bool, rank: int = 0,
                 out: IO[str] | None = None, err: IO[str] | None = None) -> None:
        self.out, err = out or sys.stdout, err or sys.stderr
        self.active = rank == 0
        on_terminal = self.active and progress and err.isatty()
        self.bar = tqdm(total=total, initial=start, desc="train", unit="step", disable=not on_terminal, file=err)
        self.every = line_every(log_every, on_terminal)
        self.total, self.start, self.end = total, start, end
        self.t0 = time.perf_counter()
        self.pending: dict[str, Any] | None = None  # the step's training row, printed at end_step
        self.val: tuple[int, float] | None = None
        self.loss_parts: tuple[str, ...] = ()

    def update(self) -> None:
        self.bar.update(1)

    def row(self, rec: dict[str, Any], loss_parts: Sequence[str] = ()) -> None:
        """A row logged; ``loss_parts``: the names of the loss parts a training row holds (shown by name)."""
        if loss_parts:
            self.loss_parts = tuple(loss_parts)
        if "val_loss" in rec:
            self.val = (int(rec["step"]), float(rec["val_loss"]))
        elif "loss" in rec and "grad_norm" in rec:  # a training row
            self.pending = rec
            self.bar.set_postfix(loss=f"{rec['loss']:.4f}", lr=f"{rec['lr']:.2e}", tok_s=f"{rec['tokens_per_s']:.0f}")

    def end_step(self, step: int) -> None:
        rec, self.pending = self.pending, None
        if not self.active or rec is None or int(rec["step"]) != step:
            return
        if step % self.every and step != self.end and not rec.get("skipped"):
            return
        done = step - self.start
        eta = (time.perf_counter() - self.t0) / done * (self.end - step) if done > 0 else None
        line = format_line(rec, total=self.total, val=self.val, eta_s=eta, loss_parts=self.loss_parts)
        if self.bar.disable:
            print(line, file=self.out, flush=True)
        else:
            self.bar.write(line, file=self.out)  # clears the bar, writes the line, draws the bar again
            self.out.flush()

    def close(self) -> None:
        self.bar.close()
