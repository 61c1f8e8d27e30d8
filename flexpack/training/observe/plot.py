"""``flexpack plot RUN``: a PNG of the loss curves, held-out sample metrics, throughput and LR / grad
norm from ``RUN/metrics.jsonl``.

Losses: each training loss and its validation loss (``loss`` / ``val_loss``, ``latent_loss`` /
``val_latent_loss``, ``action_loss`` / ``val_action_loss``, and any part ``x`` an objective logs with its ``val_x``)
share a colour, training solid,
validation dashed with markers. Where the run sampled held-out episodes (``sample.every``)
one panel per stream shows the model's held-out MSE (one sample, and the mean of the samples)
against the ``last`` and ``mean`` baselines over the steps. Keys a record lacks are left out of
the figure, so older runs and records with more keys (``mfu``) plot alike. The PNG is written
atomically (default ``RUN/metrics.png``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from flexpack.atomic import atomic_path

# (training key, its validation key, colour): a pair shares the colour
LOSS_PAIRS = (("loss", "val_loss", "tab:blue"), ("latent_loss", "val_latent_loss", "tab:orange"),
              ("action_loss", "val_action_loss", "tab:purple"))
# held-out sample metrics (flexpack.sampling.hook): (key, label, style), per stream
SAMPLE_LINES = (("sample/{}_mse", "model (1 sample)", dict(color="tab:red", lw=1.6, marker="o", markersize=3)),
                ("sample/{}_mse_kmean", "model (mean of samples)", dict(color="darkred", lw=1.0, ls="--")),
                ("sample/last/{}_mse", "baseline: last", dict(color="tab:blue", lw=0.9, ls=":")),
                ("sample/mean/{}_mse", "baseline: mean", dict(color="tab:green", lw=0.9, ls=":")))


def loss_pairs(records: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    """:data:`LOSS_PAIRS`, then every other loss part the records hold by name: a key ``x`` whose validation
    twin ``val_x`` some record holds (an objective's own parts), each in a colour of its own."""
    keys = {k for r in records for k in r}
    known = {t for t, _, _ in LOSS_PAIRS}
    extra = sorted(k[4:] for k in keys if k.startswith("val_") and k[4:] not in known and k[4:] in keys)
    colours = ("tab:green", "tab:brown", "tab:pink", "tab:olive", "tab:cyan", "tab:gray")
    return [*LOSS_PAIRS, *((k, f"val_{k}", colours[i % len(colours)]) for i, k in enumerate(extra))]


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


def _positive(ys: list[float]) -> bool:
    return bool(ys) and all(v > 0 for v in ys)


def metrics_figure(records: list[dict[str, Any]], title: str = ""):
    """The figure of the module docstring (a pyplot-free matplotlib ``Figure``)."""
    from matplotlib.figure import Figure

    streams = [w for w in ("action", "latent") if _series(records, f"sample/{w}_mse")[0]]
    n = 3 + len(streams)
    fig = Figure(figsize=(8, 2.7 * n + 0.4))
    axes = fig.subplots(n, 1, sharex=True, squeeze=False)[:, 0]
    ax_loss, ax_tok, ax_lr = axes[0], axes[-2], axes[-1]
    shown: list[float] = []
    for train_key, val_key, color in loss_pairs(records):
        for key, how in ((train_key, dict(lw=1.0)), (val_key, dict(ls="--", marker="o", markersize=3, lw=1.2))):
            x, y = _series(records, key)
            if x:
                ax_loss.plot(x, y, color=color, label=f"{train_key} ({'validation' if key == val_key else 'train'})",
                             **how)
                shown += y
    if _positive(shown):
        ax_loss.set_yscale("log")
    ax_loss.set_ylabel("loss")
    for ax, what in zip(axes[1:], streams):
        ys: list[float] = []
        single = _series(records, SAMPLE_LINES[0][0].format(what))
        for key, label, style in SAMPLE_LINES:
            x, y = _series(records, key.format(what))
            if x and not ("kmean" in key and (x, y) == single):  # one sample per pair: its mean is itself
                ax.plot(x, y, label=label, **style)
                ys += y
        if _positive(ys):
            ax.set_yscale("log")
        ax.set_ylabel(f"held-out {what} MSE")
        ax.set_title(f"forecasts of held-out episodes: {what} MSE against the baselines", fontsize=8)
    x, y = _series(records, "tokens_per_s")
    ax_tok.plot(x, y, color="tab:green", label="tokens/s (valid)")
    ax_tok.set_ylabel("tokens / s")
    x, y = _series(records, "mfu")
    if x:  # MFU where the records carry it
        twin = ax_tok.twinx()
        twin.plot(x, [100 * v for v in y], color="tab:purple", label="MFU %")
        twin.set_ylabel("MFU %")
    for ax in axes[:-1]:
        if ax.get_legend_handles_labels()[0]:
            ax.legend(loc="best", fontsize=7, ncol=2)
    for key, color, ax in (("lr", "tab:blue", ax_lr), ("grad_norm", "tab:red", ax_lr.twinx())):
        x, y = _series(records, key)
        ax.plot(x, y, color=color, label=key)
        ax.set_ylabel(key, color=color)
    ax_lr.set_xlabel("optimizer step")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    return fig


def plot_metrics(run: str | os.PathLike, out: str | os.PathLike | None = None) -> Path:
    """Write the figure of ``run``'s metrics to ``out`` (default ``RUN/metrics.png``) and return its path."""
    records = read_metrics(run)
    run = Path(run)
    out = Path(out) if out is not None else (run if run.is_dir() else run.parent) / "metrics.png"
    fig = metrics_figure(records, f"{run} ({len(records)} records)")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(out) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
    except OSError as exc:  # a read-only or full place: one line naming it
        raise ValueError(f"{out}: cannot write the plot ({exc.strerror or exc}); choose another --out") from None
    return out
