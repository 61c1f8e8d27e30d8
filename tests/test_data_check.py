"""Every problem `flexpack check-dataset` names, produced on purpose; the dataset raises the same."""

import math
import os
import shutil

import pytest
import torch

os.environ["HF_HUB_OFFLINE"] = "1"
pytest.importorskip("lerobot")

from flexpack.cli import main  # noqa: E402
from flexpack.data import LatentEpisodeDataset, cache  # noqa: E402
from flexpack.data.check import check_dataset  # noqa: E402
from flexpack.data.encode import encode_dataset  # noqa: E402
from flexpack.data.episodes import EpisodeSource  # noqa: E402
from flexpack.data.problems import (  # noqa: E402
    CameraMissingError,
    DatasetProblemError,
    FramesMismatchError,
    MissingFileError,
    NonFiniteError,
    ShapeMismatchError,
    UnreadableFileError,
)
from flexpack.data.synthetic import make_synthetic_dataset  # noqa: E402

LENGTHS = [9, 13, 17]
CAMS = ["observation.images.cam0", "observation.images.cam1"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    root = make_synthetic_dataset(tmp_path_factory.mktemp("check") / "ds", lengths=LENGTHS, cameras=2, seed=4)
    src = EpisodeSource(root)
    assert src.task(0) != src.task(1) == src.task(2)  # damaging episode 1's text spares episode 0
    encode_dataset(root, progress=False)
    encode_dataset(root, cameras=["cam0"], progress=False)  # a second camera set, used to fake a wrong file
    return root


@pytest.fixture
def ds_copy(base, tmp_path):
    root = tmp_path / "ds"
    shutil.copytree(base, root)
    return root


def latent_file(root, episode, cams=CAMS):
    return cache.latent_path(root / "latents", cams, episode)


def rewrite_latent(path, latent=None, **header):
    """Rewrite a latent file with another tensor and/or header fields (no validation)."""
    from safetensors.torch import save_file

    head = cache.read_latent_header(path)
    z = cache.read_tensor(path, "latent") if latent is None else latent
    meta = head.to_metadata()
    if latent is not None:
        meta.update(channels=str(z.shape[0]), frames=str(z.shape[1]), height=str(z.shape[2]), width=str(z.shape[3]))
    meta.update({k: str(v) for k, v in header.items()})
    save_file({"latent": z.to(torch.bfloat16)}, str(path), metadata=meta)


def set_action_nan(root, episode, row):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = EpisodeSource(root).data_file(episode)
    table = pq.read_table(path)
    eps = table.column("episode_index").to_pylist()
    actions = table.column("action").to_pylist()
    actions[eps.index(episode) + row][0] = math.nan
    field = table.schema.field("action")
    table = table.set_column(table.schema.get_field_index("action"), field, pa.array(actions, type=field.type))
    pq.write_table(table, path)
    return path


def damage_missing(root):
    latent_file(root, 1).unlink()
    return [("missing", 1, latent_file(root, 1))], MissingFileError


def damage_garbage(root):
    latent_file(root, 1).write_bytes(b"\x00garbage, not safetensors")
    return [("unreadable", 1, latent_file(root, 1))], UnreadableFileError


def damage_truncated(root):
    path = latent_file(root, 1)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) - 40])
    return [("unreadable", 1, path)], UnreadableFileError


def damage_other_episode(root):
    shutil.copyfile(latent_file(root, 2), latent_file(root, 1))
    return [("unreadable", 1, latent_file(root, 1)), ("frames", 1, latent_file(root, 1)),
            ("shape", 1, latent_file(root, 1))], UnreadableFileError


def damage_frames(root):
    path = latent_file(root, 1)
    rewrite_latent(path, cache.read_tensor(path, "latent")[:, :-1])
    # 13 video frames want 4 latent frames: wrong against metadata and against the 13 action rows
    return [("frames", 1, path), ("shape", 1, path)], FramesMismatchError


def damage_video_frames(root):
    path = latent_file(root, 1)
    rewrite_latent(path, video_frames=14)  # same F (4), but not the episode's 13 action rows
    return [("shape", 1, path)], ShapeMismatchError


def damage_header_shape(root):
    path = latent_file(root, 1)
    rewrite_latent(path, height=3)
    return [("shape", 1, path)], ShapeMismatchError


def damage_nan_latent(root):
    path = latent_file(root, 1)
    z = cache.read_tensor(path, "latent")
    z[3, 1, 0, 2] = float("nan")
    z[0, 0, 1, 1] = float("inf")
    rewrite_latent(path, z)
    return [("nonfinite", 1, path)], NonFiniteError


def damage_nan_action(root):
    data_file = set_action_nan(root, 1, row=5)
    return [("nonfinite", 1, data_file)], NonFiniteError


def damage_camera(root):
    shutil.copyfile(latent_file(root, 1, CAMS[:1]), latent_file(root, 1))
    return [("camera", 1, latent_file(root, 1))], CameraMissingError


def damage_text(root):
    src = EpisodeSource(root)
    _, task_index = src.task(1)
    first = min(e for e in src.episodes if src.task(e)[1] == task_index)
    path = cache.text_path(root / "latents", task_index)
    path.unlink()
    return [("missing", first, path)], MissingFileError


DAMAGES = [damage_missing, damage_garbage, damage_truncated, damage_other_episode, damage_frames,
           damage_video_frames, damage_header_shape, damage_nan_latent, damage_nan_action, damage_camera, damage_text]


def test_clean_dataset_has_no_problems(base, capsys):
    problems, _ = check_dataset(base)
    assert problems == []
    assert main(["check-dataset", str(base)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("normalization bounds (pooled") and out.splitlines()[-1].startswith("ok: 3 episodes")


@pytest.mark.parametrize("damage", DAMAGES, ids=lambda f: f.__name__[len("damage_"):])
def test_each_problem_is_reported_and_raised(damage, ds_copy, capsys):
    expected, error = damage(ds_copy)
    problems, _ = check_dataset(ds_copy)
    assert sorted((p.kind, p.episode, p.file) for p in problems) == sorted(expected)

    assert main(["check-dataset", str(ds_copy)]) == 1
    out = capsys.readouterr().out.splitlines()
    for kind, episode, path in expected:
        assert any(f"[{kind}]" in line and f"episode {episode}:" in line and str(path) in line for line in out), out
    assert out[-1].startswith(f"{len(expected)} problem(s)")

    ds = LatentEpisodeDataset(ds_copy)
    with pytest.raises(error) as info:
        ds[1]
    assert isinstance(info.value, DatasetProblemError)
    assert isinstance(info.value, FileNotFoundError if error is MissingFileError else ValueError)
    assert str(expected[0][2]) in str(info.value) and "episode" in str(info.value)
    assert info.value.problem.kind == expected[0][0]
    ds[0]  # the other episodes still load (episode 0 shares no damaged file)


def test_latent_shapes_must_agree_across_episodes(ds_copy):
    path = latent_file(ds_copy, 2)
    z = cache.read_tensor(path, "latent")
    rewrite_latent(path, torch.cat([z, z[..., :1]], -1))  # one latent column wider than episodes 0 and 1
    problems, _ = check_dataset(ds_copy)
    assert [(p.kind, p.episode, p.file) for p in problems] == [("shape", 2, path)]
    assert "differs from episode 0" in problems[0].message
    assert LatentEpisodeDataset(ds_copy)[2]["latent"].shape[-1] == 5  # each item alone is consistent


def test_camera_not_in_dataset(base, capsys):
    problems, _ = check_dataset(base, cameras=["cam0", "cam7"])
    kinds = [(p.kind, p.episode, p.file) for p in problems]
    assert ("camera", None, base / "meta" / "info.json") in kinds
    assert kinds == [("camera", None, base / "meta" / "info.json")]  # no "missing" file per episode on top
    assert "cam7" in str(problems[0])
    assert main(["check-dataset", str(base), "--cameras", "cam7"]) == 1
    assert "cam7" in capsys.readouterr().out
    with pytest.raises(CameraMissingError, match="cam7"):
        LatentEpisodeDataset(base, cameras=["cam7"])


def test_not_a_dataset(tmp_path, capsys):
    assert main(["check-dataset", str(tmp_path)]) == 1
    assert "info.json" in capsys.readouterr().out
    with pytest.raises(FileNotFoundError, match="info.json"):
        LatentEpisodeDataset(tmp_path)


# --- datasets that cannot be checked at all: one clear error, never a traceback or a hub download ---


def test_empty_dataset(tmp_path, capsys):
    from lerobot.datasets.lerobot_dataset import LeRobotDataset

    root = tmp_path / "empty"
    features = {"action": {"dtype": "float32", "shape": (2,), "names": ["a0", "a1"]}}
    LeRobotDataset.create("local/empty", fps=10, features=features, root=root, use_videos=False).finalize()
    assert main(["check-dataset", str(root)]) == 2
    err = capsys.readouterr().err
    assert "info.json: the dataset has no episodes" in err and "Traceback" not in err
    assert main(["encode", "--dataset", str(root), "--no-progress"]) == 2
    assert "has no episodes" in capsys.readouterr().err
    with pytest.raises(ValueError, match="has no episodes"):
        LatentEpisodeDataset(root)


@pytest.mark.parametrize("missing", ["meta/tasks.parquet", "meta/episodes", "data"])
def test_missing_metadata_or_data_is_named_not_downloaded(missing, ds_copy, capsys):
    # lerobot would fetch a missing file from the hub (offline here: an unrelated hub error)
    shutil.rmtree(ds_copy / missing) if (ds_copy / missing).is_dir() else (ds_copy / missing).unlink()
    assert main(["check-dataset", str(ds_copy)]) == 1
    out = capsys.readouterr().out
    assert out.startswith("[missing] dataset: ") and str(ds_copy / missing) in out
    with pytest.raises(FileNotFoundError, match=str(ds_copy / missing)):
        LatentEpisodeDataset(ds_copy, segments=missing != "data")[0]


@pytest.mark.parametrize("text", ["{not json", "{}"])
def test_malformed_info_json(text, tmp_path, capsys):
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / "info.json").write_text(text)
    assert main(["check-dataset", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "info.json: not LeRobot v3 metadata" in err and "Traceback" not in err
    assert main(["stats", "--dataset", str(tmp_path), "--mode", "pad"]) == 2
    assert "info.json: not LeRobot v3 metadata" in capsys.readouterr().err


def test_bad_stride(base, capsys):
    assert main(["check-dataset", str(base), "--stride", "0"]) == 2
    assert "stride must be >= 1, got 0" in capsys.readouterr().err
