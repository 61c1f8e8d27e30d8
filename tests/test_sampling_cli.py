"""``flexpack sample`` end to end on a short trained run, its bad inputs, and ``sample.every``."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot")

from flexpack.cli import main  # noqa: E402
from flexpack.commands.train import train  # noqa: E402
from flexpack.run.compose import compose  # noqa: E402
from flexpack.run.config import load_config  # noqa: E402
from helpers import tiny_sets  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
pytestmark = pytest.mark.usefixtures("one_thread")
KEYS = ("action_mse", "action_mse_raw", "latent_mse")


def _sets(root, out, *more):
    return tiny_sets(root, out, "data.val_episodes=[0, 2]", "log.tensorboard=false", *more)


@pytest.fixture(scope="module")
def trained(tiny_dataset, tmp_path_factory):
    run = tmp_path_factory.mktemp("sample") / "run"
    train(load_config(CONFIGS / "tiny_cpu.toml", _sets(tiny_dataset, run, "schedule.steps=3", "optim.ema_decay=0.5")))
    return tiny_dataset, run


def _cli(capsys, *argv):
    try:
        code = main(["sample", *map(str, argv)])
    except SystemExit as exc:
        code = exc.code
    cap = capsys.readouterr()
    return code, cap.out, cap.err


def test_sample_writes_metrics_plots_and_a_table(trained, tmp_path, capsys):
    root, run = trained
    out = tmp_path / "out"
    code, stdout, err = _cli(capsys, run, "--checkpoint", run, "--val", "--out", out, "--steps", 3, "--plots", 1,
                             "--cuts", 2, "--horizon", 2, "--min-context", 1, "--samples", 1)
    assert code == 0, err
    m = json.loads((out / "metrics.json").read_text())
    for k in KEYS:
        assert m[k] > 0 and m["baselines"]["last"][k] >= 0 and m["baselines"]["mean"][k] >= 0
    assert m["episodes"] == [0, 2] and m["steps"] == 3 and m["mode"] == "forecast"
    assert m["pair_list"] == [[0, 1, 2], [0, 8, 2], [2, 1, 2], [2, 4, 2]]  # 10 and 6 latent frames, 2 cuts each
    assert len(m["action_mse_per_dim"]) == 6 and len(m["action_mse_per_step"]) == 2
    assert m["action_names"] == ["a0", "a1", "a2", "a3", "a4", "a5"]  # the dataset's names, in per_dim order
    assert m["model_calls"] == 2 * 3  # pairs of 3, 10, 3, 6 frames in 12-frame packs (60 tokens): 2 packs
    assert (out / "episode_000000_actions.png").is_file() and (out / "episode_000000_latents.png").is_file()
    assert not (out / "episode_000002_actions.png").exists()  # --plots 1
    assert "action_mse" in stdout and "last" in stdout and str(out / "metrics.json") in stdout
    per = m["per_episode"]
    assert set(per) == {"0", "2"} and per["0"]["pairs"] == per["2"]["pairs"] == 2
    # the headline is the element-weighted mean of the episodes' (same horizon, all actions real: equal weights)
    assert m["latent_mse"] == pytest.approx((per["0"]["latent_mse"] + per["2"]["latent_mse"]) / 2)
    assert m["seed"] == 0

    code, _, err = _cli(capsys, run, "--checkpoint", run, "--val", "--out", tmp_path / "seed1", "--steps", 3,
                        "--plots", 0, "--cuts", 2, "--horizon", 2, "--seed", 1, "--min-context", 1, "--samples", 1)
    assert code == 0, err
    m1 = json.loads((tmp_path / "seed1" / "metrics.json").read_text())
    assert m1["action_mse"] != pytest.approx(m["action_mse"], rel=1e-6)  # other noise, other samples
    assert m1["baselines"] == m["baselines"]  # the same frames


def test_k_samples_add_the_mean_spread_and_crps_and_keep_the_first_samples_numbers(trained, tmp_path, capsys):
    root, run = trained
    res = {}
    for k in (1, 3):
        code, stdout, err = _cli(capsys, run, "--checkpoint", run, "--val", "--out", tmp_path / str(k), "--steps", 2,
                                 "--plots", 0, "--cuts", 2, "--horizon", 2, "--samples", k)
        assert code == 0, err
        res[k] = json.loads((tmp_path / str(k) / "metrics.json").read_text())
    one, three = res[1], res[3]
    assert "x 3 sample(s), context >= 2 latent frames" in stdout and "action_mse_kmean" in stdout
    assert one["pair_list"] == three["pair_list"] == [[0, 2, 2], [0, 8, 2], [2, 2, 2], [2, 4, 2]]  # min context 2
    assert one["samples"] == 1 and three["samples"] == 3 and three["min_context"] == 2
    for k in ("action_mse", "latent_mse", "action_mse_raw"):  # sample 0 draws the single-sample noise
        assert three[k] == pytest.approx(one[k], rel=1e-5)
    # one sample: its mean is itself, no spread, CRPS = L1
    assert one["action_mse_kmean"] == pytest.approx(one["action_mse"]) and one["action_spread"] == 0
    assert one["action_crps"] == pytest.approx(one["action_l1"]) and one["latent_spread"] == 0
    assert three["action_spread"] > 0 and three["latent_spread"] > 0
    assert three["action_mse_kmean"] != pytest.approx(three["action_mse"], rel=1e-6)
    assert three["action_crps"] < three["action_l1"]  # the samples' spread is credited
    for b in ("last", "mean"):  # the baselines: one deterministic forecast, the same keys
        base = three["baselines"][b]
        assert base["action_mse_kmean"] == base["action_mse"] and base["action_spread"] == 0
        assert base["action_crps"] == pytest.approx(base["action_l1"])
    assert three["baselines"] == one["baselines"]
    assert list(three["per_cut"]) == ["2", "4", "8"] and three["per_cut"]["2"]["pairs"] == 2
    assert set(three["per_cut"]["4"]) >= {"action_mse_kmean", "latent_mse_kmean", "last_latent_mse", "mean_action_mse"}
    assert three["per_episode"]["0"]["pairs"] == 2  # (episode, cut) pairs, not samples
    assert len(three["action_mse_kmean_per_step"]) == 2


def test_sample_from_export_equals_checkpoint_and_ema_differs(trained, tmp_path, capsys):
    from flexpack.tools.export import export_run

    root, run = trained
    exported = export_run(run, tmp_path / "export", ema=True)
    res = {}
    for name, src, more in [("ckpt", run, []), ("export", exported, []), ("ema", run, ["--ema"]),
                            ("export_ema", exported, ["--ema"])]:
        code, _, err = _cli(capsys, exported, "--checkpoint", src, "--episodes", "0,4", "--out", tmp_path / name,
                            "--steps", 2, "--plots", 0, "--mode", "rollout", "--horizon", 3, "--min-context", 1,
                            "--samples", 1, *more)
        assert code == 0, err
        res[name] = json.loads((tmp_path / name / "metrics.json").read_text())
    assert res["ckpt"]["episodes"] == [0, 4] and res["ckpt"]["mode"] == "rollout"
    assert res["ckpt"]["pair_list"] == [[0, 1, 9], [4, 1, 3]]  # from the first chunk to the end
    for k in KEYS:
        assert res["export"][k] == pytest.approx(res["ckpt"][k], rel=1e-5)
        assert res["export_ema"][k] == pytest.approx(res["ema"][k], rel=1e-5)
    assert res["ema"]["action_mse"] != pytest.approx(res["ckpt"]["action_mse"], rel=1e-6)


def _no_stats(root: Path, tmp: Path, drop: bool = False) -> Path:
    copy = tmp / "nostats"
    shutil.copytree(root, copy)
    stats = json.loads((copy / "meta" / "stats.json").read_text())
    if drop:
        del stats["action"]
        (copy / "meta" / "stats.json").write_text(json.dumps(stats))
        return copy
    for k in ("q01", "q99", "mean", "std"):
        stats["action"].pop(k, None)
    stats["action"]["q01"] = list(stats["action"]["min"])  # other statistics than the run's (and still possible)
    stats["action"]["q99"] = stats["action"]["max"]
    (copy / "meta" / "stats.json").write_text(json.dumps(stats))
    return copy


@pytest.mark.parametrize("case,args,message", [
    ("steps", ["--steps", "0"], "--steps must be an integer from 1 to 10,000"),
    ("episodes", ["--episodes", "0,99"], "episodes [99] are not in"),
    ("cut", ["--cut-points", "9", "--horizon", "2"], "cut point 9 + horizon 2 is beyond episode 0 (10 latent frames)"),
    ("shape", ["--set", "model.overrides.ffn_dim=96"], "model.ffn_dim = 96, trained 512"),  # another model (small: 512)
    ("stats", None, "are not those"),
    ("nostats", None, "the dataset has no stats for 'action'"),
    ("val", ["--val", "--set", "data.val_episodes=[]"], "--val needs held-out episodes"),
    ("ema", ["--ema", "--episodes", "0"], None),
])
def test_bad_inputs_are_one_line_and_exit_2(trained, tmp_path, capsys, case, args, message):
    root, run = trained
    if case in ("stats", "nostats"):
        # LeRobot's statistics (meta/stats.json) changed or gone: not those the run was trained with (pooled)
        args = ["--set", f'data.root="{_no_stats(root, tmp_path, drop=case == "nostats")}"',
                "--set", 'data.action_stats="lerobot"']
    if case == "ema":  # a run trained without EMA
        run = tmp_path / "noema"
        train(load_config(CONFIGS / "tiny_cpu.toml", _sets(root, run, "schedule.steps=1")))
        capsys.readouterr()  # what the training printed
        message = "holds no EMA weights"
    code, _, err = _cli(capsys, run, "--checkpoint", run, "--out", tmp_path / "o", "--plots", 0, "--steps", 1, *args)
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flexpack sample: error: "), err
    assert message in lines[0]
    if case == "shape":  # refused from the configs, before any weights are read
        assert "with --set model.overrides.ffn_dim=96 disagrees with what" in lines[0]
    assert not (tmp_path / "o" / "metrics.json").exists()


def test_sample_every_writes_samples_and_resume_gives_the_same_numbers(tiny_dataset, tmp_path):
    more = ["schedule.steps=4", "sample.every=2", "sample.steps=2", "sample.plots=1",
            "sample.horizon=2", "schedule.rewarmup_steps=0"]  # a resume re-warms the LR otherwise
    straight, resumed = tmp_path / "a", tmp_path / "b"
    train(load_config(CONFIGS / "tiny_cpu.toml", _sets(tiny_dataset, straight, *more, "log.tensorboard=true",
                                                                  "validation.every=2")))
    cfg_b = load_config(CONFIGS / "tiny_cpu.toml", _sets(tiny_dataset, resumed, *more))
    train(cfg_b, stop_after=2)
    train(cfg_b)

    def samples(run):
        recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r for r in recs if "sample/action_mse" in r}

    a, b = samples(straight), samples(resumed)
    assert sorted(a) == sorted(b) == [2, 4]
    for step in (2, 4):
        for k in ("sample/action_mse", "sample/latent_mse", "sample/last/action_mse", "sample/mean/action_mse"):
            assert a[step][k] == pytest.approx(b[step][k], rel=1e-6), (step, k)
        files = json.loads((straight / "samples" / f"step_{step:08d}" / "metrics.json").read_text())
        assert files["action_mse"] == pytest.approx(a[step]["sample/action_mse"])
        assert (straight / "samples" / f"step_{step:08d}" / "episode_000000_actions.png").is_file()
    assert a[2]["sample/action_mse"] != a[4]["sample/action_mse"]  # the weights changed between the samplings
    assert a[2]["sample/last/action_mse"] == a[4]["sample/last/action_mse"]  # baselines: same frames
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(straight / "tb"), size_guidance={"images": 0})
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("sample/action_mse")] == [
        (s, pytest.approx(a[s]["sample/action_mse"], rel=1e-6)) for s in (2, 4)]
    assert [e.step for e in acc.Scalars("val/loss")] == [2, 4]  # validation reaches TensorBoard beside it
    assert [e.step for e in acc.Images("sample/episode_000000/actions")] == [2, 4]
    from flexpack.training.observe import tracking

    shown = tracking.outputs(straight, straight / "checkpoints" / "step_00000004", cfg_b.log)
    assert f"samples      {straight / 'samples'}" in shown
    assert f"sample       flexpack sample {straight}" in shown.splitlines()[-1]


def test_sample_every_needs_held_out_episodes_and_a_per_frame_sigma(tiny_dataset, tmp_path):
    with pytest.raises(ValueError, match="sample.every=2 needs held-out episodes"):
        load_config(CONFIGS / "tiny_cpu.toml", [f'data.root="{tiny_dataset}"', "sample.every=2"])
    with pytest.raises(ValueError, match="sample.steps must be an integer from 1 to 10,000"):
        load_config(CONFIGS / "tiny_cpu.toml", ["sample.steps=0"])
    from dataclasses import replace

    cfg = load_config(CONFIGS / "tiny_cpu.toml", [f'data.root="{tiny_dataset}"', "sample.every=2",
                                                    "data.val_episodes=[0]"])
    with pytest.raises(ValueError, match="one σ per episode and can only generate jointly"):
        replace(cfg, objective=replace(cfg.objective, chunk_size=None))


def test_wan_vae_cache_gets_videos_and_psnr_of_the_target_frames(trained, tmp_path, monkeypatch):
    """The Wan VAE branch with a stand-in decoder (no VAE weights in tests): a causal "decode" that
    repeats each latent frame ``stride`` times (frame 0 once), as the VAE's frame count does."""
    import numpy as np
    import torch

    from flexpack.sampling import evaluate, media
    from flexpack.sampling.pairs import make_pair

    root, run = trained
    cfg = load_config(Path(run) / "config.json")
    ds = compose(cfg, "sample", episodes=[0]).dataset

    def decode(latent, encoder, **kw):
        x = latent[:3].float().clamp(-1, 1)
        frames = torch.cat([x[:, :1], x[:, 1:].repeat_interleave(ds.stride, dim=1)], dim=1)  # (3, 1 + s(F-1), H, W)
        return ((frames + 1) * 127.5).round().to(torch.uint8).permute(1, 2, 3, 0).numpy()

    monkeypatch.setattr(media, "decode_latents", decode)
    pair = make_pair(ds[0], 3, 4)
    pair.pred_latent[:, 3:] = pair.latent[:, 3:] + 0.25  # a known error on the target frames only
    files, extra = evaluate.write_media(tmp_path, [pair], ds, plots=1)
    assert (tmp_path / "episode_000000.mp4").stat().st_size > 0 and "sample/episode_000000/actions" in files
    true, pred = decode(pair.latent, ""), decode(pair.pred_latent, "")
    first = 2 * ds.stride + 1  # video frames of latent frames 0..2 (the context): 1 + 4 + 4
    to = lambda v: v[first:].astype(np.float32) / 127.5 - 1.0  # noqa: E731
    assert extra["psnr"] == pytest.approx(media.psnr(to(pred), to(true)))
    assert np.isfinite(extra["psnr"]) and extra["psnr_pairs"] == 1
    assert extra["psnr_baseline_last"] < 100


def test_sample_every_with_too_short_held_out_episodes_fails_before_training(tiny_dataset, tmp_path):
    run = tmp_path / "short"
    cfg = load_config(CONFIGS / "tiny_cpu.toml", _sets(tiny_dataset, run, "schedule.steps=2", "sample.every=1",
                                                         "data.val_episodes=[5]", "sample.horizon=4"))
    with pytest.raises(ValueError,
                       match=r"sample.every=1: no episode has room for a cut point.*sample.horizon"):
        train(cfg)  # episode 5 has 3 latent frames: one context frame + 4 do not fit
    assert not (run / "checkpoints").exists()


def test_pairs_stay_within_one_pack_and_explicit_cuts_are_checked(trained, capsys):
    from flexpack.sampling.evaluate import PairPlan, build_pairs

    root, run = trained
    cfg = load_config(Path(run) / "config.json", ["data.max_tokens=40"])  # 8 latent frames per pack
    ds = compose(cfg, "sample", episodes=[0, 2])  # 10 and 6 latent frames
    pairs = build_pairs(ds, PairPlan(cuts=2, horizon=2, min_context=1))
    assert [(p.episode, p.cut, p.frames) for p in pairs] == [(0, 1, 3), (0, 6, 8), (2, 1, 3), (2, 4, 6)]
    assert "episodes [0] are longer than a pack (8 latent frames at data.max_tokens = 40)" in capsys.readouterr().err
    rolled = build_pairs(ds, PairPlan(mode="rollout", horizon=2, min_context=1))
    assert [(p.cut, p.horizon) for p in rolled] == [(1, 7), (1, 5)]
    # by default a cut point has 2 latent frames of context (frame 0 alone shows no motion); rollouts start there
    pairs = build_pairs(ds, PairPlan(cuts=2, horizon=2))
    assert [(p.episode, p.cut) for p in pairs] == [(0, 2), (0, 6), (2, 2), (2, 4)]
    assert [(p.cut, p.horizon) for p in build_pairs(ds, PairPlan(mode="rollout", horizon=2))] == [(2, 6), (2, 4)]
    assert [p.cut for p in build_pairs(ds, PairPlan(cuts=2, horizon=2, min_context=5))] == [5, 6]  # ep 2: none
    assert "episodes [2] are too short for 5 latent frame(s) of context" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"cut points \[1\] have less context than --min-context 2"):
        build_pairs(ds, PairPlan(cut_points=(1, 3), horizon=2))
    # K samples: consecutive pairs of one (episode, cut), sample 0 with the noise of a single-sample run
    three = build_pairs(ds, PairPlan(cuts=2, horizon=2, samples=3))
    assert [(p.episode, p.cut, p.sample) for p in three[:4]] == [(0, 2, 0), (0, 2, 1), (0, 2, 2), (0, 6, 0)]
    assert three[0].seed == pairs[0].seed and len({p.seed for p in three}) == len(three) == 12
    with pytest.raises(ValueError, match="--samples must be >= 1"):
        PairPlan(samples=0)
    # the control: each pair forecasts from the next episode's history; its truth (and so the baselines) its own
    foreign = build_pairs(ds, PairPlan(cuts=2, horizon=2, foreign_history=True))
    items = {0: ds.dataset[0], 2: ds.dataset[1]}
    for p, q in zip(foreign, pairs):
        donor = items[2 if p.episode == 0 else 0]
        assert torch.equal(p.pred_latent[:, :p.cut], donor["latent"][:, :p.cut].float())
        assert torch.equal(p.pred_action[:, :p.cut], torch.where(p.action_mask[:, :p.cut],
                                                                 donor["action"][:, :p.cut].float(), 0.0))
        assert torch.equal(p.latent, q.latent) and (p.pred_latent[:, p.cut:] == 0).all() and p.seed == q.seed
    with pytest.raises(ValueError, match="cut point 0 of episode 0: must be a positive multiple"):
        build_pairs(ds, PairPlan(cut_points=(0,), horizon=2, min_context=0))
    with pytest.raises(ValueError, match="must be a multiple of the chunk the model was trained with"):
        build_pairs(compose(load_config(Path(run) / "config.json", ["objective.chunk_size=2"]), "sample",
                            episodes=[0, 2]), PairPlan(horizon=3))


def test_default_output_folder_is_in_the_run(trained, capsys):
    root, run = trained
    ckpt = sorted((run / "checkpoints").glob("step_*"))[-1]
    code, stdout, err = _cli(capsys, run, "--checkpoint", ckpt, "--episodes", "0", "--steps", 1, "--plots", 0,
                             "--cuts", 1, "--horizon", 2)
    assert code == 0, err
    out = run / "samples" / f"forecast_{ckpt.name}"
    assert (out / "metrics.json").is_file() and str(out / "metrics.json") in stdout
    assert not (run / "checkpoints" / "samples").exists()


@pytest.mark.parametrize("ema", [False, True])
def test_in_training_sampling_equals_the_cli_on_the_final_checkpoint(tiny_dataset, tmp_path, capsys, ema):
    run = tmp_path / "run"
    more = ["schedule.steps=3", "sample.every=3", "sample.steps=2", "sample.plots=0",
            "sample.horizon=2", "sample.cuts=2", "optim.ema_decay=0.5",
            f"sample.ema={str(ema).lower()}"]
    train(load_config(CONFIGS / "tiny_cpu.toml", _sets(tiny_dataset, run, *more)))
    rec = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "sample/action_mse" in x][-1]
    code, _, err = _cli(capsys, run, "--checkpoint", run, "--val", "--out", tmp_path / "cli", "--steps", 2,
                        "--plots", 0, "--cuts", 2, "--horizon", 2, *(["--ema"] if ema else []))
    assert code == 0, err
    cli = json.loads((tmp_path / "cli" / "metrics.json").read_text())
    hook = json.loads((run / "samples" / "step_00000003" / "metrics.json").read_text())
    for k in ("action_mse", "action_mse_raw", "latent_mse"):
        assert rec[f"sample/{k}"] == pytest.approx(cli[k], rel=1e-5) == hook[k]
    assert cli["pair_list"] == hook["pair_list"]
    # the trained weights were put back after sampling with the EMA: the checkpoint (saved after) differs from it
    from flexpack.run.state import checkpoint

    found = checkpoint.latest(run / "checkpoints")
    weights, averages = checkpoint.read_tensors(found, "model"), checkpoint.read_ema(found)
    assert any(not torch.equal(weights[k].float(), averages[k].float()) for k in weights)


def test_sample_ema_needs_ema_weights(tmp_path):
    with pytest.raises(ValueError, match="sample.ema = true needs EMA weights"):
        load_config(CONFIGS / "tiny_cpu.toml", ["sample.ema=true"])
