r"""A run stopped on N ranks and resumed on N/2: its data order, exactly, and its losses.

Three stages, the first two under torchrun (NCCL on GPUs, gloo on the CPU); a small WanVA over in-memory
episodes (:class:`~flexpack.run.memory_data.RandomEpisodes`, 256 episodes of 1-10 latent frames), one
20-frame pack a rank and step:

    torchrun --nproc_per_node N   benchmarks/resume_multigpu.py first DIR    # A: S steps; B: stopped after K; C = B
    torchrun --nproc_per_node N/2 benchmarks/resume_multigpu.py second DIR   # B and C resumed to the epoch's end
    python benchmarks/resume_multigpu.py check DIR --out resume.json         # the comparison, exit 1 on a mismatch

``check`` compares, as ``tests/test_resume.py`` does on 2 CPU ranks: B's first K steps with the uninterrupted A
(episodes equal, losses to ``--tol``); B's resumed micro-batches on every new rank with what that rank's sampler
yields from the checkpoint's sampler state (exactly: the data order is a pure function of seed, epoch and what
was consumed); the episodes before and after the stop cover epoch 0 once; and the two resumes from the same
checkpoint (B and its copy C) with each other (episodes equal, losses bit for bit where the kernels are
deterministic; the largest relative difference is recorded either way). ``--smoke``: on the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexpack.run.compose import run_for  # noqa: E402
from flexpack.run.config import TrainConfig, from_dict  # noqa: E402
from flexpack.run.memory_data import RandomEpisodes  # noqa: E402

STEPS, STOP = 6, 2  # A's steps; B stops after STOP


def config(out: Path, steps: int, device: str) -> TrainConfig:
    over = {"in_channels": 16, "text_dim": 32, "action_channels": 6}
    if device == "cpu":
        over["attn_backend"] = "dense"
    return from_dict(TrainConfig, {
        "data": {"mode": "pack", "max_tokens": 100, "action_steps": 4},  # 20 frames of 1 video + 4 action tokens
        "model": {"preset": "tiny", "overrides": over},
        "optim": {"lr": 1e-3, "accum_steps": 1, "grad_clip": 1.0},
        "schedule": {"steps": steps, "warmup_steps": 2, "rewarmup_steps": 0},
        "checkpoint": {"every": 0}, "log": {"progress": False, "every": 1},
        "runtime": {"out_dir": str(out), "device": device},
        "parallel": {"compile": False},
    })


def episodes() -> RandomEpisodes:
    rng = random.Random(7)
    return RandomEpisodes([rng.randint(1, 10) for _ in range(256)], channels=16, hw=(2, 2), action_channels=6,
                          action_steps=4, text_len=8, text_dim=32)


def train_job(out: Path, name: str, steps: int, device: str, stop_after: int | None = None) -> None:
    from flexpack.training.loop import train

    rank, size = dist.get_rank(), dist.get_world_size()
    cfg = config(out / name, steps, device)
    dev = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else torch.device("cpu")
    res = train(run_for(episodes(), cfg, rank=rank, world_size=size, device=dev), stop_after=stop_after)
    facts = {"start_step": res.start_step, "step": res.step, "losses": res.losses, "episodes": res.episodes,
             "world_size": size}
    stage = "second" if res.start_step else "first"
    (out / f"{name}.{stage}.rank{rank}.json").write_text(json.dumps(facts))


def remaining(out: Path, name: str, world: int) -> tuple[int, list[list[list[int]]], dict]:
    """(batches per rank left in the checkpoint's epoch at ``world`` ranks, each rank's expected batches, the
    checkpoint's sampler state)."""
    from flexpack.run.state import checkpoint

    ckpt = checkpoint.latest(out / name / "checkpoints")
    state = json.loads((ckpt / "train_state.json").read_text())["sampler"]
    run = run_for(episodes(), config(out / name, STEPS, "cpu"))
    expected = []
    for r in range(world):
        sampler, _ = run.batching(episodes().lengths(), rank=r, world_size=world)
        sampler.load_state_dict(state)
        expected.append([list(b) for b in sampler])
    return len(expected[0]), expected, state


def first(out: Path, device: str) -> None:
    train_job(out, "A", STEPS, device)
    train_job(out, "B", STEPS, device, stop_after=STOP)
    if dist.get_rank() == 0:
        shutil.copytree(out / "B", out / "C")
    dist.barrier()


def second(out: Path, device: str) -> None:
    left, expected, state = remaining(out, "B", dist.get_world_size())
    if dist.get_rank() == 0:  # what each new rank must train, read from the stop's checkpoint before any resume
        (out / "expected.json").write_text(json.dumps({"batches": expected, "sampler": state}))
    for name in ("B", "C"):
        train_job(out, name, STOP + left, device)


def check(out: Path, tol: float) -> dict:
    def load(name: str, stage: str) -> list[dict]:
        files = sorted(out.glob(f"{name}.{stage}.rank*.json"), key=lambda f: int(f.name.split("rank")[1][:-5]))
        return [json.loads(f.read_text()) for f in files]

    a, b1, b2, c2 = load("A", "first"), load("B", "first"), load("B", "second"), load("C", "second")
    n_old, n_new = len(b1), len(b2)
    saved = json.loads((out / "expected.json").read_text())
    expected, state = saved["batches"], saved["sampler"]

    def rel(x: list[float], y: list[float]) -> float:
        return max((abs(p - q) / max(abs(q), 1e-12) for p, q in zip(x, y)), default=0.0)

    before = [e for r in b1 for mb in r["episodes"] for e in mb]
    after = [e for r in b2 for mb in r["episodes"] for e in mb]
    epoch = set(range(len(episodes())))
    res = {
        "old_world": n_old, "new_world": n_new, "stop_after": STOP, "resumed_steps": b2[0]["step"] - STOP,
        "prefix_episodes_equal": all(b1[r]["episodes"] == a[r]["episodes"][:STOP] for r in range(n_old)),
        "prefix_loss_max_rel_diff": rel(b1[0]["losses"], a[0]["losses"][:STOP]),
        "resumed_order_exact": all(b2[r]["episodes"] == expected[r] for r in range(n_new)),
        "epoch_covered_once": set(before).isdisjoint(after) and set(before) | set(after) == epoch,
        "resumes_episodes_equal": all(b2[r]["episodes"] == c2[r]["episodes"] for r in range(n_new)),
        "resumes_loss_max_rel_diff": rel(b2[0]["losses"], c2[0]["losses"]),
        "resumes_losses_bit_equal": b2[0]["losses"] == c2[0]["losses"],
        "start_step": b2[0]["start_step"], "losses_finite": all(torch.isfinite(torch.tensor(r["losses"])).all()
                                                               for r in (*b1, *b2)),
        "sampler_epoch": state.get("epoch"), "tol": tol,
    }
    res["ok"] = bool(res["prefix_episodes_equal"] and res["prefix_loss_max_rel_diff"] <= tol
                     and res["resumed_order_exact"] and res["epoch_covered_once"] and res["resumes_episodes_equal"]
                     and res["resumes_loss_max_rel_diff"] <= tol and res["start_step"] == STOP
                     and res["losses_finite"] and n_new * 2 == n_old)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("stage", choices=("first", "second", "check"))
    p.add_argument("dir", type=Path, help="folder of the runs and the per-rank records")
    p.add_argument("--smoke", action="store_true", help="on the CPU over gloo")
    p.add_argument("--tol", type=float, default=1e-5, help="check: largest relative loss difference accepted")
    p.add_argument("--out", type=Path, default=None, help="check: JSON of the comparison")
    args = p.parse_args()
    if args.stage == "check":
        res = check(args.dir, args.tol)
        print(json.dumps(res, indent=1))
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(res, indent=1))
        raise SystemExit(0 if res["ok"] else 1)
    device = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    if device == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if device == "cuda" else "gloo")
    args.dir.mkdir(parents=True, exist_ok=True)
    try:
        (first if args.stage == "first" else second)(args.dir, device)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
