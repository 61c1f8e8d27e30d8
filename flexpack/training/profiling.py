"""Step profiling switched on by the environment: ``LINGBOT_PROFILE=n``.

With ``n > 0`` the train loop profiles ``n`` optimizer steps with ``torch.profiler`` after
``LINGBOT_PROFILE_WARMUP`` (default 2) steps of warm-up (compilation, allocator growth) plus one
profiler warm-up step, then writes to ``RUN/profile/``:

    trace_rank{r}.json    chrome trace (open in chrome://tracing or https://ui.perfetto.dev)
    top_ops_rank{r}.txt   the top ops by self time (CUDA time on GPU, CPU time otherwise)

``0`` or unset: off (a no-op object, no profiler overhead). Files are written atomically.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from flexpack.atomic import atomic_path

ENV, ENV_WARMUP = "LINGBOT_PROFILE", "LINGBOT_PROFILE_WARMUP"


def _env_int(name: str, default: int) -> int:
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"{name} must be a non-negative integer, got {text!r}") from None
    if value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {text!r}")
    return value


class StepProfiler:
    """Call :meth:`step` once per optimizer step inside ``with StepProfiler(...)``."""

    def __init__(self, out_dir: str | os.PathLike, rank: int = 0, steps: int | None = None, warmup: int | None = None) -> None:
        self.steps = _env_int(ENV, 0) if steps is None else steps
        self.warmup = _env_int(ENV_WARMUP, 2) if warmup is None else warmup
        self.dir = Path(out_dir) / "profile"
        self.rank = rank
        self.written: list[Path] = []
        self._prof: profile | None = None
        if self.steps > 0:
            cuda = torch.cuda.is_available()
            self._sort = "self_cuda_time_total" if cuda else "self_cpu_time_total"
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
            self._prof = profile(
                activities=activities,
                schedule=schedule(skip_first=self.warmup, wait=0, warmup=1, active=self.steps, repeat=1),
                on_trace_ready=self._write,
                record_shapes=True,
                acc_events=True,  # one cycle only; silences the per-cycle clearing warning
            )

    @property
    def enabled(self) -> bool:
        return self._prof is not None

    def __enter__(self) -> "StepProfiler":
        if self._prof is not None:
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._prof is not None:
            self._prof.__exit__(*exc)

    def step(self) -> None:
        if self._prof is not None:
            self._prof.step()

    def _write(self, prof: profile) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        trace = self.dir / f"trace_rank{self.rank}.json"
        with atomic_path(trace) as tmp:
            prof.export_chrome_trace(str(tmp))
        table = prof.key_averages().table(sort_by=self._sort, row_limit=30)
        top = self.dir / f"top_ops_rank{self.rank}.txt"
        with atomic_path(top) as tmp:
            tmp.write_text(f"{self.steps} profiled step(s) after {self.warmup} + 1 warm-up, sorted by {self._sort}\n{table}\n")
        self.written = [trace, top]
