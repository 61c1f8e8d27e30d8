"""``flexpack train`` against its bare step, on the same in-memory packs (``train_step.py``'s ``loop-*`` variants).

The loop runs ``flexpack.training.loop.train(run)`` exactly as the CLI does — DataLoader
with workers and pinned memory, collate per step, noise seeds, the step guard, the meter, logging
every 10 steps — on ``train_step.py``'s synthetic episodes (made per item in the workers, as a
dataset reads them). The first logged window holds the compile; the second covers the packs the
matching ``pack-*`` variant timed (``train_step.py`` has it time the loop's steps ``log_every`` to
``2·log_every - 1``), and ``loop_vs_step`` is that window's tokens/s over the bare step's on the same
packs (``same_packs`` records that they were; the issue's target is ≥ 0.97). ``tokens_per_s`` is the
median over all measured windows. The final checkpoint is not written: a 5B-shape save is not part of
a step.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
from dataclasses import replace

import torch

from flexpack.run.compose import run_for
from flexpack.run.state import checkpoint
from flexpack.training import loop


def run_loop(args, name: str, lengths: list[int], items, device: torch.device, cfg, peak: float,
             bare_packs: list[list[int]] | None = None) -> dict:
    log_every = args.loop_log_every
    steps = log_every * (1 + max(1, args.loop_steps // log_every))  # a compile window + the measured ones
    out = tempfile.mkdtemp(prefix="flexpack-loop-")
    cfg = replace(cfg, schedule=replace(cfg.schedule, steps=steps, warmup_steps=1),
                  checkpoint=replace(cfg.checkpoint, every=0),
                  data=replace(cfg.data, num_workers=0 if args.smoke else 4),
                  runtime=replace(cfg.runtime, out_dir=out),
                  log=replace(cfg.log, every=log_every, tensorboard=False, progress=False),
                  profile=replace(cfg.profile, peak_tflops=peak / 1e12 if device.type == "cuda" else None))
    run = run_for(items, cfg, device=device)  # what `flexpack train` builds: geometry, sampler, collate, options
    save = checkpoint.Checkpointer.save
    checkpoint.Checkpointer.save = lambda self, *a, **k: None  # no 5B-shape save at the end: not a step
    try:
        result = loop.train(run)
    finally:
        checkpoint.Checkpointer.save = save
        shutil.rmtree(out, ignore_errors=True)
    rows = result.metrics[1:] or result.metrics
    med = {k: statistics.median(r[k] for r in rows)
           for k in ("tokens_per_s", "step_s", "peak_mem_gb", "mfu") if k in rows[0]}
    window = result.episodes[log_every: 2 * log_every]  # the packs of the first measured window
    same = bare_packs is not None and [sorted(b) for b in window] == [sorted(map(int, b)) for b in bare_packs]
    windows = [r["tokens_per_s"] for r in result.metrics]
    return {**med, "steps": steps, "log_every": log_every, "windows": windows, "same_packs": same,
            "same_window_tokens_per_s": windows[1] if same and len(windows) > 1 else None,
            "losses": [r["loss"] for r in result.metrics], "float8": cfg.parallel.float8,
            "activation_checkpointing": cfg.parallel.activation_checkpointing}
