"""Training the lingbot-va family: `flexpack train configs/tiny_cpu.toml` on the demo's data with LeRobot's
objective, resume, `flexpack verify` (packed == each episode alone; dropped doc ids caught), no recompiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot")

from flexpack.commands.train import train  # noqa: E402
from flexpack.families.lingbot.objective import LingbotObjective  # noqa: E402
from flexpack.flow.noise import noise_seeds  # noqa: E402
from flexpack.run.compose import run_for  # noqa: E402
from flexpack.run.memory_data import RandomEpisodes  # noqa: E402
from flexpack.training.step import accumulate  # noqa: E402
from helpers import TINY, run_cli, set_args, tiny_config, tiny_sets  # noqa: E402

LINGBOT = ["model.family=lingbot-va", "model.preset=lingbot-va-tiny"]
pytestmark = pytest.mark.usefixtures("one_thread")


def losses(run: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()
            if '"loss"' in line]


def test_train_resume_and_verify_on_the_demo_data(tiny_dataset, tmp_path, capsys) -> None:
    """The CLI trains the tiny config as it stands (its overrides mapped onto the family); a run stopped
    and resumed gives the uninterrupted run's losses; verify passes on the trained weights and fails
    with --drop-packing."""
    held = ["data.val_episodes=[5]", "validation.every=2"]  # the validation loss runs the family's objective too
    sets = [*tiny_sets(tiny_dataset, tmp_path / "a", "schedule.steps=4", "schedule.rewarmup_steps=0", *held), *LINGBOT]
    code, err = run_cli(capsys, "train", str(TINY), *set_args(sets))
    assert code == 0, err
    full = losses(tmp_path / "a")
    assert len(full) == 4 and all(torch.isfinite(torch.tensor(full)))
    saved = json.loads((tmp_path / "a" / "config.json").read_text())["model"]
    assert (saved["family"], saved["mask"]) == ("lingbot-va", "lingbot")
    rows = [json.loads(x) for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    val = [r["val_loss"] for r in rows if "val_loss" in r]
    assert len(val) == 2 and all(v > 0 for v in val)
    cfg = tiny_config(tiny_dataset, tmp_path / "b", "schedule.steps=4", "schedule.rewarmup_steps=0", *held, *LINGBOT)
    first = train(cfg, stop_after=2)
    second = train(cfg)
    assert (first.step, second.start_step, second.step) == (2, 2, 4)
    assert first.losses + second.losses == pytest.approx(full, rel=1e-5)
    verify = ["verify", str(TINY), *set_args(sets), "--checkpoint", str(tmp_path / "b")]
    code, err = run_cli(capsys, *verify)
    assert code == 0, err
    code, err = run_cli(capsys, *verify, "--drop-packing")
    assert code == 1, err


def _items_run(lengths, *extra):
    cfg = tiny_config("unused", "unused", *LINGBOT, "data.max_tokens=100", *extra)
    ds = RandomEpisodes(lengths, channels=48, hw=(2, 2), action_channels=30, action_steps=4, text_len=5, text_dim=64)
    return run_for(ds, cfg), ds


def test_the_step_draws_chunk_and_window_per_episode_and_matches_the_objective() -> None:
    """The step runs LeRobot's objective (the run's LingbotObjective) with chunk sizes and windows drawn per
    episode from the family's ranges, and its accumulated loss is the objective's loss of the pack."""
    run, ds = _items_run([6, 5, 4, 3], "model.overrides.window_range=[0, 3]")
    assert isinstance(run.objective, LingbotObjective)
    batch = run.collate([ds[i] for i in range(4)])
    sample = run.objective.sample(batch, noise_seeds(batch.layout, 0, 0))
    lo, hi = run.model_config.chunk_range
    assert sample.chunk_size.shape == (4,) and int(sample.chunk_size.min()) >= lo and int(sample.chunk_size.max()) <= hi
    assert int(sample.window.max()) <= 3 and len(set(sample.window.tolist())) > 1  # one per episode
    torch.manual_seed(0)
    model = run.build_model()
    parts = accumulate(model, [batch], run, step=0)
    with torch.no_grad():
        again = run.objective.loss(run.forward(model, sample), sample, batch)
    assert float(parts[0]) == pytest.approx(float(again.loss), rel=1e-5)
    assert all(p.grad is not None for n, p in model.named_parameters() if p.requires_grad)
    assert all(p.grad is None for n, p in model.named_parameters() if n.startswith("action_text_embed"))


class _Counting:
    """A torch.compile backend that counts graphs and runs them eagerly (no inductor: fast on the CPU)."""

    def __init__(self) -> None:
        self.n = 0

    def backend(self, gm, example_inputs):
        self.n += 1
        return gm.forward


def test_no_recompiles_across_lengths_chunks_and_windows(monkeypatch) -> None:
    """Compiled blocks (parallel.compile) in pack mode: steps over packs of other episode lengths, with other
    chunk sizes and windows drawn per episode, reuse the one block graph."""
    import flexpack.parallel.parallelize as par

    counter = _Counting()
    monkeypatch.setattr(par, "BLOCK_GRAPHS", counter)
    run, ds = _items_run([9, 7, 6, 5, 4, 3, 3, 2, 2, 1], "parallel.compile=true")
    model = run.build_model()
    assert run.parallel.compile
    seen, counts = set(), []
    packs = list(run.sampler)
    assert len(packs) >= 3
    for step, indices in enumerate(packs):
        batch = run.collate([ds[i] for i in indices])
        sample = run.objective.sample(batch, noise_seeds(batch.layout, run.config.runtime.seed, step))
        seen.add((tuple(batch.layout.episode_frames.tolist()), tuple(sample.chunk_size.tolist()),
                  tuple(sample.window.tolist())))
        accumulate(model, [batch], run, step=step)
        model.zero_grad(set_to_none=True)
        counts.append(counter.n)
    assert len(seen) == len(packs)  # other lengths, chunks and windows every step
    assert counts[0] >= 1 and counts[-1] == counts[0], counts
