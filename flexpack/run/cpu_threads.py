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

A CPU run also compiles into a TorchInductor cache of its thread count (``cpu-threads-N`` under
``TORCHINDUCTOR_CACHE_DIR``, or inductor's default folder): a compiled CPU FlexAttention kernel sizes its
per-thread scratch buffers by the thread count it was compiled for, and torch 2.11's graph cache key leaves
that count out, so a kernel cached by a one-thread run and then loaded by a two-thread one writes past its
buffers and aborts the process ("corrupted double-linked list").
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator

import torch
from torch import nn

SMALL_MODEL = 10_000_000  # parameters: below, ops are too small for a thread pool to pay off
CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
_LEAF = "cpu-threads-"


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
    """Apply :func:`choose` on a CPU ``device``, and point TorchInductor at the cache of the resulting thread
    count (:func:`inductor_cache_for`); prints the one line where ``say``. Returns the thread count set (None:
    torch's count left as it was)."""
    if device.type != "cpu":
        return None
    params = sum(p.numel() for p in model.parameters())
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    threads, why = choose(setting, params, cores, os.environ.get("OMP_NUM_THREADS"))
    if threads is not None:
        torch.set_num_threads(threads)
    os.environ[CACHE_ENV] = inductor_cache_for(torch.get_num_threads(), os.environ.get(CACHE_ENV))
    if threads is None:
        return None
    if say:
        print(f"cpu: {threads} torch thread{'s' if threads != 1 else ''} ({why}); set runtime.cpu_threads = N or "
              "OMP_NUM_THREADS=N to choose", file=sys.stderr)
    return threads


def inductor_cache_for(threads: int, current: str | None) -> str:
    """The TorchInductor cache folder for compiling at ``threads`` threads: ``cpu-threads-N`` under
    ``current`` (the value of ``TORCHINDUCTOR_CACHE_DIR``, or inductor's default folder where None), whose
    own ``cpu-threads-M`` leaf, if any, is replaced rather than nested."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    base = os.path.normpath(current or default_cache_dir())
    if os.path.basename(base).startswith(_LEAF):
        base = os.path.dirname(base)
    return os.path.join(base, f"{_LEAF}{threads}")


@contextlib.contextmanager
def cpu_threads(setting: int | str, device: torch.device, model: nn.Module, *, say: bool = True
                ) -> Iterator[int | None]:
    """:func:`set_cpu_threads` for the block; torch's thread count and the inductor cache folder are
    restored after it."""
    before, cache = torch.get_num_threads(), os.environ.get(CACHE_ENV)
    threads = set_cpu_threads(setting, device, model, say=say)
    try:
        yield threads
    finally:
        if threads is not None:
            torch.set_num_threads(before)
        if cache is None:
            os.environ.pop(CACHE_ENV, None)
        else:
            os.environ[CACHE_ENV] = cache
