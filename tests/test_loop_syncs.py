"""The train loop reads the step's device results (loss parts, gradient norm) on the host at logged
steps only: on a GPU every such read waits for the GPU, and a wait per step leaves the GPU idle
while the host queues the next step."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot")

from flexpack.training import step as step_mod  # noqa: E402
from flexpack.training.config import load_config  # noqa: E402
from flexpack.training.loop import train  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
READS = {"item", "tolist", "__float__", "__int__", "__bool__", "__index__", "cpu", "numpy", "__format__", "__repr__"}


class _Watched(torch.Tensor):
    """A device result: host reads of it, or of anything computed from it, are recorded."""

    reads: list[tuple[int, str]] = []
    step = 0

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS:
            cls.reads.append((cls.step, name))
        return super().__torch_function__(func, types, args, kwargs or {})


def test_host_reads_of_step_results_happen_at_logged_steps_only(one_thread, monkeypatch, tiny_dataset, tmp_path):
    accumulate, clip = step_mod.accumulate, torch.nn.utils.clip_grad_norm_

    def watched_accumulate(*a, **k):
        _Watched.step += 1  # the optimizer step now running (1-based)
        return accumulate(*a, **k).as_subclass(_Watched)

    monkeypatch.setattr(step_mod, "accumulate", watched_accumulate)
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", lambda *a, **k: clip(*a, **k).as_subclass(_Watched))
    _Watched.reads, _Watched.step = [], 0
    cfg = load_config(CONFIGS / "tiny_cpu.toml", [
        f'data.root="{tiny_dataset}"', f'runtime.out_dir="{tmp_path / "run"}"', "runtime.progress=false",
        "data.max_tokens=60", "checkpoint.every=0", "runtime.tensorboard=false", "schedule.steps=7", "runtime.log_every=3"])
    result = train(cfg)
    assert [m["step"] for m in result.metrics] == [3, 6, 7]
    read_at = {s for s, _ in _Watched.reads}
    assert read_at == {3, 6, 7}, _Watched.reads  # the logged steps (and the last), never the others
