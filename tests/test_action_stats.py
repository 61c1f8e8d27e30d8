"""Pooled action statistics: exact over all frames (numpy as the reference), used by the dataset,
written by encode, reported by check-dataset; against LeRobot's averaged per-episode quantiles."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

pytest.importorskip("lerobot")

from flexpack.cli import main  # noqa: E402
from flexpack.data import LatentEpisodeDataset, action_stats, stats_report  # noqa: E402
from flexpack.data.actions import ActionNormalizer  # noqa: E402
from flexpack.data.episodes import EpisodeSource  # noqa: E402

EPISODES, FRAMES = 7, 40


def _values(ep: int, t: np.ndarray) -> np.ndarray:
    """(T, 2): a sine column, and a column constant within each episode (7 distinct values)."""
    return np.stack([np.sin(0.06 * t + 0.9 * ep), np.full_like(t, 0.5 * ep - 1.0)], -1).astype(np.float32)


@pytest.fixture(scope="module")
def lerobot_written(tmp_path_factory):
    """A dataset written with LeRobot's own API (no videos), whose meta/stats.json is LeRobot's."""
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    root = tmp_path_factory.mktemp("stats") / "ds"
    features = {"action": {"dtype": "float32", "shape": (2,), "names": ["sine", "per_episode"]},
                "observation.state": {"dtype": "float32", "shape": (2,), "names": ["sine", "per_episode"]}}
    ds = LeRobotDataset.create("local/ds", fps=10, features=features, root=root, use_videos=False)
    for ep in range(EPISODES):
        x = _values(ep, np.arange(FRAMES + 3 * ep, dtype=np.float64))
        for row in x:
            ds.add_frame({"action": row, "observation.state": row[::-1].copy(), "task": "t"})
        ds.save_episode()
    ds.finalize()
    return root


def _all_frames() -> np.ndarray:
    return np.concatenate([_values(ep, np.arange(FRAMES + 3 * ep, dtype=np.float64)) for ep in range(EPISODES)])


def test_pooled_statistics_equal_numpy_over_all_frames(lerobot_written, tmp_path):
    source = EpisodeSource(lerobot_written)
    stats = action_stats.compute(source)
    x = _all_frames().astype(np.float64)
    assert stats["frames"] == len(x) == sum(source.video_frames)
    a = stats["features"]["action"]
    for key, q in action_stats.QUANTILES.items():
        np.testing.assert_allclose(a[key], np.quantile(x, q, axis=0), rtol=0, atol=1e-12)
    np.testing.assert_allclose(a["mean"], x.mean(0), atol=1e-12)
    np.testing.assert_allclose(a["std"], x.std(0), atol=1e-12)
    np.testing.assert_allclose(a["min"], x.min(0), atol=0)
    np.testing.assert_allclose(a["max"], x.max(0), atol=0)
    np.testing.assert_allclose(stats["features"]["observation.state"]["q99"], np.quantile(x[:, ::-1], 0.99, axis=0),
                               atol=1e-12)
    assert a["count"] == len(x)

    # written atomically beside the cache and read back unchanged; a stale file is recomputed
    action_stats.write(tmp_path, stats)
    assert action_stats.read(tmp_path) == json.loads(json.dumps(stats))
    assert [p.name for p in tmp_path.iterdir()] == ["stats.json"]
    stale = {**stats, "frames": 3, "features": {"action": {**a, "q01": [9.0, 9.0]}}}
    action_stats.write(tmp_path, stale)
    assert action_stats.feature_stats(source, tmp_path, "action", "pooled")["q01"] == a["q01"]
    (tmp_path / "stats.json").write_text("{not json")
    with pytest.raises(ValueError, match="stats.json.*rerun flexpack encode"):
        action_stats.read(tmp_path)


def test_lerobot_bounds_clip_the_sine_and_collapse_the_per_episode_column(lerobot_written, tmp_path):
    source = EpisodeSource(lerobot_written)
    x = _all_frames().astype(np.float64)
    lr = source.meta.stats["action"]
    pooled = action_stats.feature_stats(source, tmp_path, "action", "pooled")
    # LeRobot averages per-episode quantiles: the per-episode column gets q01 == q99
    assert np.isclose(lr["q01"][1], lr["q99"][1])
    assert pooled["q99"][1] - pooled["q01"][1] == pytest.approx(3.0)  # the 7 values span -1 .. 2
    lr_clip = stats_report.clipped_share(x[:, 0], lr["q01"][0], lr["q99"][0])
    pooled_clip = stats_report.clipped_share(x[:, 0], pooled["q01"][0], pooled["q99"][0])
    assert lr_clip > 0.15 and pooled_clip <= 0.025
    # the normalizer keeps the per-episode column's values apart under pooled bounds, not LeRobot's
    y_pooled = ActionNormalizer.from_stats(pooled, 2)(x)
    y_lr = ActionNormalizer.from_stats(lr, 2)(x)
    assert len(np.unique(y_pooled[:, 1])) == EPISODES and np.all(y_lr[:, 1] == 0)

    rows = stats_report.report(source, tmp_path, "lerobot")
    table, warnings = stats_report.lines(rows, "lerobot", 0.05)
    assert len(table) == 2 + 4
    assert any("action[1]: lerobot q01 = q99" in w and "maps every frame to 0" in w for w in warnings)
    assert any(w.startswith("warning: action[0]:") and "clipped to ±1 by the lerobot" in w for w in warnings)
    _, pooled_warnings = stats_report.lines(stats_report.report(source, tmp_path, "pooled"), "pooled", 0.05)
    assert pooled_warnings == []


def test_dataset_encode_and_check_use_pooled_statistics(tiny_dataset, tmp_path, capsys):
    root = tmp_path / "ds"
    shutil.copytree(tiny_dataset, root)
    stored = json.loads((root / "latents" / "stats.json").read_text())  # written by encode
    assert stored == action_stats.compute(EpisodeSource(root))
    ds = LatentEpisodeDataset(root)
    np.testing.assert_allclose(ds.normalizer.low, stored["features"]["action"]["q01"])
    np.testing.assert_allclose(ds.normalizer.high, stored["features"]["action"]["q99"])
    lr = LatentEpisodeDataset(root, action_stats="lerobot")
    np.testing.assert_allclose(lr.normalizer.low, np.asarray(lr.source.meta.stats["action"]["q01"]).reshape(-1))
    assert not np.allclose(lr.normalizer.low, ds.normalizer.low)
    with pytest.raises(ValueError, match="action_stats must be one of"):
        LatentEpisodeDataset(root, action_stats="mean")

    assert main(["check-dataset", str(root)]) == 0
    out = capsys.readouterr().out
    assert ("normalization bounds (pooled statistics used" in out and "action[5]" in out
            and "observation.state[0]" in out)
    assert "missing or stale" not in out
    (root / "latents" / "stats.json").unlink()
    assert main(["check-dataset", str(root)]) == 0
    assert f"note: {root / 'latents' / 'stats.json'} is missing or stale" in capsys.readouterr().out
    assert main(["check-dataset", str(root), "--action-stats", "lerobot", "--clip-warn", "0.1"]) == 0
    assert "clipped to ±1 by the lerobot q01/q99" in capsys.readouterr().out
