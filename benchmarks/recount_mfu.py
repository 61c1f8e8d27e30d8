r"""A run's logged MFU recounted with today's useful-FLOP count, from its folder and its dataset (CPU, no model).

Runs of the ``lingbot-va`` family logged before its count learned the lingbot mask (``Objective.attention_pairs``)
counted self-attention as the document mask's n² over both copies, which overstates MFU. This replays the run's
sampler (``config.json``: the same seed, the same epochs) over the same dataset, counts every logged window's
micro-batches both ways (:class:`flexpack.training.observe.flops.UsefulFlops` for the step that trained them, and
the document-mask count), and scales each window's logged ``mfu`` by their ratio: the seconds and the peak of the
run stay as they were measured. The replay checks itself: each window's tokens must be the ones the run logged
(``tokens_per_s`` × ``step_s`` × its steps), else it stops. For runs logged with the current count (lingbot-va
runs from the commit that added ``Objective.attention_pairs`` on) the logged ``mfu`` is already the recount.

    python benchmarks/recount_mfu.py RUN [--data-root DIR] [--out recount.json]

A run that resumed or holds episodes out is refused (its stream of batches is not the replay's).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexpack.run.compose import build_run  # noqa: E402
from flexpack.run.config import TrainConfig, from_dict  # noqa: E402
from flexpack.training.observe.flops import UsefulFlops, batch_flops  # noqa: E402


def recount(run_dir: Path, data_root: str | None = None) -> dict:
    for name in ("config.json", "metrics.jsonl"):
        if not (run_dir / name).is_file():
            raise SystemExit(f"{run_dir}: no {name} here; give a flexpack run folder")
    d = json.loads((run_dir / "config.json").read_text())
    if data_root:
        d["data"]["root"] = data_root
    d["runtime"]["device"], d["data"]["num_workers"] = "cpu", 0
    cfg = from_dict(TrainConfig, d)
    if cfg.data.val_fraction or cfg.data.val_episodes:
        raise SystemExit(f"{run_dir}: the run holds episodes out; this replay covers runs that train on all")
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "mfu" in r]
    every = cfg.log.every
    if not rows or rows[0]["step"] != every:
        raise SystemExit(f"{run_dir}: metrics.jsonl must start at step {every} with an mfu (a run from step 0)")
    run = build_run(cfg, device=torch.device("cpu"))
    useful = UsefulFlops(run.model_config, run.geometry, objective=run.objective, seed=cfg.runtime.seed)
    last = rows[-1]["step"]
    new = [0.0] * len(rows)
    old = [0.0] * len(rows)
    tokens = [0] * len(rows)
    step, micro, sampler = 0, 0, run.sampler
    while step < last:
        epoch = sampler.epoch
        for idx in sampler:
            lay = run.collate([run.dataset[i] for i in idx]).layout
            w = step // every
            new[w] += useful(lay, step)
            old[w] += batch_flops(run.model_config, run.geometry, lay)
            tokens[w] += int(lay.episode_frames.sum()) * run.geometry.tokens_per_frame
            micro += 1
            if micro % cfg.optim.accum_steps == 0:
                step += 1
            if step >= last:
                break
        sampler.set_epoch(epoch + 1)
    prev = [0] + [r["step"] for r in rows[:-1]]
    for r, p, t in zip(rows, prev, tokens):
        logged = r["tokens_per_s"] * r["step_s"] * (r["step"] - p)
        if abs(t - logged) > 0.005 * logged:
            raise SystemExit(f"{run_dir}: the replay's window to step {r['step']} has {t} tokens, the run logged "
                             f"{logged:.0f}: not the run's stream of batches (other data or config?)")
    windows = [{"step": r["step"], "mfu_logged": r["mfu"], "flops_ratio": n / o, "mfu": r["mfu"] * n / o}
               for r, n, o in zip(rows, new, old)]
    later = windows[1:] or windows  # the first window holds the compile
    return {"run": str(run_dir), "family": cfg.model.family, "windows": windows,
            "mfu_median_after_first": statistics.median(w["mfu"] for w in later),
            "mfu_logged_median_after_first": statistics.median(w["mfu_logged"] for w in later)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("run", type=Path, help="the run folder (config.json, metrics.jsonl)")
    p.add_argument("--data-root", default=None, help="where its dataset is now (default: data.root of its config)")
    p.add_argument("--out", type=Path, default=None, help="write the JSON here too")
    args = p.parse_args()
    res = recount(args.run, args.data_root)
    text = json.dumps(res, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")


if __name__ == "__main__":
    main()
