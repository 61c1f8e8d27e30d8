"""Plot ``memory_budget.py --stage quality``'s JSON: the loss per step of each low-memory option and LoRA beside
full AdamW, smoothed (raw faint), with each end against AdamW's in the legend.

    python benchmarks/plot_memory_quality.py benchmarks/results/memory_quality_cpu.json [--out PNG]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from plot_float8_loss import smooth  # noqa: E402

LABELS = {"adamw": "AdamW (fp32 states)", "8bit": "AdamW 8-bit states", "4bit": "AdamW 4-bit states",
          "offload": "AdamW on the host", "lora": "LoRA"}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("json", type=Path)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    d = json.loads(args.json.read_text())
    ends = d.get("summary", {})
    fig, ax = plt.subplots(figsize=(7, 4))
    spec = {}
    for name, run in d["runs"].items():
        if not run.get("losses"):
            continue
        spec = run.get("spec", spec)
        ys = run["losses"]
        steps = range(1, len(ys) + 1)
        end = "" if name == "adamw" or name not in ends else f" ({ends[name]:+.2%} at the end)"
        line, = ax.plot(steps, smooth(ys, max(1, len(ys) // 20)), label=LABELS.get(name, name) + end)
        ax.plot(steps, ys, color=line.get_color(), alpha=0.2, linewidth=0.8)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (smoothed; raw faint)")
    ax.set_title(f"{spec.get('layers', '?')}-layer LingBot-VA, {spec.get('max_tokens', '?')} tokens/pack, "
                 f"{d['device']}")
    ax.legend()
    fig.tight_layout()
    out = args.out or args.json.with_suffix(".png")
    fig.savefig(out, dpi=120)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
