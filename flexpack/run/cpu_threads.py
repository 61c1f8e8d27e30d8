"""Threads of a CPU run: torch's intra-op pool sized for the model, said in one line.

torch starts one intra-op thread per core. The tiny models' ops (a few thousand multiply-adds per token)
are done before the pool's threads have woken up; on shared cores those threads mostly wait for each
other (on a loaded 2-core machine the demo's model trained at 580-1,350 tokens/s on one thread, 21-73 on
two, torch's default there).
``runtime.cpu_threads`` decides, for train, verify and sample on a CPU device:

- ``"auto"`` (default): where ``OMP_NUM_THREADS`` is set, it decides and nothing is changed or said;
  else one thread for a model of fewer than :data:`SMALL_MODEL` parameters, and torch's default (one per
  core) for a larger one;
- a number N >= 1: N threads, whatever ``OMP_NUM_THREADS`` says.

Either choice is printed in one line (stderr) naming how to change it. A CUDA device is left alone.
:func:`cpu_threads` sets the count for a block and restores torch's afterwards (a library caller's
process keeps its own setting).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import torch
from torch import nn

SMALL_MODEL = 10_000_000  # parameters: below, ops are too small for a thread pool to pay off


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g}{unit}"
    return str(n)


def choose(setting: int | str, params: int, cores: int, env: str | None) -> tuple[int | None, str]:
    """(threads to set or None to leave torch's, why) for ``runtime.cpu_threads = setting``, a model of
    ``params`` parameters, ``cores`` usable cores and the value of ``OMP_NUM_THREADS``."""
    if setting != "auto":
        return int(setting), f"runtime.cpu_threads = {setting}"
    if env:
        return None, f"OMP_NUM_THREADS={env}"
    why = f"runtime.cpu_threads = \"auto\", a model of {_count(params)} parameters"
    return (1 if params < SMALL_MODEL else cores), why


def set_cpu_threads(setting: int | str, device: torch.device, model: nn.Module, *, say: bool = True) -> int | None:
    """Apply :func:`choose` on a CPU ``device``; prints the one line where ``say``. Returns the thread count
    set (None: nothing changed)."""
    if device.type != "cpu":
        return None
    params = sum(p.numel() for p in model.parameters())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads, why = choose(setting, params, cores, os.environ.get("OMP_NUM_THREADS"))
    if threads is None:
        return None
    torch.set_num_threads(threads)
    if say:
        print(f"cpu: {threads} torch thread{'s' if threads != 1 else ''} ({why}); set runtime.cpu_threads = N or "
              "OMP_NUM_THREADS=N to choose", file=sys.stderr)
    return threads


@contextlib.contextmanager
def cpu_threads(setting: int | str, device: torch.device, model: nn.Module, *, say: bool = True
                ) -> Iterator[int | None]:
    """:func:`set_cpu_threads` for the block; torch's thread count is restored after it."""
    before = torch.get_num_threads()
    threads = set_cpu_threads(setting, device, model, say=say)
    try:
        yield threads
    finally:
        if threads is not None:
            torch.set_num_threads(before)
