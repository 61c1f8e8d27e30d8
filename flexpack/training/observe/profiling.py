"""Step profiling: ``profile.steps = n`` (or the environment variable ``LINGBOT_PROFILE=n``).

With ``n > 0`` the train loop profiles ``n`` whole optimizer steps with ``torch.profiler`` after
``profile.warmup`` (default 2) steps of warm-up (compilation, allocator growth) plus one
profiler warm-up step, and writes to ``RUN/profile/``:

    steps_rank{r}.jsonl   one line per micro-step of the warm-up and profiled steps: step, micro_step,
                          phase, tokens (computed, pad included), valid_tokens, episodes, fwd_s, bwd_s,
                          fwd_bwd_s, peak_mem_bytes (device peak of the micro-step; process RSS peak on CPU)
    summary_rank{r}.json  shares of device time (CPU op time without a GPU) per category (attention,
                          gemm, elementwise, communication, optimizer, other; they sum to 1), MFU on CUDA
                          (useful FLOPs of :mod:`flexpack.training.observe.flops` over the bf16 peak; null
                          elsewhere), tokens/s, named-range times, the kernel table of the last step
    trace_rank{r}.json    chrome trace (chrome://tracing or https://ui.perfetto.dev) with the ranges
                          ``data``, ``forward``, ``backward``, ``optimizer``, ``block_mask``, ``attention``
    top_ops_rank{r}.txt   the kernel (op) table of the last profiled step as text

If the run has fewer steps left than warm-up + n, one line says so and what there is is profiled
(at least one whole step). On a machine without a GPU the profiler's GPU probe is kept quiet.
``0``: off (every hook is a no-op). Files are written atomically. Token counts, copies and useful
FLOPs come from the run (:meth:`StepProfiler.for_training`, :mod:`flexpack.run.root`).

The variables ``LINGBOT_PROFILE`` and ``LINGBOT_PROFILE_WARMUP`` stay for runs started without
touching the config: ``flexpack train`` reads them (:func:`flexpack.commands.train.profile_env`) into
``profile.env_steps`` / ``profile.env_warmup``, which win over their keys (rank 0 prints one line where
they differ) and are saved with the run's config; this module reads the config alone. The peak behind
MFU is ``profile.peak_tflops`` (measured at the start when unset), the same figure as ``metrics.jsonl``'s ``mfu``.
"""

from __future__ import annotations

import json
import os
import re
import resource
import sys
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch
from torch.autograd.profiler import record_function
from torch.profiler import ProfilerActivity, profile, schedule

from flexpack.atomic import atomic_path
from flexpack.training.observe import profile_summary as ps

if TYPE_CHECKING:
    from flexpack.run.config_sections import ProfileConfig, RuntimeConfig

ENV, ENV_WARMUP = "LINGBOT_PROFILE", "LINGBOT_PROFILE_WARMUP"


def plan(steps: int, warmup: int, steps_left: int | None, source: str = ENV) -> tuple[int, int, int, str | None]:
    """(warm-up steps, profiler warm-up steps, profiled steps, note) fitting ``steps_left``.

    Whole steps only: profiled steps are cut first down to one, then the warm-ups. The note names
    ``source``, where ``steps`` came from (the variable or the config key)."""
    if steps_left is None or steps_left >= warmup + 1 + steps:
        return warmup, 1, steps, None
    if steps_left <= 0:
        return 0, 0, 0, f"{source}={steps}: the run has no steps left to profile"
    active = max(1, min(steps, steps_left - warmup - 1))
    rest = steps_left - active
    prof_warm = min(1, rest)
    warm = min(warmup, rest - prof_warm)
    note = (f"{source}={steps}: the run has {steps_left} step(s) left, fewer than {warmup} warm-up + 1 profiler "
            f"warm-up + {steps}; profiling {active} step(s) after {warm} + {prof_warm} warm-up")
    return warm, prof_warm, active, note


class _RSS:
    """Peak resident memory of the process (CPU): Linux resets its high-water mark on request."""

    def reset(self) -> None:
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass  # then the peak is the process's peak so far (ru_maxrss)

    def peak(self) -> int:
        try:
            match = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
            if match:
                return int(match.group(1)) * 1024
        except OSError:
            pass
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


class StepProfiler:
    """Hooks of the train loop: :meth:`step` at the top of every optimizer step, :meth:`phase` at
    each change of what the step does (``"data"``, ``"forward"`` with the micro-batch,
    ``"backward"``, ``"optimizer"``, ``None`` = between phases), inside ``with StepProfiler(...)``.

    Args:
        out_dir: the run folder (files go to ``out_dir/profile``).
        steps, warmup: profiled and warm-up steps (warm-up default 2 where ``steps`` > 0, else 0).
        steps_left: optimizer steps the run will do (the window is fitted into them).
        first_step: the run's step count before the first hooked step (steps are logged 1-based after it).
        tokens_per_frame, copies: computed tokens of a micro-batch = frames × tokens_per_frame × copies.
        flops: useful FLOPs of one micro-batch, ``flops(layout, step)`` with the 0-based optimizer step (for MFU
            on CUDA); None: no MFU.
        peak_tflops: the bf16 peak MFU is measured against (``profile.peak_tflops``); None: measured.
        source: where ``steps`` came from, for the note of a run too short for the window.
        device: where the step runs (CUDA: device time and peak memory; else CPU op time and RSS).
    """

    def __init__(self, out_dir: str | os.PathLike, rank: int = 0, steps: int = 0, warmup: int | None = None,
                 *, steps_left: int | None = None, first_step: int = 0, tokens_per_frame: int = 1, copies: int = 1,
                 flops: Callable[[Any, int], float] | None = None, device: torch.device | str | None = None,
                 peak_tflops: float | None = None, source: str = "profile.steps") -> None:
        self.steps = steps
        self.warmup = (2 if self.steps else 0) if warmup is None else warmup
        self.dir, self.rank = Path(out_dir) / "profile", rank
        self.first_step, self.tpf, self.copies, self.flops = first_step, tokens_per_frame, copies, flops
        self.peak_tflops = peak_tflops
        self.written: list[Path] = []
        self.note: str | None = None
        self._prof: profile | None = None
        self._calls = 0  # step() calls so far
        self.records: list[dict[str, Any]] = []  # micro-step lines
        self._step_times: list[float] = []  # seconds of each hooked step, in order
        self._open: Any = None
        self._micro: dict[str, Any] | None = None
        if self.steps <= 0:
            return
        self.device = torch.device(device) if device is not None else torch.device(
            "cuda" if torch.cuda.is_available() else "cpu")
        self.cuda = self.device.type == "cuda"
        warm, prof_warm, active, self.note = plan(self.steps, self.warmup, steps_left, source)
        if active == 0:
            self._print_note()
            return
        self.warmup, self.prof_warmup, self.active = warm, prof_warm, active
        self.timed = warm + prof_warm + active  # steps with micro-step lines
        if not self.cuda:
            # libkineto probes for GPUs and logs "gpuGetDeviceCount failed" to stderr without one
            os.environ.setdefault("KINETO_LOG_LEVEL", "5")
        self._rss = _RSS()
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "won't be using warmup" when a short run leaves none
            sched = schedule(skip_first=warm, wait=0, warmup=prof_warm, active=active, repeat=1)
        self._prof = profile(activities=activities, schedule=sched, on_trace_ready=self._write,
                             record_shapes=False, acc_events=True)

    @classmethod
    def for_training(cls, runtime: RuntimeConfig, profile: ProfileConfig, rank: int, *, steps_left: int,
                     first_step: int, model: Any, geometry: Any, device: torch.device,
                     objective: Any) -> "StepProfiler":
        """The profiler of :func:`flexpack.training.loop.train`: steps, warm-up and the peak from the config's
        ``profile`` section (:meth:`~flexpack.run.config_sections.ProfileConfig.window`: ``LINGBOT_PROFILE`` /
        ``_WARMUP`` as ``flexpack train`` read them win), the trace folder and the seed from its ``runtime``
        section; token counts, copies and FLOPs from the run's model config, token geometry and objective
        (:class:`~flexpack.run.root.Run`)."""
        from flexpack.training.observe.flops import UsefulFlops

        flops = UsefulFlops(model, geometry, objective=objective, seed=runtime.seed)

        steps, warmup, source = profile.window()  # the variables flexpack train read win (profile.env_*)
        return cls(runtime.out_dir, rank, steps, warmup, steps_left=steps_left, first_step=first_step,
                   tokens_per_frame=geometry.tokens_per_frame, copies=geometry.copies, flops=flops, device=device,
                   peak_tflops=profile.peak_tflops, source=source)

    @property
    def enabled(self) -> bool:
        return self._prof is not None

    def __enter__(self) -> "StepProfiler":
        if self._prof is not None:
            self._print_note()
            self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        if self._prof is not None:
            self.phase(None)
            prof, self._prof = self._prof, None
            try:
                if 0 < self._calls <= self.timed:  # the run ended inside the window: close its last step
                    self._end_step()
                prof.__exit__(*exc)  # writes the window's files if it was recording
            except Exception:
                if exc[0] is None:
                    raise  # else the run's own error is the one to see

    def _print_note(self) -> None:
        if self.note and self.rank == 0:
            print(self.note, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ hooks
    def step(self) -> None:
        """A new optimizer step starts (call at the top of every step)."""
        if self._prof is None:
            return
        self.phase(None)
        if 0 < self._calls <= self.timed:
            self._end_step()
        if self._calls > 0:
            self._prof.step()  # the first step began with __enter__
        self._calls += 1
        self._t0 = time.perf_counter()

    def phase(self, name: str | None, batch: Any = None) -> None:
        """The step enters phase ``name`` (a named range in the trace); ``"forward"`` with its
        micro-batch starts a micro-step line, which the next phase after ``"backward"`` closes."""
        if self._prof is None or not 0 < self._calls <= self.timed:
            return
        # counting reads the layout (a device sync on CUDA): before the marks, outside the timings
        counts = self._counts(batch) if name == "forward" else None
        mark = self._mark()
        if self._open is not None:
            self._open.__exit__(None, None, None)
            self._open = None
        m = self._micro
        if m is not None and m["backward"] is not None:
            m["end"] = mark
            m["peak_mem_bytes"] = torch.cuda.max_memory_allocated(self.device) if self.cuda else self._rss.peak()
            self._micro = None
        if name == "forward":
            if self.cuda:
                torch.cuda.reset_peak_memory_stats(self.device)
            else:
                self._rss.reset()
            self._micro = self._new_micro(counts, mark)
        elif name == "backward" and m is not None:
            m["backward"] = mark
        if name is not None:
            self._open = record_function(name)
            self._open.__enter__()

    # ------------------------------------------------------------------ internals
    def _mark(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _seconds(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def _counts(self, batch: Any) -> dict[str, Any]:
        lay = batch.layout
        lay = lay.on_host() if hasattr(lay, "on_host") else lay  # the CPU copy it was moved from: no GPU wait
        return {"tokens": lay.frame_doc.numel() * self.tpf * self.copies,
                "valid_tokens": int(lay.episode_frames.sum()) * self.tpf * self.copies,
                "episodes": int(lay.episode_frames.numel()),
                "useful_flops": float(self.flops(batch.layout, self.first_step + self._calls - 1))
                if self.flops is not None else None}

    def _new_micro(self, counts: dict[str, Any], mark: Any) -> dict[str, Any]:
        k = self._calls - 1
        step = self.first_step + k + 1
        rec = {"step": step, "micro_step": sum(r["step"] == step for r in self.records),
               "phase": "profiled" if k >= self.warmup + self.prof_warmup else "warmup",
               **counts, "forward": mark, "backward": None, "end": None}
        self.records.append(rec)
        return rec

    def _end_step(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self._step_times.append(time.perf_counter() - self._t0)

    def _lines(self) -> list[dict[str, Any]]:
        out = []
        for r in self.records:
            if r["end"] is None:
                continue  # a micro-step cut short by an exception
            line = {k: v for k, v in r.items() if k not in ("forward", "backward", "end")}
            line["fwd_s"] = self._seconds(r["forward"], r["backward"])
            line["bwd_s"] = self._seconds(r["backward"], r["end"])
            line["fwd_bwd_s"] = line["fwd_s"] + line["bwd_s"]
            out.append(line)
        return out

    def _write(self, prof: profile) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        self.phase(None)
        if self._calls <= self.timed and len(self._step_times) < self._calls:
            self._end_step()  # the window's last step closes with the run
        self.dir.mkdir(parents=True, exist_ok=True)
        r = self.rank
        lines = self._lines()
        files = {"steps": self.dir / f"steps_rank{r}.jsonl", "summary": self.dir / f"summary_rank{r}.json",
                 "trace": self.dir / f"trace_rank{r}.json", "top": self.dir / f"top_ops_rank{r}.txt"}
        with atomic_path(files["steps"]) as tmp:
            tmp.write_text("".join(json.dumps(x) + "\n" for x in lines))
        with atomic_path(files["trace"]) as tmp:
            prof.export_chrome_trace(str(tmp))
        summary = self.summarize(prof.events(), lines)
        with atomic_path(files["summary"]) as tmp:
            tmp.write_text(json.dumps(summary, indent=2) + "\n")
        unit = "kernel" if self.cuda else "op"
        header = (f"{self.active} profiled step(s) after {self.warmup} + {self.prof_warmup} warm-up; "
                  f"{'device' if self.cuda else 'CPU op'} time of the last profiled step by {unit}\n")
        with atomic_path(files["top"]) as tmp:
            tmp.write_text(header + ps.format_table(summary["kernels"], unit) + "\n")
        self.written = list(files.values())

    def summarize(self, events: Any, lines: list[dict[str, Any]]) -> dict[str, Any]:
        """The summary of the profiled window from its events and micro-step lines."""
        from flexpack.training.observe.flops import peak_flops

        events = list(events)
        units = ps.extract_units(events, device_time=self.cuda)
        windows = ps.step_windows(events)
        last = windows[-1] if windows else (float("-inf"), float("inf"))
        seconds = ps.categories(units)
        profiled = [x for x in lines if x["phase"] == "profiled"]
        first_profiled = self.warmup + self.prof_warmup
        wall = sum(self._step_times[first_profiled:first_profiled + self.active])
        tokens = sum(x["tokens"] for x in profiled)
        valid = sum(x["valid_tokens"] for x in profiled)
        flops = sum(x["useful_flops"] or 0.0 for x in profiled) if self.flops is not None else None
        peak = peak_flops(self.device, self.peak_tflops) if self.cuda else None
        mfu = flops / (wall * peak) if (self.cuda and peak and flops and wall > 0) else None
        return {
            "time_base": "cuda kernels" if self.cuda else "cpu ops",
            "device": str(self.device),
            "profiled_steps": [self.first_step + first_profiled + i + 1 for i in range(self.active)],
            "warmup_steps": self.warmup + self.prof_warmup,
            "note": self.note,
            "categories": ps.shares(seconds),
            "category_seconds": seconds,
            "step_seconds": self._step_times[first_profiled:first_profiled + self.active],
            "tokens_per_s": tokens / wall if wall > 0 else None,
            "valid_tokens_per_s": valid / wall if wall > 0 else None,
            "useful_flops": flops,
            "peak_flops": peak,
            "mfu": mfu,
            "ranges": ps.range_seconds(events),
            "kernels": ps.kernel_table([u for u in units if last[0] <= u.start_us <= last[1]]),
        }


# every hook a no-op (callers without a profiler); reads no environment at import
NO_PROFILER = StepProfiler("", steps=0, warmup=0)
