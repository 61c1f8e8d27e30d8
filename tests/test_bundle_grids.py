"""A bundle whose datasets compose to different latent grids trains lingbot-va-tiny with both grids in one
micro-batch (spatial padding to the largest), verifies packed ≡ each segment alone at its own grid, and reports
the padding's share; latents of different channel counts stay one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexpack.data.bundle import BundleDataset
from flexpack.data.bundle_synthetic import SyntheticDataset, write_bundle
from helpers import BUNDLE_CAMS, LINGBOT_TINY, run_cli, tiny_config

pytestmark = pytest.mark.usefixtures("one_thread")

# robotwin/b's cameras compose (as a T) to 4x2 latents, robotwin/a's (BUNDLE_CAMS) to 6x4: the run packs on 6x4
SMALL_CAMS = {"observation.images.cam_high": (2, 2), "observation.images.cam_left_wrist": (2, 1),
              "observation.images.cam_right_wrist": (2, 1)}
LENGTHS_A = [[(0, 30), (20, 45)], [(0, 25)], [(3, 40)]]
LENGTHS_B = [[(0, 21)], [(0, 33)], [(5, 30)]]


def two_grid_bundle(root: Path, channels_b: int = 48) -> Path:
    write_bundle(root, [SyntheticDataset(name="robotwin/a", episodes=LENGTHS_A, cameras=BUNDLE_CAMS,
                                         action_columns=6)], text=(16, 64))
    write_bundle(root, [SyntheticDataset(name="robotwin/b", episodes=LENGTHS_B, cameras=SMALL_CAMS,
                                         action_columns=6)], channels=channels_b, text=(16, 64), seed=1)
    return root


def config(root: Path, out: Path, *extra: str):
    return tiny_config(root, out, *LINGBOT_TINY, 'data.camera_layout="tshape"', "data.max_tokens=800",
                       "schedule.steps=2", "schedule.rewarmup_steps=0", *extra)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory) -> Path:
    return two_grid_bundle(tmp_path_factory.mktemp("grids") / "bundle")


def test_both_grids_share_a_micro_batch_of_the_largest(bundle, tmp_path) -> None:
    from flexpack.run.compose import build_run

    run = build_run(config(bundle, tmp_path / "run"))
    assert BundleDataset(bundle, camera_layout="tshape").latent_grids == {
        "robotwin/a": [(48, 6, 4)], "robotwin/b": [(48, 4, 2)]}
    assert run.data.collate.collate.grid == (6, 4) and run.geometry.video_tokens == 6  # 6x4 latents, patch 2
    ds, mixed = run.data.dataset, 0
    for idx in run.data.sampler:
        batch = run.data.collate([ds[i] for i in idx])
        assert batch.latent.shape[-2:] == (6, 4) and batch.latent.shape[2] == 800 // 10  # one shape: 80 frames
        mixed += len({tuple(g) for g in batch.layout.episode_hw.tolist()}) == 2
    assert mixed > 0  # some micro-batch holds segments of both grids


@pytest.fixture(scope="module")
def trained(bundle, tmp_path_factory) -> tuple[Path, object]:
    from flexpack.commands.train import train

    out = tmp_path_factory.mktemp("grids") / "run"
    return out, train(config(bundle, out))


def test_a_two_grid_bundle_trains_and_verifies(bundle, trained, tmp_path, capsys) -> None:
    from flexpack.run.compose import compose
    from flexpack.tools.verify import verify_config

    result = trained[1]
    assert len(result.losses) == 2 and all(0 < loss < 100 for loss in result.losses)
    assert all(0 < m["waste"] < 1 for m in result.metrics)
    report = verify_config(compose(config(bundle, tmp_path / "verify"), "verify"), micro_batches=2)
    print(report.table())
    assert report.ok and report.max_err < 1e-4
    assert {r.episode for r in report.rows} & {3, 4, 5} and {r.episode for r in report.rows} & {0, 1, 2}


def test_sampling_packs_both_grids_as_it_samples_each_alone(trained, tmp_path, capsys) -> None:
    """Held-out pairs of both datasets, sampled in shared packs and in packs of one pair, give the same metrics."""
    fast = ["--set", "model.overrides.num_inference_steps=2", "--set", "model.overrides.action_num_inference_steps=2",
            "--horizon", "4", "--plots", "0", "--samples", "1"]
    got = []
    for tokens in (800, 200):
        out = tmp_path / f"s{tokens}"
        code, err = run_cli(capsys, "sample", str(trained[0]), "--out", str(out), "--set", f"data.max_tokens={tokens}",
                            *fast)
        assert code == 0, err
        got.append(json.loads((out / "metrics.json").read_text()))
    assert set(got[0]["episodes"]) & {0, 1, 2, 3} and set(got[0]["episodes"]) & {4, 5, 6}  # a's and b's segments
    assert got[0]["model_calls"] < got[1]["model_calls"]  # the smaller packs did hold fewer pairs
    for key in ("latent_mse", "action_mse"):
        assert got[0][key] == pytest.approx(got[1][key], rel=1e-5)


def test_stats_reports_the_grid_padding(bundle, capsys) -> None:
    code, err = run_cli(capsys, "stats", "--dataset", str(bundle), "--mode", "pack", "--max-tokens", "800",
                        "--patch", "2", "--json", keep_stdout=True)
    assert code == 0, err
    s = json.loads(capsys.readouterr().out)
    frames_a = sum(BundleDataset(bundle).lengths()[:4])
    frames_b = sum(BundleDataset(bundle).lengths()[4:])
    assert s["grid_padding"] == pytest.approx(frames_b * (24 - 8) / ((frames_a + frames_b) * 24))
    code, _ = run_cli(capsys, "stats", "--dataset", str(bundle), "--mode", "pack", "--max-tokens", "800",
                      "--patch", "2", keep_stdout=True)
    assert code == 0 and "grid padding     " in capsys.readouterr().out


def test_latents_of_different_channel_counts_are_one_line(tmp_path) -> None:
    root = two_grid_bundle(tmp_path / "b", channels_b=16)
    with pytest.raises(ValueError) as exc:
        BundleDataset(root, camera_layout="tshape")
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith(f"{root}: the datasets' latents have different channel counts")
    assert "robotwin/a (48, 6, 4)" in msg and "robotwin/b (16, 4, 2)" in msg


def test_a_one_grid_bundle_keeps_todays_batches(tmp_path) -> None:
    """Datasets of one grid: no run grid, so the collate and every layout are exactly today's."""
    from flexpack.run.compose import build_run

    root = write_bundle(tmp_path / "b", [SyntheticDataset(name="d", episodes=LENGTHS_A, cameras=BUNDLE_CAMS,
                                                          action_columns=6)], text=(16, 64))
    run = build_run(config(root, tmp_path / "run"))
    idx = next(iter(run.data.sampler))
    batch = run.data.collate([run.data.dataset[i] for i in idx])
    assert run.data.collate.collate.grid is None and batch.layout.episode_hw is None


def mixture_config(tmp_path: Path, channels_b: int = 48):
    from flexpack.run.config import load_config

    a = write_bundle(tmp_path / "a", [SyntheticDataset(name="d", episodes=[[(0, 30)], [(0, 21)]],
                                                       cameras={"observation.images.cam_high": (4, 4)},
                                                       action_columns=6)], text=(16, 64))
    b = write_bundle(tmp_path / "b", [SyntheticDataset(name="e", episodes=[[(0, 25), (10, 33)]],
                                                       cameras={"observation.images.cam_high": (2, 4)},
                                                       action_columns=6)], channels=channels_b, text=(16, 64), seed=5)
    return load_config(Path(__file__).resolve().parents[1] / "configs" / "tiny_cpu.toml", [
        "data.root=", f"data.datasets=[{{root = '{a}'}}, {{root = '{b}'}}]", *LINGBOT_TINY, "data.max_tokens=800",
        f"runtime.out_dir={tmp_path / 'run'}", "checkpoint.every=0", "log.progress=false"])


def test_a_mixture_of_two_grids_packs_them_together_and_verifies(tmp_path) -> None:
    from flexpack.run.compose import build_run, compose
    from flexpack.tools.verify import verify_config

    cfg = mixture_config(tmp_path)
    run = build_run(cfg)
    assert run.data.dataset.latent_grids == {"a/d": [(48, 4, 4)], "b/e": [(48, 2, 4)]}
    batch = run.data.collate([run.data.dataset[i] for i in next(iter(run.data.sampler))])
    assert sorted({tuple(g) for g in batch.layout.episode_hw.tolist()}) == [(2, 4), (4, 4)]
    report = verify_config(compose(cfg, "verify"), micro_batches=1)
    assert report.ok and report.max_err < 1e-4


def test_a_mixture_of_two_channel_counts_is_one_line(tmp_path) -> None:
    from flexpack.run.build import open_dataset

    with pytest.raises(ValueError) as exc:
        open_dataset(mixture_config(tmp_path, channels_b=16))
    msg = str(exc.value)
    assert "\n" not in msg and msg.startswith("data.datasets: the datasets' latents have different channel counts")
    assert "a/d (48, 4, 4)" in msg and "b/e (16, 2, 4)" in msg
