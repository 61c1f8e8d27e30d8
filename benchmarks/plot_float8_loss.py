"""Plot ``float8_loss.py``'s JSON: the loss per step of each float8 mode beside bf16, raw and smoothed.

    python benchmarks/plot_float8_loss.py benchmarks/results/float8_loss_h200.json [--out PNG]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

LABELS = {"off": "bf16", "tensorwise": "float8 tensorwise", "rowwise": "float8 rowwise"}


def smooth(xs: list[float], k: int) -> list[float]:
    """Trailing mean over ``k`` steps (the first values average what there is)."""
    out, acc = [], 0.0
    for i, x in enumerate(xs):
        acc += x - (xs[i - k] if i >= k else 0.0)
        out.append(acc / min(i + 1, k))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", type=Path)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    d = json.loads(args.json.read_text())
    fig, ax = plt.subplots(figsize=(7, 4))
    for mode, run in d["runs"].items():
        if not run.get("losses"):
            continue
        ys = run["losses"]
        steps = range(1, len(ys) + 1)
        line, = ax.plot(steps, smooth(ys, max(1, len(ys) // 20)), label=LABELS.get(mode, mode)
                        + ("" if mode == "off" else f" ({run.get('final_rel_diff_vs_bf16', 0):+.2%} at the end)"))
        ax.plot(steps, ys, color=line.get_color(), alpha=0.2, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (smoothed; raw faint)")
    ax.set_title(f"{d['layers']}-layer Wan2.2-5B shape, {d['max_tokens']} tokens/pack, {d['device']}")
    ax.legend()
    fig.tight_layout()
    out = args.out or args.json.with_suffix(".png")
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
