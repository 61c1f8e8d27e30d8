"""lingbot-va's useful FLOPs (metrics.jsonl's ``mfu``, the profile summary, the benchmarks): self-attention on
the pairs the lingbot mask kept with the chunk sizes and windows the step drew, not the document mask's n²."""

from __future__ import annotations

import json
import sys

import pytest
import torch

from flexpack.attention.masks import dense_mask, make_mask
from flexpack.families.lingbot.objective import drawn_chunk_window, lingbot_draws
from flexpack.flow.noise import noise_seeds
from flexpack.run.memory_data import synthetic_run
from flexpack.training.observe.flops import UsefulFlops, batch_flops
from helpers import ROOT, TINY, run_cli, set_args, tiny_sets
from test_plan import _cfg

LINGBOT = ("model.family=lingbot-va", "model.preset=lingbot-va-tiny", "data.max_tokens=80",
           "model.overrides.chunk_range=[1, 3]", "model.overrides.window_range=[0, 4]")


def _batches(tmp_path, n=3):
    cfg = _cfg(tmp_path, *LINGBOT)
    run = synthetic_run(cfg, text_len=4)
    return cfg, run, [run.collate([run.dataset[i] for i in idx]) for idx, _ in zip(run.sampler, range(n))]


def test_host_draws_are_the_steps_draws(tmp_path):
    cfg, run, batches = _batches(tmp_path)
    seen = set()
    for step, b in enumerate(batches):
        seeds = noise_seeds(b.layout, cfg.runtime.seed, step)
        d = lingbot_draws(b, run.model_config, seeds)
        chunk, window = drawn_chunk_window(b.layout, run.model_config, seeds)
        assert (chunk, window) == (d.chunk_size.tolist(), d.window.tolist())
        seen |= set(zip(chunk, window))
    assert len(seen) > 1  # the draws differ between episodes: the count depends on them


def test_useful_flops_count_the_pairs_the_mask_kept(tmp_path):
    cfg, run, batches = _batches(tmp_path)
    g = run.geometry
    useful = UsefulFlops(run.model_config, g, objective=run.objective, seed=cfg.runtime.seed)
    for step, b in enumerate(batches):
        lay = b.layout
        chunk, window = drawn_chunk_window(lay, run.model_config, noise_seeds(lay, cfg.runtime.seed, step))
        tl = lay.tokens(g.video_tokens, g.action_tokens, copies=g.copies)
        kept = dense_mask(make_mask(tl, "lingbot", chunk_size=torch.tensor(chunk), window=torch.tensor(window)),
                          tl.num_tokens, tl.num_tokens)
        doc = tl.doc.view(-1)
        pairs = [int(kept[doc == e].sum()) for e in range(lay.num_episodes)]  # rows of episode e's queries
        got = useful(lay, step)
        assert got == batch_flops(run.model_config, g, lay, pairs=pairs)
        assert got < batch_flops(run.model_config, g, lay)  # the document mask's n² would overstate it
        assert useful(lay, step + 1) != got or len(set(chunk)) == 1  # another step, other draws


def test_wanva_keeps_the_document_count(tmp_path):
    cfg = _cfg(tmp_path)
    run = synthetic_run(cfg, text_len=4)
    b = run.collate([run.dataset[i] for i in next(iter(run.sampler))])
    useful = UsefulFlops(run.model_config, run.geometry, objective=run.objective, seed=0)
    assert useful(b.layout, 5) == batch_flops(run.model_config, run.geometry, b.layout)


def test_recount_replays_the_runs_batches(tiny_dataset, tmp_path, capsys):
    """benchmarks/recount_mfu.py replays a run's stream of batches (its tokens per window are the logged
    ones), scales each logged mfu by the mask's count over the document count, and refuses another stream."""
    pytest.importorskip("lerobot")

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from recount_mfu import recount

    run = tmp_path / "run"
    sets = [*tiny_sets(tiny_dataset, run, "schedule.steps=4", "log.every=2", "profile.peak_tflops=1"),
            "model.family=lingbot-va", "model.preset=lingbot-va-tiny"]
    code, err = run_cli(capsys, "train", str(TINY), *set_args(sets))
    assert code == 0, err
    got = recount(run)
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [w["step"] for w in got["windows"]] == [2, 4]
    for w, r in zip(got["windows"], rows):
        assert 0 < w["flops_ratio"] < 1 and w["mfu"] == pytest.approx(r["mfu"] * w["flops_ratio"])
    rows[1]["tokens_per_s"] *= 1.5  # not what the replay finds
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(SystemExit, match="not the run's stream"):
        recount(run)
