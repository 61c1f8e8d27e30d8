"""Upstream LingBot-VA post-training bundles read in place: items against an independent reading of the same
files, camera grids, odd strides, three cameras, missing and bad files, nothing written into the bundle."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from flexpack.data.bundle import BundleDataset
from flexpack.data.bundle_actions import relative_pose
from flexpack.data.bundle_synthetic import SyntheticDataset, segment_latent_frames, write_bundle

MAIN = "observation.images.cam_high"
LEFT, RIGHT = "observation.images.cam_left_wrist", "observation.images.cam_right_wrist"
TSHAPE = {MAIN: (4, 4), LEFT: (2, 2), RIGHT: (2, 2)}
ROBOTWIN_CHANNELS = list(range(0, 7)) + [28] + list(range(7, 14)) + [29]


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


@pytest.fixture()
def bundle(tmp_path: Path) -> Path:
    return write_bundle(tmp_path / "bundle", [
        SyntheticDataset(name="tasks/a", episodes=[[(0, 40), (30, 70)], [(3, 36)]], cameras=TSHAPE, stride=2, offset=1),
        SyntheticDataset(name="tasks/b", episodes=[[(5, 61)]], cameras=TSHAPE, stride=2),
    ])


def _expected(root: Path, dataset: str, episode: int, start: int, end: int, q01, q99, channels) -> dict:
    """What upstream's loader gives for one segment, computed here step by step from the files."""
    folder = root / dataset
    pth = {c: torch.load(folder / "latents" / "chunk-000" / c / f"episode_{episode:06d}_{start}_{end}.pth",
                         weights_only=True) for c in (MAIN, LEFT, RIGHT)}
    grids = {c: pth[c]["latent"].float().reshape(pth[c]["latent_num_frames"], pth[c]["latent_height"],
                                                 pth[c]["latent_width"], -1) for c in pth}
    f, h, w, c = grids[MAIN].shape
    top = torch.zeros(f, grids[LEFT].shape[1], w, c)
    top[:, :, : grids[LEFT].shape[2]] = grids[LEFT]
    top[:, :, grids[LEFT].shape[2]:] = grids[RIGHT]
    latent = torch.cat([top, grids[MAIN]], dim=1).permute(3, 0, 1, 2)
    rows = np.array(pq.read_table(folder / "data" / "chunk-000" / f"episode_{episode:06d}.parquet")
                    .column("action").to_pylist())[start:end]
    ids = pth[MAIN]["frame_ids"]
    stride, steps = ids[1] - ids[0], 4 * (ids[1] - ids[0])
    action = np.zeros((30, f, steps))
    mask = np.zeros((30, f, steps), dtype=bool)
    for frame in range(f):
        for a in range(steps):
            row = ids[0] - start + (frame - 1) * steps + a  # frame 0: zeros, present
            for col, ch in enumerate(channels):
                value = rows[row, col] if frame > 0 else 0.0
                x = 2 * (value - q01[ch]) / (q99[ch] - q01[ch] + 1e-6) - 1
                action[ch, frame, a] = min(max(x, -1.5), 1.5)
                mask[ch, frame, a] = True
    return {"latent": latent, "action": action, "mask": mask, "text": pth[MAIN]["text_emb"].float(), "stride": stride}


def test_items_equal_an_independent_reading_and_nothing_is_written(bundle: Path) -> None:
    before = _tree(bundle)
    ds = BundleDataset(bundle, cameras=[MAIN, LEFT, RIGHT], action_channels=ROBOTWIN_CHANNELS, action_steps=8,
                       cfg_prob=0.0)
    assert ds.names == ["tasks/a", "tasks/b"]
    assert [(ds.names[it.dataset], it.episode, it.seg.segment) for it in ds.items] == [
        ("tasks/a", 0, 0), ("tasks/a", 0, 1), ("tasks/a", 1, 0), ("tasks/b", 0, 0)]
    assert ds.lengths() == [segment_latent_frames(0, 40, 2, 1), segment_latent_frames(30, 70, 2, 1),
                            segment_latent_frames(3, 36, 2, 1), segment_latent_frames(5, 61, 2)] == [5, 5, 4, 7]
    for i, (name, ep, s, e) in enumerate([("tasks/a", 0, 0, 40), ("tasks/a", 0, 30, 70), ("tasks/a", 1, 3, 36),
                                          ("tasks/b", 0, 5, 61)]):
        item, want = ds[i], _expected(bundle, name, ep, s, e, ds.q01, ds.q99, ROBOTWIN_CHANNELS)
        assert item["latent"].shape == (48, item["length"], 6, 4)  # wrists 2x(2x2) over the main camera's 4x4
        torch.testing.assert_close(item["latent"], want["latent"], rtol=0, atol=0)
        np.testing.assert_allclose(item["action"].numpy(), want["action"], rtol=1e-5, atol=1e-5)
        np.testing.assert_array_equal(item["action_mask"].numpy(), want["mask"])
        torch.testing.assert_close(item["text"], want["text"])
        assert item["dataset"] == name and item["frame_range"] == (s, e)
        unused = [c for c in range(30) if c not in ROBOTWIN_CHANNELS]
        assert not item["action_mask"][unused].any() and not item["action"][unused].any()
    assert _tree(bundle) == before  # nothing written, nothing touched


def test_pooled_statistics_are_the_exact_quantiles_of_the_segments_rows(bundle: Path) -> None:
    ds = BundleDataset(bundle, cameras=[MAIN, LEFT, RIGHT], action_channels=ROBOTWIN_CHANNELS, cfg_prob=0.0)
    kept = []
    for name, ep, s, e, shift in [("tasks/a", 0, 0, 40, 1), ("tasks/a", 0, 30, 70, 1), ("tasks/a", 1, 3, 36, 1),
                                  ("tasks/b", 0, 5, 61, 0)]:
        rows = np.array(pq.read_table(bundle / name / "data" / "chunk-000" / f"episode_{ep:06d}.parquet")
                        .column("action").to_pylist())
        kept.append(rows[s + shift:e])
    pooled = np.concatenate(kept)
    np.testing.assert_allclose(ds.q01[ROBOTWIN_CHANNELS], np.quantile(pooled, 0.01, axis=0))
    np.testing.assert_allclose(ds.q99[ROBOTWIN_CHANNELS], np.quantile(pooled, 0.99, axis=0))
    assert not ds.q01[[14, 27]].any() and not ds.q99[[14, 27]].any()


def test_config_statistics_width_concat_and_no_normalization(tmp_path: Path) -> None:
    cams = {MAIN: (3, 4), LEFT: (3, 2)}
    root = write_bundle(tmp_path / "b", [SyntheticDataset(name="one", episodes=[[(0, 17)]], cameras=cams,
                                                          action_columns=3)])
    stat = {"q01": [-1.0] * 30, "q99": [3.0] * 30}
    ds = BundleDataset(root, action_steps=4, norm_stat=stat, cfg_prob=0.0)
    assert ds.items[0].layout == "width_concat" and ds[0]["latent"].shape == (48, 5, 3, 6)
    raw = BundleDataset(root, normalize=False, cfg_prob=0.0)[0]
    got = ds[0]
    expect = np.clip(2 * (raw["action"].numpy() + 1) / (4 + 1e-6) - 1, -1.5, 1.5) * raw["action_mask"].numpy()
    np.testing.assert_allclose(got["action"].numpy(), expect, rtol=1e-5, atol=1e-6)
    rows = np.array(pq.read_table(root / "one" / "data" / "chunk-000" / "episode_000000.parquet")
                    .column("action").to_pylist())
    np.testing.assert_allclose(raw["action"][:3, 1].numpy().T, rows[0:4], rtol=1e-6)  # frame 1: frames 0..3
    assert raw["action_mask"][:3].all() and not raw["action_mask"][3:].any()
    with pytest.raises(ValueError, match="q01 and q99 must each hold 30 values"):
        BundleDataset(root, norm_stat={"q01": [0.0] * 3, "q99": [1.0] * 3})


def test_text_dropout_is_a_pure_function_of_seed_epoch_and_item(bundle: Path) -> None:
    ds = BundleDataset(bundle, cameras=[MAIN, LEFT, RIGHT], action_channels=ROBOTWIN_CHANNELS, cfg_prob=0.5, seed=3)
    draws = {e: [ds.set_epoch(e) or ds.drops_text(i) for i in range(len(ds))] for e in range(6)}
    again = pickle.loads(pickle.dumps(ds))  # a DataLoader worker's copy
    again.set_epoch(4)
    assert [again.drops_text(i) for i in range(len(ds))] == draws[4]
    flat = sum(draws.values(), [])
    assert 0 < sum(flat) < len(flat)  # both outcomes occur at p = 0.5 over 24 draws
    ds.set_epoch(next(e for e, d in draws.items() if d[0]))
    torch.testing.assert_close(ds[0]["text"], torch.load(bundle / "empty_emb.pt", weights_only=True).float())
    assert all(not d for d in [BundleDataset(bundle, cameras=[MAIN, LEFT, RIGHT], action_channels=ROBOTWIN_CHANNELS,
                                             cfg_prob=0.0).drops_text(i) for i in range(4)])


def test_relative_pose_matches_rotation_matrices() -> None:
    rng = np.random.default_rng(0)
    q = rng.normal(size=(5, 4))
    q /= np.linalg.norm(q, axis=1, keepdims=True)
    x = np.concatenate([rng.normal(size=(5, 3)), q, rng.normal(size=(5, 1))], axis=1)
    out = relative_pose(x, (0,), "t")

    def mat(v: np.ndarray) -> np.ndarray:  # scalar-last unit quaternion -> rotation matrix
        a, b, c, d = v[3], v[0], v[1], v[2]
        return np.array([[a*a+b*b-c*c-d*d, 2*(b*c-a*d), 2*(b*d+a*c)], [2*(b*c+a*d), a*a-b*b+c*c-d*d, 2*(c*d-a*b)],
                         [2*(b*d-a*c), 2*(c*d+a*b), a*a-b*b-c*c+d*d]])
    for t in range(5):
        np.testing.assert_allclose(mat(out[t, 3:7]), mat(q[0]).T @ mat(q[t]), atol=1e-12)
    np.testing.assert_allclose(out[:, :3], x[:, :3] - x[:1, :3])
    np.testing.assert_array_equal(out[:, 7], x[:, 7])


def test_bad_bundles_are_one_line_naming_the_file(tmp_path: Path) -> None:
    root = write_bundle(tmp_path / "b", [SyntheticDataset(name="d", episodes=[[(0, 17), (17, 34)], [(0, 21)]],
                                                          cameras=TSHAPE)])
    lat = root / "d" / "latents" / "chunk-000"
    (lat / RIGHT / "episode_000000_17_34.pth").unlink()
    with pytest.raises(ValueError, match=r"d: episode 0 segment 1 \[17, 34\): .*episode_000000_17_34.pth: no such"):
        BundleDataset(root, cameras=[MAIN, LEFT, RIGHT])
    ds = BundleDataset(root, cameras=[MAIN, LEFT, RIGHT], missing="skip")
    assert len(ds) == 2 and len(ds.skipped) == 1 and "segment 1" in ds.skipped[0][0]

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))
    torch.save({"latent": Evil()}, lat / MAIN / "episode_000001_0_21.pth")
    with pytest.raises(ValueError, match="episode_000001_0_21.pth: refused: loading it would run code"):
        BundleDataset(root, cameras=[MAIN, LEFT, RIGHT], missing="skip")

    torch.save({"latent": torch.zeros(7, 48), "latent_num_frames": 2, "latent_height": 4, "latent_width": 4,
                "frame_ids": list(range(5)), "text_emb": torch.zeros(16, 32)}, lat / MAIN / "episode_000001_0_21.pth")
    skipped = BundleDataset(root, cameras=[MAIN, LEFT, RIGHT], missing="skip", episodes=[0]).skipped
    assert len(skipped) == 2 and "latent has 7 rows but latent_num_frames x latent_height x latent_width = " \
        "2 x 4 x 4 = 32" in skipped[1][1]

    bad = write_bundle(tmp_path / "c", [SyntheticDataset(name="d", episodes=[[(0, 17)]], cameras=TSHAPE)])
    meta = bad / "d" / "meta" / "episodes.jsonl"
    row = json.loads(meta.read_text())
    row["action_config"][0]["end_frame"] = 99
    meta.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=r"episodes.jsonl: episode 0: action_config\[0\] frames \[0, 99\) do not fit"):
        BundleDataset(bad)
    with pytest.raises(ValueError, match="data.camera_layout = 'width_concat' needs one latent height"):
        BundleDataset(write_bundle(tmp_path / "e", [SyntheticDataset(name="d", episodes=[[(0, 9)]], cameras=TSHAPE)]),
                      cameras=[MAIN, LEFT, RIGHT], camera_layout="width_concat")


def test_frame_ids_that_do_not_fit_the_rows_name_the_segment(tmp_path: Path) -> None:
    root = write_bundle(tmp_path / "b", [SyntheticDataset(name="d", episodes=[[(0, 17)]], cameras={MAIN: (2, 2)},
                                                          tail=0)])
    pth = root / "d" / "latents" / "chunk-000" / MAIN / "episode_000000_0_17.pth"
    d = torch.load(pth, weights_only=True)
    d["frame_ids"] = list(range(0, 25))  # 7 latent frames over 17 rows
    d["latent_num_frames"] = 7
    d["latent"] = torch.zeros(7 * 4, 48)
    torch.save(d, pth)
    ds = BundleDataset(root, normalize=False)
    with pytest.raises(ValueError, match=r"d: episode 0 segment 0 \[0, 17\): .*need 24 parquet rows from frame 0, "
                                         "the segment has 17"):
        ds[0]
