"""The learnable synthetic scene and the whole path on it: make-dataset --scene orbit, encode with
``pool``, train the CPU model of configs/tiny_cpu.toml, ``flexpack sample`` on held-out episodes — its forecast
beats repeating the last action and the dataset's mean action."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("lerobot")

from flexpack.cli import main  # noqa: E402
from flexpack.data import LatentEpisodeDataset  # noqa: E402
from flexpack.data.episodes import EpisodeSource  # noqa: E402
from flexpack.data.synthetic import ORBIT_OMEGA, make_synthetic_dataset, orbit_actions  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
# The CPU model of configs/tiny_cpu.toml on the orbit scene: 600 steps of one 100-token pack (two episodes),
# lr 3e-3, per-frame σ (objective.chunk_size = 1, the default), a quarter of the episodes held out.
# Measured (held-out action MSE of one sample / the better baseline's, 24 forecast pairs, horizon 4, seed 0):
#   context >= 2 latent frames (the default):  preset small 0.015, tiny 0.017; with the older action
#   positions (every step of a frame at the frame's: interchangeable) 0.162 and 0.141;
#   context >= 1 (the earlier default):  small 0.040, tiny 0.088; older positions 0.280 and 0.275
#   (and 0.23-0.29 for seeds 0-3 before the small preset). The test asks for < 0.1.
TRAIN = ["schedule.steps=600", "schedule.warmup_steps=20", "optim.accum_steps=1", "optim.lr=3e-3",
         "data.val_fraction=0.25", "checkpoint.every=0", "log.tensorboard=false", "log.progress=false"]


def test_orbit_scene_actions_follow_the_blob_and_survive_the_pool_encoder(tmp_path, capsys):
    root = tmp_path / "orbit"
    assert main(["make-dataset", str(root), "--scene", "orbit", "--episodes", "6", "--min-frames", "25",
                 "--max-frames", "33", "--seed", "3"]) == 0
    assert "orbit scene" in capsys.readouterr().out
    assert main(["encode", "--dataset", str(root), "--no-progress"]) == 0
    src = EpisodeSource(root)
    import pandas as pd

    frames = pd.concat(pd.read_parquet(p) for p in sorted((root / "data").rglob("*.parquet")))
    ep0 = frames[frames.episode_index == 0]
    a = np.stack(ep0["action"].to_numpy())  # (T, 6)
    # column k = cos(θ + 2πk/6) with θ advancing by ±ω per frame
    # (a0, a1) = (cos θ, cos(θ + π/3)) gives sin θ = (a0/2 − a1) / sin(π/3)
    theta = np.arctan2((a[:, 0] / 2 - a[:, 1]) / np.sin(np.pi / 3), a[:, 0])
    first = theta[0]
    np.testing.assert_allclose(a, orbit_actions(first + ORBIT_OMEGA * np.arange(len(a)), 6), atol=1e-5)
    # the video shows it: the blob's brightest pixel sits where column 0 / the y offset put it
    video = src.decode(0, "observation.images.cam0", 4).numpy()  # (T, 3, H, W) uint8
    for t in range(4):
        y, x = np.unravel_index(video[t].astype(float).sum(0).argmax(), video.shape[2:])
        cx, cy = 0.5 + 0.3 * np.cos(first + ORBIT_OMEGA * t), 0.5 + 0.3 * np.sin(first + ORBIT_OMEGA * t)
        assert abs(x / 31 - cx) < 0.08 and abs(y / 31 - cy) < 0.08
    # and so do the 2x2 pool latents: a quadratic read-out of one latent frame's 3 first channels gives
    # the frame's mean action (normalized) nearly exactly across all episodes
    ds = LatentEpisodeDataset(root, action_dim=6)
    X, Y = [], []
    for i in range(len(ds)):
        it = ds[i]
        z, act = it["latent"].numpy(), it["action"].numpy()  # (48, F, 2, 2), (6, F, 4)
        for f in range(z.shape[1]):
            X.append(z[:3, f].ravel())
            Y.append(act[:, f].mean(-1) if f else act[:, f, -1])  # frame 0 is the first video frame alone
    X, Y = np.array(X), np.array(Y)
    feats = np.c_[np.ones(len(X)), X, np.einsum("ni,nj->nij", X, X).reshape(len(X), -1)]
    W, *_ = np.linalg.lstsq(feats, Y, rcond=None)
    r2 = 1 - ((Y - feats @ W) ** 2).mean() / Y.var(0).mean()
    assert r2 > 0.9, r2
    with pytest.raises(ValueError, match="scene='orbit' sets its own actions"):
        make_synthetic_dataset(tmp_path / "bad", scene="orbit", subtasks=2)
    with pytest.raises(ValueError, match="scene must be one of"):
        make_synthetic_dataset(tmp_path / "bad", scene="spiral")


def learn_and_sample(tmp_path: Path, seed: int) -> tuple[dict, list[dict], Path]:
    """make-dataset --scene orbit, encode (pool), train the tiny model, sample the held-out episodes."""
    import torch

    from flexpack.commands.train import train
    from flexpack.run.config import load_config

    root = make_synthetic_dataset(tmp_path / "orbit", scene="orbit", episodes=24, min_frames=33, max_frames=41,
                                  seed=seed)
    assert main(["encode", "--dataset", str(root), "--no-progress"]) == 0
    run, out = tmp_path / "run", tmp_path / "samples"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the tiny model's ops are too small for a thread pool
    try:
        cfg = load_config(CONFIGS / "tiny_cpu.toml", [f"data.root={root}", f"runtime.out_dir={run}",
                                                      f"runtime.seed={seed}", *TRAIN])
        assert cfg.objective.chunk_size == 1  # per-frame σ: clean history next to noisy future is trained
        train(cfg)
        assert main(["sample", str(run / "config.json"), "--checkpoint", str(run), "--val", "--out", str(out),
                     "--plots", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return json.loads((out / "metrics.json").read_text()), records, out


@pytest.mark.slow
def test_tiny_model_learns_the_orbit_and_its_forecast_beats_both_baselines(tmp_path, capsys):
    t0 = time.perf_counter()
    metrics, records, out = learn_and_sample(tmp_path, seed=0)
    loss = np.array([r["loss"] for r in records if "loss" in r])
    action = np.array([r["action_loss"] for r in records if "action_loss" in r])
    assert len(loss) == 600
    # training: the loss falls well below its start, the action part most
    assert loss[-50:].mean() < 0.4 * loss[:10].mean(), (loss[:10].mean(), loss[-50:].mean())
    assert action[-50:].mean() < 0.25 * action[:10].mean(), (action[:10].mean(), action[-50:].mean())
    # sampling: held-out episodes only, forecasts from ground-truth history
    assert metrics["mode"] == "forecast" and len(metrics["episodes"]) == 6 and metrics["pairs"] >= 12
    last, mean = metrics["baselines"]["last"]["action_mse"], metrics["baselines"]["mean"]["action_mse"]
    # the task moves half a turn in 12 video frames: repeating the last action and the mean are both poor
    assert last > 0.8 and mean > 0.4, (last, mean)
    assert metrics["action_mse"] < 0.1 * min(last, mean), (metrics["action_mse"], last, mean)
    # and the video forecast beats repeating the last latent frame
    assert metrics["latent_mse"] < metrics["baselines"]["last"]["latent_mse"]
    assert list(out.glob("episode_*_actions.png"))
    print(f"orbit: action_mse {metrics['action_mse']:.3f} (last {last:.3f}, mean {mean:.3f}) "
          f"in {time.perf_counter() - t0:.0f} s")
