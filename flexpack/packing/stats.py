"""Waste, shapes and rank balance of a sampler, as a JSON-ready summary, a table and a plot.

The command over it is ``flexpack stats`` (:mod:`flexpack.commands.stats`).
"""

from __future__ import annotations

from typing import Any

from flexpack.atomic import atomic_path
from flexpack.packing.batch_sampler import SamplerStats


def summary(lengths: list[int], st: SamplerStats, *, mode: str, source: str, parameters: dict[str, Any],
            seconds: float) -> dict[str, Any]:
    """One JSON-ready dict of a sampler's statistics (what ``flexpack stats --json`` prints)."""
    d = st.to_dict()
    hist: dict[int, int] = {}
    for f in d.pop("padded_frames"):
        hist[f] = hist.get(f, 0) + 1
    fill = d.pop("fill")
    return {"mode": mode, "source": source, "episodes": len(lengths),
            "parameters": parameters, **d, "shapes": [list(s) for s in st.shapes],
            "min_fill": min(fill), "padded_frames_histogram": {str(k): v for k, v in sorted(hist.items())},
            "plan_seconds": round(seconds, 4)}


def table(s: dict[str, Any]) -> str:
    """The human-readable table of a :func:`summary`."""
    rows = [
        ("mode", s["mode"]), ("episodes", s["episodes"]),
        ("parameters", " ".join(f"{k}={v}" for k, v in s["parameters"].items())),
        ("waste", f"{100 * s['waste']:.2f} %  (repeats counted as waste: {100 * s['waste_incl_repeats']:.2f} %)"),
        ("distinct shapes", s["distinct_shapes"]),
        ("micro-batches", f"{s['micro_batches']} ({s['batches_per_rank']} per rank)"),
        ("samples", f"{s['samples']} ({s['repeated_samples']} repeated, {s['dropped_samples']} dropped)"),
        ("rank imbalance", f"{s['rank_imbalance']:.4f}"),
        ("tokens", f"{s['tokens_used']:,} used / {s['tokens_computed']:,} computed"),
    ]
    if "grid_padding" in s:  # datasets of smaller latent grids, padded to the run's (not in the waste above)
        rows.append(("grid padding", f"{100 * s['grid_padding']:.2f} % of the items' video tokens"))
    return "\n".join(f"{k:<16} {v}" for k, v in rows)


def write_plot(path: str, lengths: list[int], st: SamplerStats, title: str) -> None:
    """Length histogram and per-micro-batch fill, written atomically as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.hist(lengths, bins=40, color="tab:blue")
    a.set(xlabel="latent frames F", ylabel="episodes", title=f"{len(lengths)} episodes")
    b.bar(range(len(st.fill)), st.fill, width=1.0, color="tab:green")
    b.set(xlabel="micro-batch (step-major)", ylabel="tokens used / computed", ylim=(0, 1.05),
          title=f"fill, waste {100 * st.waste:.2f} %, {st.distinct_shapes} shape(s)")
    fig.suptitle(title)
    fig.tight_layout()
    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, format="png", dpi=100)
    finally:
        plt.close(fig)
