"""Annotated segments (per-frame task runs) as dataset items; make-dataset's size check."""

import os
import shutil

import numpy as np
import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"

from flexpack.data.actions import step_frames  # noqa: E402
from flexpack.data.segments import episode_segments, segment_latent_range, task_runs  # noqa: E402


def covered(f, stride=4):
    """Video frames latent frame f covers (independent of the code under test)."""
    return {0} if f == 0 else set(range(stride * (f - 1) + 1, stride * f + 1))


def test_task_runs():
    assert task_runs(np.array([3, 3, 1, 1, 1, 3, 2])) == [(0, 2, 3), (2, 5, 1), (5, 6, 3), (6, 7, 2)]
    assert task_runs(np.array([5] * 4)) == [(0, 4, 5)]
    assert task_runs(np.array([], dtype=int)) == []


@pytest.mark.parametrize("stride", [1, 2, 4])
def test_segment_latent_range_is_the_latent_frames_inside_the_run(stride):
    for n in range(1, 30):
        F = (n - 1) // stride + 1
        for start in range(n):
            for stop in range(start + 1, n + 1):
                inside = [f for f in range(F) if covered(f, stride) <= set(range(start, stop))]
                f0, f1 = segment_latent_range(start, stop, stride)
                assert list(range(f0, f1)) == inside, (n, start, stop)
    assert segment_latent_range(0, 9) == (0, 3) and segment_latent_range(5, 13) == (2, 4)
    assert segment_latent_range(1, 5) == (1, 2) and segment_latent_range(2, 9) == (2, 3)
    assert segment_latent_range(2, 5) == (2, 2)  # frames 2..4 hold no whole latent frame
    with pytest.raises(ValueError, match="start=3, stop=3"):
        segment_latent_range(3, 3)


def test_episode_segments_skip_short_runs_and_keep_run_numbers():
    tasks = np.array([7] * 6 + [2] * 2 + [7] * 9)  # runs [0,6) [6,8) [8,17)
    segs = episode_segments(4, tasks)
    assert [(s.segment, s.task_index, s.start, s.stop, s.f0, s.f1) for s in segs] == [
        (0, 7, 0, 6, 0, 2), (2, 7, 8, 17, 3, 5)]
    assert all(s.episode == 4 for s in segs) and [s.frames for s in segs] == [2, 2]
    # every action step of a segment's latent frames is a video frame inside the segment
    for s in segs:
        v = step_frames(s.f1, 4, 4)[s.f0:]
        assert ((v < 0) | ((v >= s.start) & (v < s.stop))).all()


# -- LeRobot datasets with subtasks ------------------------------------------------------------

LENGTHS = [1, 21, 30, 33]  # a 1-frame episode has one run however many subtasks are asked for


@pytest.fixture(scope="module")
def sub(tmp_path_factory):
    pytest.importorskip("lerobot")
    from flexpack.data.encode import encode_dataset
    from flexpack.data.synthetic import make_synthetic_dataset

    root = make_synthetic_dataset(tmp_path_factory.mktemp("sub") / "ds", lengths=LENGTHS, subtasks=3,
                                  index_actions=True, seed=5)
    encode_dataset(root, progress=False)
    return root


def parquet_tasks(root):
    """Per-frame task_index per episode and task strings, read with pandas (not the code under test)."""
    import pandas as pd

    df = pd.read_parquet(sorted((root / "data").rglob("*.parquet")),
                         columns=["episode_index", "frame_index", "task_index"])
    tasks = pd.read_parquet(root / "meta" / "tasks.parquet")
    names = dict(zip(tasks["task_index"], tasks.index))
    per_ep = {int(e): g.sort_values("frame_index")["task_index"].to_numpy() for e, g in df.groupby("episode_index")}
    return per_ep, names


def expected_items(root, split_single=False):
    per_ep, names = parquet_tasks(root)
    out = []
    for ep, t in sorted(per_ep.items()):
        cuts = [0] + [i for i in range(1, len(t)) if t[i] != t[i - 1]] + [len(t)]
        if len(cuts) == 2 and not split_single:
            out.append((ep, -1, (0, len(t)), (0, (len(t) - 1) // 4 + 1), names[t[0]]))
            continue
        for j, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
            inside = [f for f in range((len(t) - 1) // 4 + 1) if covered(f) <= set(range(a, b))]
            if inside:
                out.append((ep, j, (a, b), (inside[0], inside[-1] + 1), names[t[a]]))
    return out


def describe(item):
    return item["episode_index"], item["segment"], item["frame_range"], item["latent_range"], item["task"]


def test_make_dataset_annotates_subtasks(sub):
    per_ep, names = parquet_tasks(sub)
    assert [len(per_ep[e]) for e in range(len(LENGTHS))] == LENGTHS
    for ep, t in per_ep.items():
        runs = task_runs(t)
        assert len(runs) == min(3, LENGTHS[ep])
        assert len({task for _, _, task in runs}) == len(runs)  # consecutive subtasks differ
    assert len(names) >= 3


def test_items_per_segment(sub, tmp_path):
    from flexpack.data import LatentEpisodeDataset

    ds = LatentEpisodeDataset(sub, normalize=False, action_dim=8)
    items = [ds[i] for i in range(len(ds))]
    want = expected_items(sub)
    assert [describe(it) for it in items] == want
    assert sum(1 for w in want if w[1] >= 0) >= 6 and want[0][1] == -1  # segments, and episode 0 whole
    # lengths() from metadata + task_index alone: no latent is read (the cache folder is empty)
    assert LatentEpisodeDataset(sub, latents_dir=tmp_path).lengths() == ds.lengths() == [it["length"] for it in items]
    whole = LatentEpisodeDataset(sub, normalize=False, action_dim=8, segments=False)
    for it in items:
        ep, (s, e), (f0, f1), F = it["episode_index"], it["frame_range"], it["latent_range"], it["length"]
        assert it["latent"].shape == (48, F, 2, 2) and F == f1 - f0 >= 1
        torch.testing.assert_close(it["latent"], whole[ep]["latent"][:, f0:f1])
        # index-encoding actions: column 0 = video frame, column 1 = episode; all inside [s, e)
        act, mask = it["action"], it["action_mask"]
        for f in range(F):
            frames = [None, None, None, 0] if f0 + f == 0 else [4 * (f0 + f) - 3 + a for a in range(4)]
            for a, v in enumerate(frames):
                if v is None:
                    assert not mask[:, f, a].any()
                    continue
                assert s <= v < e and mask[:6, f, a].all() and not mask[6:, f, a].any()
                assert act[0, f, a] == v and act[1, f, a] == ep and act[5, f, a] == v + 5000
    # segments=True also makes a one-run episode a (single) segment
    every = LatentEpisodeDataset(sub, segments=True)
    assert [(e, s.segment, s.f0, s.f1) for e, s in every.items] == [
        (w[0], max(w[1], 0), *w[3]) for w in expected_items(sub, split_single=True)]
    with pytest.raises(ValueError, match="segments must be"):
        LatentEpisodeDataset(sub, segments="yes")


def test_each_segment_has_its_own_task_text(sub):
    from flexpack.data import LatentEpisodeDataset
    from flexpack.data.text import HashTextEncoder

    ds = LatentEpisodeDataset(sub)
    items = [ds[i] for i in range(len(ds))]
    enc = HashTextEncoder()
    for it in items:
        expected, n = enc.encode(it["task"])
        torch.testing.assert_close(it["text"], expected.bfloat16().float())
        assert it["text_len"] == n
    by_task = {it["task"]: it["text"] for it in items}
    assert len(by_task) >= 3
    texts = list(by_task.values())
    assert all(not torch.equal(a, b) for i, a in enumerate(texts) for b in texts[i + 1:])
    # segments of one episode carry different tasks
    tasks_of_ep2 = [it["task"] for it in items if it["episode_index"] == 2]
    assert len(tasks_of_ep2) >= 2 and len(set(tasks_of_ep2)) == len(tasks_of_ep2)


def test_whole_episode_mode(sub):
    from flexpack.data import LatentEpisodeDataset

    per_ep, names = parquet_tasks(sub)
    ds = LatentEpisodeDataset(sub, normalize=False, segments=False)
    assert len(ds) == len(LENGTHS) and ds.lengths() == [(n - 1) // 4 + 1 for n in LENGTHS]
    for i in range(len(ds)):
        it = ds[i]
        assert (it["segment"], it["frame_range"], it["latent_range"]) == (-1, (0, LENGTHS[i]), (0, ds.lengths()[i]))
        assert it["task"] == names[per_ep[i][0]]  # the first frame's task
        assert it["action"][0, -1, -1] == 4 * (it["length"] - 1)


def test_check_dataset_covers_every_subtask_text(sub, tmp_path, capsys):
    from flexpack.cli import main
    from flexpack.data import LatentEpisodeDataset, cache
    from flexpack.data.problems import MissingFileError

    assert main(["check-dataset", str(sub)]) == 0
    assert "ok: 4 episodes" in capsys.readouterr().out
    root = tmp_path / "ds"
    shutil.copytree(sub, root)
    ds = LatentEpisodeDataset(root)
    victim = next(i for i, (ep, seg) in enumerate(ds.items) if seg is not None and seg.segment == 2)
    ep, seg = ds.items[victim]
    path = cache.text_path(root / "latents", seg.task_index)
    path.unlink()
    assert main(["check-dataset", str(root)]) == 1
    out = capsys.readouterr().out
    assert "[missing]" in out and str(path) in out
    with pytest.raises(MissingFileError, match=f"episode {ep}"):
        ds[victim]


def test_make_dataset_refuses_sizes_the_video_encoder_crashes_on(tmp_path, capsys):
    pytest.importorskip("lerobot")
    from flexpack.cli import main
    from flexpack.data.synthetic import make_synthetic_dataset

    # size 16 used to kill the process with SIGFPE inside lerobot's SVT-AV1 encoder (exit 136)
    for size in ["16", "24", "40"]:
        assert main(["make-dataset", str(tmp_path / "x"), "--lengths", "9,17,33,5,41", "--size", size]) == 2
        err = capsys.readouterr().err
        assert f"size={size}" in err and "multiple of 16" in err and ">= 32" in err
        assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match="size=8"):
        make_synthetic_dataset(tmp_path / "y", lengths=[5], size=8)
    with pytest.raises(ValueError, match="subtasks"):
        make_synthetic_dataset(tmp_path / "y", lengths=[5], subtasks=5)
    assert main(["make-dataset", str(tmp_path / "z"), "--lengths", "9,x"]) == 2
    assert "--lengths" in capsys.readouterr().err
