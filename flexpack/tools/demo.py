"""The closing block of ``make demo``: what ran, where each output is, what to try next.

    python -m flexpack.commands.demo_summary OUT [--bin .venv/bin]

Lists only outputs that exist (a step that did not run leaves no line): the dataset with its
latent cache and pooled statistics, the run folder, its newest checkpoint, ``metrics.jsonl``,
``metrics.png``, ``tb/``, the sampler-statistics PNGs, and any sampling outputs under the run
(``samples/**/metrics.json`` and their PNGs); then, per sampling, the held-out forecast's action and
latent MSE against both baselines (:func:`forecast_table`).
"""

from __future__ import annotations

import json
from pathlib import Path


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def _last_losses(metrics: Path) -> str:
    """The first and last logged loss, as ``loss 1.23 -> 0.45 over N steps``; "" when unreadable."""
    records = []
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a killed run
        if isinstance(rec, dict) and isinstance(rec.get("loss"), (int, float)):
            records.append(rec)
    if not records:
        return ""
    first, last = records[0], records[-1]
    return f"loss {first['loss']:.4g} (step {first['step']}) -> {last['loss']:.4g} (step {last['step']})"


def forecast_table(metrics: Path) -> list[str]:
    """Lines of the model's action and latent MSE against both baselines from a sample's metrics.json
    (its first sample, the mean of its K samples, the ratio to the better baseline); [] when unreadable."""
    try:
        m = json.loads(metrics.read_text())
        b, k = m["baselines"], int(m.get("samples", 1))
        rows = []
        for what in ("action", "latent"):
            key = f"{what}_mse"
            if not isinstance(m.get(key), (int, float)) or m[key] != m[key]:  # no actions: NaN
                continue
            best = min(b["last"][key], b["mean"][key])
            rows.append(f"  {what + ' MSE':<11} {m[key]:>9.3g} {m.get(key + '_kmean', m[key]):>11.3g} "
                        f"{b['last'][key]:>11.3g} {b['mean'][key]:>9.3g} {m[key] / best:>12.2g}x")
        head = (f"Held-out forecast, {m['horizon']} latent frames ahead ({len(m['pair_list'])} cut points x {k} "
                f"sample(s), {_rel(metrics)}):")
        cols = f"  {'':<11} {'model':>9} {f'mean of {k}':>11} {'last':>11} {'mean':>9} {'model/best':>13}"
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError):
        return []
    return [head, cols, *rows,
            "  last: the last context action / latent frame repeated; mean: the dataset's mean action / the "
            "context's mean latent;", "  model: one sample (its noise fixed by --seed); mean of K: the mean of K "
            "samples (see docs/USAGE.md, 'Reading the numbers')"]


def outputs(out: Path, run: Path, data: Path) -> list[tuple[str, str]]:
    """(label, where) for every demo output that exists."""
    from flexpack.run.state import checkpoint

    rows: list[tuple[str, str]] = []
    if data.is_dir():
        rows.append(("dataset", f"{_rel(data)}  (LeRobot v3, synthetic)"))
        if (data / "latents").is_dir():
            rows.append(("latent cache", _rel(data / "latents")))
        if (data / "latents" / "stats.json").is_file():
            rows.append(("action stats", f"{_rel(data / 'latents' / 'stats.json')}  (exact over all frames)"))
    if run.is_dir():
        rows.append(("run folder", _rel(run)))
        found = checkpoint.latest(run / "checkpoints")
        if found is not None:
            rows.append(("checkpoint", _rel(found)))
        metrics = run / "metrics.jsonl"
        if metrics.is_file():
            losses = _last_losses(metrics)
            rows.append(("metrics", _rel(metrics) + (f"  ({losses})" if losses else "")))
        if (run / "metrics.png").is_file():
            rows.append(("plot", _rel(run / "metrics.png")))
        if (run / "tb").is_dir():
            rows.append(("tensorboard", f"{_rel(run / 'tb')}  (tensorboard --logdir {_rel(run / 'tb')})"))
        for m in sorted(run.glob("samples/**/metrics.json")):
            rows.append(("sample metrics", _rel(m)))
            rows += [("sample plot", _rel(p)) for p in sorted(m.parent.glob("*.png"))]
            videos = sorted(m.parent.glob("*.mp4"))
            if videos:  # one per sampled episode: name the first, count them
                more = f"  (and {len(videos) - 1} more beside it)" if len(videos) > 1 else ""
                rows.append(("sample video", _rel(videos[0]) + more))
    for png in sorted(out.glob("stats_*.png")):
        rows.append(("sampler stats", _rel(png)))
    return rows


def summary(out: str | Path, *, run: str | Path | None = None, data: str | Path | None = None,
            bin_dir: str = ".venv/bin") -> str:
    out = Path(out)
    run = Path(run) if run is not None else out / "demo-run"
    data = Path(data) if data is not None else out / "demo-data"
    rows = outputs(out, run, data)
    tables = [t for m in sorted(run.glob("samples/**/metrics.json")) if (t := forecast_table(m))]
    width = max((len(label) for label, _ in rows), default=0)
    fp = f"{bin_dir}/flexpack"
    lines = [
        "",
        "== flexpack demo: done ==",
        "What ran: a synthetic LeRobot dataset -> its latent cache (pool encoder) and pooled action statistics",
        "-> a small WanVA (configs/tiny_cpu.toml) trained on CPU in pack mode, a quarter of the episodes held",
        "out -> packed == per-episode check -> forecasts of the held-out episodes (several samples each) against",
        "two baselines -> sampler statistics of the demo's own episodes.",
        "",
        "Outputs:",
        *(f"  {label:<{width}}  {where}" for label, where in rows),
        "",
        *(line for t in tables for line in (*t, "")),
        f"`flexpack` lives in {bin_dir}/: run `source {bin_dir}/activate` to use the README's commands as",
        f"written, or call {fp} directly. Try next:",
        f"  {fp} check-dataset {_rel(data)}          # problems, and what normalization clips per action dimension",
        f"  {fp} train configs/tiny_cpu.toml --set data.root={_rel(data)} --set runtime.out_dir={_rel(run)} "
        "--set data.val_fraction=0.25 --set schedule.steps=400   # resumes and trains on",
        f"  {fp} export {_rel(run)} {_rel(out / 'demo-export')}"
        "          # diffusers folder, model card, LeRobot-style policy",
        f"  {fp} stats --frames-file data/episode_frames_ref.txt --mode pack --max-tokens 65536 --world-size 8"
        "   # packing at Wan2.2-5B scale",
        "  docs/USAGE.md, 'Train on your data': the same steps on a LeRobot dataset with the real Wan2.2 VAE.",
    ]
    return "\n".join(lines)
