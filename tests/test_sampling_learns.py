"""The learnable synthetic scene and the whole path on it: make-dataset --scene orbit, encode with
``pool``, train the tiny model, ``flexpack sample`` on held-out episodes — the model's forecast
beats repeating the last action and the dataset's mean action."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("lerobot")

from flexpack.cli import main  # noqa: E402
from flexpack.data import LatentEpisodeDataset  # noqa: E402
from flexpack.data.episodes import EpisodeSource  # noqa: E402
from flexpack.data.synthetic import ORBIT_OMEGA, make_synthetic_dataset, orbit_actions  # noqa: E402


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
    first, step = theta[0], np.sign(np.sin(theta[1] - theta[0]))
    np.testing.assert_allclose(a, orbit_actions(first + step * ORBIT_OMEGA * np.arange(len(a)), 6), atol=1e-5)
    # the video shows it: the blob's brightest pixel sits where column 0 / the y offset put it
    video = src.decode(0, "observation.images.cam0", 4).numpy()  # (T, 3, H, W) uint8
    for t in range(4):
        y, x = np.unravel_index(video[t].astype(float).sum(0).argmax(), video.shape[2:])
        cx, cy = 0.5 + 0.3 * np.cos(first + step * ORBIT_OMEGA * t), 0.5 + 0.3 * np.sin(first + step * ORBIT_OMEGA * t)
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
