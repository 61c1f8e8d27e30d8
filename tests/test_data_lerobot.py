"""LeRobot datasets built with lerobot's API, encoded into the latent cache, read back as items."""

import json
import os
import shutil

import numpy as np
import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("lerobot")

from flexpack.cli import main  # noqa: E402
from flexpack.data import LatentEpisodeDataset, cache, dataset_latent_frames  # noqa: E402
from flexpack.data.encode import encode_dataset  # noqa: E402
from flexpack.data.encoders import PoolEncoder  # noqa: E402
from flexpack.data.episodes import EpisodeSource  # noqa: E402
from flexpack.data.synthetic import make_synthetic_dataset  # noqa: E402
from flexpack.data.text import HashTextEncoder  # noqa: E402

ONE_CAM = [9, 14, 18, 25]  # video frames -> F = 3, 4, 5, 7
TWO_CAM = [5, 12, 17]  # -> F = 2, 3, 5


@pytest.fixture(scope="module")
def one_cam(tmp_path_factory):
    root = make_synthetic_dataset(tmp_path_factory.mktemp("one") / "ds", lengths=ONE_CAM, cameras=1, index_actions=True)
    encode_dataset(root, progress=False)
    return root


@pytest.fixture(scope="module")
def two_cam(tmp_path_factory):
    root = make_synthetic_dataset(tmp_path_factory.mktemp("two") / "ds", lengths=TWO_CAM, cameras=2, seed=3)
    encode_dataset(root, progress=False)
    return root


def test_lengths_from_metadata_equal_latent_files(one_cam, two_cam):
    for root, lengths, cams in [(one_cam, ONE_CAM, ["cam0"]), (two_cam, TWO_CAM, ["cam0", "cam1"])]:
        expected = [(n - 1) // 4 + 1 for n in lengths]
        assert dataset_latent_frames(root) == expected
        ds = LatentEpisodeDataset(root)
        assert ds.lengths() == expected and len(ds) == len(lengths)
        headers = [cache.read_latent_header(cache.latent_path(root / "latents",
                                                              ["observation.images." + c for c in cams], e))
                   for e in range(len(lengths))]
        assert [h.frames for h in headers] == expected
        assert [h.video_frames for h in headers] == lengths
        assert [ds[i]["latent"].shape[1] for i in range(len(ds))] == expected
    assert dataset_latent_frames(one_cam, stride=2) == [(n - 1) // 2 + 1 for n in ONE_CAM]


@pytest.mark.parametrize("which,width", [("one_cam", 2), ("two_cam", 4)])
def test_item_shapes_and_dtypes(which, width, request):
    root = request.getfixturevalue(which)
    ds = LatentEpisodeDataset(root, action_dim=32, action_steps=4)
    tasks = EpisodeSource(root).meta.episodes["tasks"]
    for i in range(len(ds)):
        item = ds[i]
        F = ds.lengths()[i]
        assert set(item) == {"latent", "action", "action_mask", "text", "text_len", "episode_index", "task", "length",
                             "segment", "frame_range", "latent_range"}
        assert item["latent"].shape == (48, F, 2, width) and item["latent"].dtype == torch.float32
        assert item["action"].shape == (32, F, 4) and item["action"].dtype == torch.float32
        assert item["action_mask"].shape == (32, F, 4) and item["action_mask"].dtype == torch.bool
        assert item["text"].shape == (16, 64) and item["text"].dtype == torch.float32
        assert isinstance(item["text_len"], int) and item["text_len"] == len(item["task"].split())
        assert item["episode_index"] == i and item["length"] == F
        assert item["task"] == tasks[i][0]
        assert torch.isfinite(item["latent"]).all() and item["latent"].abs().sum() > 0


def test_latents_are_the_encoded_video_and_cameras_join_along_width(two_cam):
    src = EpisodeSource(two_cam)
    enc = PoolEncoder()
    item = LatentEpisodeDataset(two_cam)[2]  # 17 frames -> F = 5, all 17 used
    cam0 = enc.encode(src.decode(2, "observation.images.cam0", 17))
    cam1 = enc.encode(src.decode(2, "observation.images.cam1", 17))
    torch.testing.assert_close(item["latent"], torch.cat([cam0, cam1], -1).bfloat16().float())
    assert not torch.allclose(cam0, cam1, atol=0.05)
    # a single-camera cache lives next to it and holds camera 1 only
    encode_dataset(two_cam, cameras=["cam1"], progress=False)
    one = LatentEpisodeDataset(two_cam, cameras=["observation.images.cam1"])
    torch.testing.assert_close(one[2]["latent"], item["latent"][..., 2:])


def test_actions_line_up_with_video_frames(one_cam):
    ds = LatentEpisodeDataset(one_cam, normalize=False, action_dim=8)
    for i, n in enumerate(ONE_CAM):
        item = ds[i]
        act, mask = item["action"], item["action_mask"]
        F = item["length"]
        for f in range(F):
            frames = [None, None, None, 0] if f == 0 else [4 * f - 3, 4 * f - 2, 4 * f - 1, 4 * f]
            for a, v in enumerate(frames):
                if v is None:
                    assert not mask[:, f, a].any() and not act[:, f, a].any()
                    continue
                assert v < n and mask[:6, f, a].all() and not mask[6:, f, a].any()
                assert act[0, f, a] == v and act[1, f, a] == i  # column 0 = frame index, 1 = episode
                assert act[2:6, f, a].tolist() == [v + 1000 * k for k in range(2, 6)]
        assert int(mask[0].sum()) == 1 + 4 * (F - 1)
    # two steps per latent frame: the last frame of each pair
    item = LatentEpisodeDataset(one_cam, normalize=False, action_steps=2)[1]
    assert item["action"][0].tolist() == [[0, 0], [2, 4], [6, 8], [10, 12]]
    assert item["action_mask"][0].tolist() == [[False, True]] + [[True, True]] * 3
    # a channel mapping puts dataset columns where the model wants them
    item = LatentEpisodeDataset(one_cam, normalize=False, action_dim=10, action_channels=[9, 8, 0, 1, 2, 3])[1]
    assert item["action"][9, 2].tolist() == [5, 6, 7, 8] and item["action"][8, 2].tolist() == [1] * 4
    assert not item["action_mask"][4:8].any()


def test_normalization_uses_lerobots_stats_when_asked(two_cam, tmp_path):
    stats = json.loads((two_cam / "meta" / "stats.json").read_text())["action"]
    q01, q99 = np.array(stats["q01"]), np.array(stats["q99"])
    assert (q99 - q01 > 0.1).all()
    raw = LatentEpisodeDataset(two_cam, normalize=False)
    norm = LatentEpisodeDataset(two_cam, action_stats="lerobot")  # meta/stats.json, as LeRobot wrote it
    for i in range(len(raw)):
        x, m = raw[i]["action"][:6], raw[i]["action_mask"][:6]
        y = norm[i]["action"][:6]
        expected = np.clip(2 * (x.numpy() - q01[:, None, None]) / (q99 - q01)[:, None, None] - 1, -1, 1)
        np.testing.assert_allclose(y.numpy()[m.numpy()], expected[m.numpy()], rtol=1e-5, atol=1e-5)
        assert not y[~m].any()
    # without quantiles in stats.json the dataset falls back to mean/std
    copy = tmp_path / "ds"
    shutil.copytree(two_cam, copy)
    all_stats = json.loads((copy / "meta" / "stats.json").read_text())
    for key in [k for k in all_stats["action"] if k.startswith("q")]:
        del all_stats["action"][key]
    (copy / "meta" / "stats.json").write_text(json.dumps(all_stats))
    mean, std = np.array(stats["mean"]), np.array(stats["std"])
    item, raw_item = LatentEpisodeDataset(copy, action_stats="lerobot")[1], raw[1]
    m = raw_item["action_mask"][:6].numpy()
    expected = (raw_item["action"][:6].numpy() - mean[:, None, None]) / std[:, None, None]
    np.testing.assert_allclose(item["action"][:6].numpy()[m], expected[m], rtol=1e-5, atol=1e-5)


def test_text_embeddings_are_cached_per_task(one_cam):
    ds = LatentEpisodeDataset(one_cam)
    enc = HashTextEncoder()
    items = [ds[i] for i in range(len(ds))]
    for item in items:
        expected, n = enc.encode(item["task"])
        assert item["text_len"] == n
        torch.testing.assert_close(item["text"], expected.bfloat16().float())
    by_task = {}
    for item in items:
        by_task.setdefault(item["task"], []).append(item["text"])
    assert len(by_task) >= 2
    src = EpisodeSource(one_cam)
    assert sorted(p.name for p in (one_cam / "latents" / "text").iterdir()) == [
        f"task_{i:06d}.safetensors" for i in sorted(src.tasks())
    ]


def test_encode_resumes_and_rewrites_only_broken_files(one_cam, tmp_path):
    root = tmp_path / "ds"
    shutil.copytree(one_cam, root)
    cams = ["observation.images.cam0"]
    report = encode_dataset(root, progress=False)
    assert report.encoded == [] and report.skipped == [0, 1, 2, 3] and report.texts_written == []
    cache.latent_path(root / "latents", cams, 1).unlink()
    cache.latent_path(root / "latents", cams, 3).write_bytes(b"not a safetensors file")
    untouched = cache.latent_path(root / "latents", cams, 0)
    mtime = untouched.stat().st_mtime_ns
    report = encode_dataset(root, progress=False)
    assert report.encoded == [1, 3] and report.skipped == [0, 2]
    assert untouched.stat().st_mtime_ns == mtime
    assert LatentEpisodeDataset(root)[3]["latent"].shape == (48, 7, 2, 2)
    assert not [p for p in (root / "latents").rglob("*") if ".tmp-" in p.name]


def test_cli_make_encode_check(tmp_path, capsys):
    root = tmp_path / "cli"
    assert main(["make-dataset", str(root), "--lengths", "6,11", "--cameras", "2", "--size", "32", "--seed", "1"]) == 0
    assert main(["encode", "--dataset", str(root), "--no-progress", "--latents-dir", str(tmp_path / "lat")]) == 0
    out = capsys.readouterr().out
    assert "encoded 2 episode(s)" in out
    assert main(["check-dataset", str(root), "--latents-dir", str(tmp_path / "lat")]) == 0
    assert "ok: 2 episodes" in capsys.readouterr().out
    assert dataset_latent_frames(root) == [2, 3]
    item = LatentEpisodeDataset(root, latents_dir=tmp_path / "lat")[1]
    assert item["latent"].shape == (48, 3, 2, 4)
    # the default cache location is empty: check-dataset says so and fails
    assert main(["check-dataset", str(root)]) == 1
    assert "[missing]" in capsys.readouterr().out


def test_dataloader_workers_give_the_same_items(one_cam):
    ds = LatentEpisodeDataset(one_cam)
    ds[0]  # the lazily opened lerobot dataset must not travel to the workers
    loader = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=2)
    items = list(loader)
    assert [it["episode_index"] for it in items] == [0, 1, 2, 3]
    for i, it in enumerate(items):
        direct = ds[i]
        assert torch.equal(it["latent"], direct["latent"]) and torch.equal(it["action"], direct["action"])
        assert torch.equal(it["action_mask"], direct["action_mask"]) and it["task"] == direct["task"]


def test_make_dataset_bad_counts_and_no_partial_dataset(tmp_path, capsys, monkeypatch):
    for argv, msg in [(["--episodes", "0"], "episodes must be >= 1, got 0"),
                      (["--action-dim", "0"], "action_dim must be >= 1, got 0")]:
        assert main(["make-dataset", str(tmp_path / "ds"), *argv]) == 2
        err = capsys.readouterr().err
        assert msg in err and "Traceback" not in err
    # a run that fails half-way leaves neither the dataset nor its temporary folder, so a rerun works
    import flexpack.data.synthetic as synthetic

    frame = synthetic._frame

    def fail_in_episode_1(t, episode, camera, size):
        if episode == 1:
            raise OSError("disk full")
        return frame(t, episode, camera, size)

    monkeypatch.setattr(synthetic, "_frame", fail_in_episode_1)
    assert main(["make-dataset", str(tmp_path / "ds"), "--lengths", "5,5"]) == 2
    assert "disk full" in capsys.readouterr().err
    assert os.listdir(tmp_path) == []
    monkeypatch.setattr(synthetic, "_frame", frame)
    assert main(["make-dataset", str(tmp_path / "ds"), "--lengths", "5"]) == 0
    assert dataset_latent_frames(tmp_path / "ds") == [2] and os.listdir(tmp_path) == ["ds"]


def test_encode_errors_name_dataset_episode_and_file(one_cam, tmp_path, capsys):
    assert main(["encode", "--dataset", str(tmp_path / "nope"), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "nope/meta/info.json" in err and "Traceback" not in err
    assert main(["encode", "--dataset", str(one_cam), "--cameras", "cam9", "--no-progress"]) == 2
    assert "camera 'cam9' is not in the dataset" in capsys.readouterr().err
    # a damaged video: the episodes already cached stay, the error names the file and the episode
    root = tmp_path / "ds"
    shutil.copytree(one_cam, root)
    cams = ["observation.images.cam0"]
    cache.latent_path(root / "latents", cams, 2).unlink()
    video = EpisodeSource(root).video_file(2, cams[0])
    video.write_bytes(video.read_bytes()[:300])
    assert main(["encode", "--dataset", str(root), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"{video}: cannot decode camera 'observation.images.cam0' of episode 2" in err and "Traceback" not in err
    assert [cache.latent_path(root / "latents", cams, e).is_file() for e in range(4)] == [True, True, False, True]
