"""Sampling media: action plots, latent strips, side-by-side mp4, PSNR, Wan VAE decode of cached
latents, and PNGs logged to TensorBoard / W&B."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from flexpack.training import tracking
from flexpack.training.config import load_config


def _png(path: Path, h: int, w: int, seed: int = 0) -> tuple[Path, np.ndarray]:
    rgb = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    Image.fromarray(rgb).save(path)
    return path, rgb


def test_log_images_writes_the_png_into_the_tensorboard_event_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    png, rgb = _png(tmp_path / "plot.png", 20, 30)
    cfg = load_config(None, ["runtime.tensorboard=true"])
    with tracking.MetricSinks(tmp_path / "run", cfg) as sinks:
        sinks.log_images(7, {"sample/actions": png})
    acc = EventAccumulator(str(tmp_path / "run" / "tb"), size_guidance={"images": 0})
    acc.Reload()
    assert acc.Tags()["images"] == ["sample/actions"]
    (event,) = acc.Images("sample/actions")
    assert (event.step, event.width, event.height) == (7, 30, 20)
    import io

    back = np.asarray(Image.open(io.BytesIO(event.encoded_image_string)).convert("RGB"))
    np.testing.assert_array_equal(back, rgb)  # TensorBoard stores PNG: lossless


def test_log_images_goes_to_wandb_as_images_and_only_on_rank_0(tmp_path, monkeypatch):
    logged: list = []

    class FakeRun:
        def log(self, values, step):
            logged.append((step, values))

        def finish(self, exit_code=0):
            pass

    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(init=lambda **kw: FakeRun(), Image=lambda p: ("img", p)))
    png, _ = _png(tmp_path / "a.png", 8, 8)
    cfg = load_config(None, ["runtime.wandb=true", "runtime.tensorboard=false"])
    with tracking.MetricSinks(tmp_path / "run", cfg) as sinks:
        sinks.log_images(3, {"sample/a": png})
    with tracking.MetricSinks(tmp_path / "run1", cfg, rank=1) as sinks:
        sinks.log_images(3, {"sample/a": png})
    assert logged == [(3, {"sample/a": ("img", str(png))})]
