"""Metrics a user can watch: TensorBoard event files under ``RUN/tb/`` and, with ``log.wandb``,
Weights & Biases. ``metrics.jsonl`` stays the source of truth: every numeric key of each of its
records is logged as it is (a key added to the record later shows up without a change here);
nested tables are logged as ``key/subkey``.

Tags are grouped as dashboards expect them: ``train/…`` (loss parts, lr, grad norm, throughput),
``val/…`` (``val_loss`` -> ``val/loss``) and ``sample/…`` (``sample_*`` or ``sample/*`` keys).

Only rank 0 logs. W&B reads its usual environment (``WANDB_MODE=offline`` needs no account;
``wandb sync RUN/wandb/offline-run-*`` uploads later). Its run id is stored in ``RUN/wandb_run_id``
on the first start; every resume of the run folder continues that W&B run (``resume="allow"``)
instead of starting a new one. ``log.wandb_project`` / ``wandb_entity`` / ``wandb_tags`` pass through.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Iterator

import numpy as np

if TYPE_CHECKING:
    from flexpack.run.config_sections import LogConfig


def _numeric(rec: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    for key, value in rec.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _numeric(value, f"{name}/")
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            yield name, float(value)


def scalars(rec: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of a metrics record, ``step`` excluded (it is the x axis)."""
    return {k: v for k, v in _numeric(rec) if k != "step"}


GROUPS = ("train", "val", "sample")


def group(key: str) -> str:
    """The tag of a metrics key: ``val_loss`` -> ``val/loss``, ``sample_mse`` -> ``sample/mse``,
    ``val/loss`` and ``sample/...`` kept, everything else under ``train/``."""
    head = key.split("/", 1)[0]
    if head in GROUPS:
        return key
    for g in GROUPS[1:]:
        if key.startswith(f"{g}_"):
            return f"{g}/{key[len(g) + 1:]}"
    return f"train/{key}"


WANDB_ID_FILE = "wandb_run_id"


def wandb_run_id(run: Path) -> str:
    """The run folder's W&B run id: the stored one, or a new one stored now (atomically)."""
    from flexpack.atomic import atomic_path

    path = run / WANDB_ID_FILE
    if path.is_file():
        stored = path.read_text().strip()
        if stored:
            return stored
    import secrets

    new = secrets.token_hex(4)  # W&B ids: short, [a-z0-9]
    run.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        tmp.write_text(new + "\n")
    return new


def check(log: LogConfig) -> None:
    """Fail before any data or model work when a logger the config's ``log`` section asks for is not installed."""
    r = log
    if r.tensorboard:
        try:
            import tensorboard  # noqa: F401
        except ImportError:
            raise ValueError("log.tensorboard = true needs the tensorboard package: pip install tensorboard "
                             "(or set log.tensorboard = false)") from None
    if r.wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ValueError("log.wandb = true needs the wandb package: pip install 'flexpack[wandb]' "
                             "(or set log.wandb = false)") from None


class MetricSinks:
    """The run's one metrics writer: ``with MetricSinks(run, cfg.log, rank=r, start_step=s) as sinks:
    sinks.log(row)`` appends the row to ``RUN/metrics.jsonl`` (an append-only log, one JSON object per line) and
    sends its numbers to TensorBoard / W&B where the ``log`` section turns those on (``config``: the run's config as a
    dict, W&B's record of the run). Only rank 0 writes; elsewhere ``log`` does nothing."""

    def __init__(self, run: str | os.PathLike, log: LogConfig, *, config: dict[str, Any] | None = None, rank: int = 0,
                 start_step: int = 0) -> None:
        self.run, self.rank, self.start = Path(run), rank, start_step
        self.log_config, self.config = log, config
        self.tb: Any = None
        self.wandb: Any = None

    @property
    def tb_dir(self) -> Path:
        return self.run / "tb"

    def __enter__(self) -> "MetricSinks":
        if self.rank != 0:
            return self
        check(self.log_config)
        r = self.log_config
        if r.tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            # after a resume, steps past the checkpoint logged by the interrupted run are dropped
            self.tb = SummaryWriter(str(self.tb_dir), purge_step=self.start + 1, flush_secs=10)
        if r.wandb:
            import wandb

            self.wandb = wandb.init(project=r.wandb_project, entity=r.wandb_entity or None,
                                    tags=list(r.wandb_tags) or None, dir=str(self.run), name=self.run.name,
                                    id=wandb_run_id(self.run), resume="allow", config=self.config)
        return self

    def log(self, rec: dict[str, Any]) -> None:
        if self.rank != 0:
            return
        self.run.mkdir(parents=True, exist_ok=True)
        with open(self.run / "metrics.jsonl", "a") as f:
            f.write(json.dumps(rec) + "\n")
        values = {group(k): v for k, v in scalars(rec).items()}
        step = int(rec["step"])
        if self.tb is not None:
            for key, value in values.items():
                self.tb.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(values, step=step)

    def log_images(self, step: int, images: dict[str, str | os.PathLike]) -> None:
        """Log PNG files (``{tag: path}``, e.g. the sampler's action plots) at ``step``: TensorBoard
        ``add_image`` (HWC uint8 RGB) and, with W&B on, ``wandb.Image``. A no-op off rank 0."""
        if self.tb is None and self.wandb is None:
            return
        from PIL import Image

        if self.tb is not None:
            for tag, path in images.items():
                with Image.open(path) as im:
                    self.tb.add_image(tag, np.asarray(im.convert("RGB")), int(step), dataformats="HWC")
            self.tb.flush()  # images are logged rarely; make them visible now, not after flush_secs
        if self.wandb is not None:
            import wandb

            self.wandb.log({tag: wandb.Image(str(path)) for tag, path in images.items()}, step=int(step))

    def __exit__(self, *exc) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wandb is not None:
            self.wandb.finish(exit_code=1 if exc and exc[0] is not None else 0)
            self.wandb = None


def outputs(run: str | os.PathLike, checkpoint: Path | None, log: LogConfig) -> str:
    """Where a finished ``train`` left its outputs, one line each (``log``: the config's section)."""
    run = Path(run)
    rows = [("run folder", str(run)), ("metrics", str(run / "metrics.jsonl"))]
    if log.tensorboard:
        rows.append(("tensorboard", f"{run / 'tb'}  (tensorboard --logdir {run / 'tb'})"))
    if log.wandb:
        rows.append(("wandb", str(run / "wandb")))
    if (run / "profile").is_dir():
        rows.append(("profile", str(run / "profile")))
    if (run / "samples").is_dir():
        rows.append(("samples", f"{run / 'samples'}  (sample.every)"))
    rows.append(("checkpoint", str(checkpoint) if checkpoint else "none"))
    rows.append(("plot", f"flexpack plot {run}"))
    if checkpoint:
        rows.append(("sample", f"flexpack sample {run}"))
    return "\n".join(f"  {name:<12} {value}" for name, value in rows)
