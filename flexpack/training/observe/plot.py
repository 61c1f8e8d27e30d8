"""``flexpack plot RUN``: a PNG of the loss curves, throughput and LR / grad norm from ``RUN/metrics.jsonl``.

Keys a record lacks are left out of the figure, so older runs and records with more keys (``mfu``,
validation losses) plot alike. The PNG is written atomically (default ``RUN/metrics.png``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from flexpack.atomic import atomic_path

LOSSES = ("loss", "latent_loss", "action_loss", "val_loss", "val_latent_loss", "val_action_loss")


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a run folder's (or a file's) ``metrics.jsonl``; a torn last line (a killed run) is skipped."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path} does not exist")
    file = path / "metrics.jsonl" if path.is_dir() else path
    if not file.is_file():
        raise ValueError(f"{file} does not exist (is {path} a run folder of `flexpack train`?)")
    records = []
    lines = file.read_text().splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines):
                continue
            raise ValueError(f"{file}:{i}: not a JSON record: {line[:80]!r}") from None
        if not isinstance(rec, dict) or "step" not in rec:
            raise ValueError(f"{file}:{i}: a record needs a 'step' key, got {line[:80]!r}")
        records.append(rec)
    if not records:
        raise ValueError(f"{file} holds no records yet")
    return records


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pts = [(r["step"], r[key]) for r in records
           if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool)]
    return [p[0] for p in pts], [p[1] for p in pts]


def plot_metrics(run: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write the figure of ``run``'s metrics to ``out`` (default ``RUN/metrics.png``) and return its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = read_metrics(run)
    run = Path(run)
    out = Path(out) if out is not None else (run if run.is_dir() else run.parent) / "metrics.png"
    fig, (ax_loss, ax_tok, ax_lr) = plt.subplots(3, 1, figsize=(8, 9), sharex=True)
    for key in LOSSES:
        x, y = _series(records, key)
        if x:
            ax_loss.plot(x, y, label=key, marker="o" if "val" in key else None, markersize=3)
    if all(v > 0 for key in LOSSES for v in _series(records, key)[1]):
        ax_loss.set_yscale("log")
    ax_loss.set_ylabel("loss")
    x, y = _series(records, "tokens_per_s")
    ax_tok.plot(x, y, color="tab:green", label="tokens/s (valid)")
    ax_tok.set_ylabel("tokens / s")
    x, y = _series(records, "mfu")
    if x:  # MFU where the records carry it
        twin = ax_tok.twinx()
        twin.plot(x, [100 * v for v in y], color="tab:purple", label="MFU %")
        twin.set_ylabel("MFU %")
    for ax in (ax_loss, ax_tok):
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="upper right", fontsize=8)
    for key, color, ax in (("lr", "tab:blue", ax_lr), ("grad_norm", "tab:red", ax_lr.twinx())):
        x, y = _series(records, key)
        ax.plot(x, y, color=color, label=key)
        ax.set_ylabel(key, color=color)
    ax_lr.set_xlabel("step")
    fig.suptitle(f"{run} ({len(records)} records)", fontsize=9)
    fig.tight_layout()
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
    except OSError as exc:  # a read-only or full place: one line naming it
        raise ValueError(f"{out}: cannot write the plot ({exc.strerror or exc}); choose another --out") from None
    finally:
        plt.close(fig)
    return out
