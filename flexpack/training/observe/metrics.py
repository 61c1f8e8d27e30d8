"""Throughput figures of the train loop's logged steps: tokens/s, step time, peak memory, MFU.

Measured over the window of steps since the previous log, ending at a device synchronization, so
no step waits for the GPU to be timed (timing each step would put a sync on every step). Tokens per
frame, copies and useful FLOPs come from the run's token geometry (:mod:`flexpack.run.root`,
:class:`flexpack.training.observe.flops.UsefulFlops`), the same count the profiler and benchmarks use.
"""

from __future__ import annotations

import resource
import sys
import time
from typing import Any, Sequence

import torch

from flexpack.models.registry import ModelShape
from flexpack.packing.geometry import TokenGeometry
from flexpack.packing.grids import real_tokens
from flexpack.run.config_sections import ProfileConfig
from flexpack.training.observe.flops import UsefulFlops, peak_flops


class StepMeter:
    """Accumulates the steps of one logging window; :meth:`read` closes it. ``model`` and
    ``geometry`` and ``objective``: the run's (:mod:`flexpack.run.root`), so FLOPs count its copies and mask;
    ``profile``: the config's section (the peak); ``seed``: ``runtime.seed``."""

    def __init__(self, profile: ProfileConfig, device: torch.device, *, seed: int, model: ModelShape,
                 geometry: TokenGeometry, objective: Any) -> None:
        self.device = device
        self.tpf, self.nv = geometry.tokens_per_frame, geometry.video_tokens
        self.peak = peak_flops(device, profile.peak_tflops)
        self.useful = UsefulFlops(model, geometry, objective=objective, seed=seed)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        self._open()

    def _open(self) -> None:
        self.t0, self.steps, self.valid_tokens, self.flops = time.perf_counter(), 0, 0, 0.0

    def add(self, batches: Sequence[Any], step: int) -> None:
        """Count the micro-batches of optimizer step ``step`` (0-based, as ``train_step`` got it; host-side
        layouts: no device work)."""
        self.steps += 1
        for b in batches:
            self.valid_tokens += real_tokens(b.layout.on_host(), self.tpf, self.nv)  # spatial padding left out
            if self.peak is not None:
                self.flops += self.useful(b.layout, step)

    def read(self) -> dict[str, Any]:
        """``tokens_per_s``, ``step_s``, ``peak_mem_gb`` and (CUDA) ``peak_reserved_gb`` (what the caching allocator
        held: the figure a memory budget or a per-process cap must cover) and ``mfu`` of the window; starts the
        next."""
        reserved = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            peak_mem = torch.cuda.max_memory_allocated(self.device) / 1e9
            reserved = torch.cuda.max_memory_reserved(self.device) / 1e9
            torch.cuda.reset_peak_memory_stats(self.device)
        else:  # the process's resident-set peak (KiB on Linux, bytes on macOS)
            rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            peak_mem = rss / (1e9 if sys.platform == "darwin" else 1e6)
        seconds = max(time.perf_counter() - self.t0, 1e-9)
        step_s = seconds / max(self.steps, 1)
        out = {"tokens_per_s": self.valid_tokens / seconds, "step_s": step_s, "peak_mem_gb": peak_mem}
        if reserved is not None:
            out["peak_reserved_gb"] = reserved
        if self.peak is not None:
            out["mfu"] = self.flops / seconds / self.peak
        self._open()
        return out
