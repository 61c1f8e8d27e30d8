"""The 30-layer activation-checkpointing runs of ``float8_h200.sh``'s ``ac`` stage in one JSON, and the
fastest setting whose peak memory stays under a limit (printed, for the ``wan5b`` stage).

    python benchmarks/pick_checkpointing.py OUT --limit-gb 125 --out OUT/train_step_30l_ac_h200.json

Reads ``OUT/ac_*.json`` (one ``train_step.py`` run each, ``--variants pack-float8-tensorwise``, set ``ref``).
A setting that failed (out of memory) is kept with its error; prints ``true`` when none fits.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def pick(runs: dict[str, dict], limit_gb: float) -> str:
    """The fastest setting with a peak under ``limit_gb`` (``true``, every block checkpointed, when none)."""
    fits = {k: r for k, r in runs.items() if r.get("tokens_per_s") and (r.get("peak_mem_gb") or 1e9) <= limit_gb}
    return max(fits, key=lambda k: fits[k]["tokens_per_s"]) if fits else "true"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("folder", type=Path)
    p.add_argument("--limit-gb", type=float, default=125.0)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    runs, meta = {}, {}
    for f in sorted(args.folder.glob("ac_*.json")):
        d = json.loads(f.read_text())
        entry = {k: v for k, v in d.get("ref", {}).items() if k.startswith("pack-")}
        r = next(iter(entry.values()), {"error": "no result"})
        runs[f.stem.removeprefix("ac_")] = r
        meta = {k: d.get(k) for k in ("device", "date", "torch", "layers", "bf16_matmul_tflops")}
    chosen = pick(runs, args.limit_gb)
    args.out.write_text(json.dumps({**meta, "limit_gb": args.limit_gb, "chosen": chosen, "settings": runs}, indent=1))
    print(chosen)


if __name__ == "__main__":
    main()
