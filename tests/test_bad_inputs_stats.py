"""Statistics that cannot be right are refused wherever they are read: a NaN ``q01``, an infinite ``q99``,
swapped quantiles, a wrong length or a width below the floor in ``LATENTS/stats.json``, ``meta/stats.json``
or a checkpoint make ``check-dataset`` exit 1 and ``train``, ``export``, ``sample`` and a resume stop in one
line naming the file, the feature and the column. A genuinely constant column still normalizes to 0."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("lerobot")

from flexpack.cli import main  # noqa: E402
from flexpack.data.actions import ActionNormalizer  # noqa: E402
from flexpack.data.stats_check import check_normalizer, check_stats  # noqa: E402
from flexpack.run.model import build_model  # noqa: E402
from flexpack.run.state import checkpoint, resume, runfolder  # noqa: E402
from helpers import TINY, run_cli, set_args, tiny_config, tiny_sets  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
GOOD = {"min": [-1.0, 0.5], "q01": [-0.9, 0.5], "q50": [0.0, 0.5], "q99": [0.9, 0.5], "max": [1.0, 0.5],
        "mean": [0.0, 0.5], "std": [0.5, 0.0]}  # column 1 is constant


@pytest.mark.parametrize("key,value,message", [
    ("q01", [math.nan, 0.5], "F: feature 'action' column 0: q01 is nan (statistics must be finite numbers)"),
    ("q99", [math.inf, 0.5], "F: feature 'action' column 0: q99 is inf"),
    ("q01", [0.95, 0.5], "F: feature 'action' column 0: q01 = 0.95 > q50 = 0 (they must not decrease: "
                         "min <= q01 <= q50 <= q99 <= max)"),
    ("q99", [-0.95, 0.5], "column 0: q50 = 0 > q99 = -0.95"),
    ("q01", [-0.9], "F: feature 'action': q01 has 1 values, the feature has 2 columns"),
    ("mean", [3.0, 0.5], "column 0: mean = 3 lies outside [min, max] = [-1, 1]"),
    ("std", [-0.1, 0.0], "column 0: std = -0.1 is negative or wider than max - min"),
    ("q01", ["a", 0.5], "F: feature 'action': q01 is not a list of numbers"),
])
def test_statistics_that_cannot_be_right_are_one_line_naming_file_feature_and_column(key, value, message):
    stats = {**GOOD, key: value}
    with pytest.raises(ValueError) as info:
        check_stats(stats, width=2, where="F", feature="action")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_the_width_floor_and_a_constant_column():
    check_stats(GOOD, width=2, where="F", feature="action")  # column 1: q01 == q99, a constant column
    norm = ActionNormalizer.from_stats(GOOD, 2)
    y = norm(np.array([[0.3, 0.5], [0.9, 0.5]]))
    assert y[:, 1].tolist() == [0.0, 0.0] and y[1, 0] == pytest.approx(1.0)
    narrow = {"q01": [0.0, 100.0], "q99": [5e-7, 100.00005]}  # above 1e-8, below 1e-6 x max(1, |bounds|)
    with pytest.raises(ValueError, match=r"column 0: q99 - q01 = 5e-07 is above 1e-08 \(a constant column\) but "
                                         r"below the floor 1e-06"):
        check_stats(narrow, width=2, where="F", feature="action")
    with pytest.raises(ValueError, match=r"column 1: q99 - q01 = 5e-05 .* below the floor 0.0001"):
        check_stats({"q01": [0.0, 100.0], "q99": [1.0, 100.00005]}, width=2, where="F", feature="action")
    check_stats({"q01": [0.0, 100.0], "q99": [1e-6, 100.001]}, width=2, where="F", feature="action")
    with pytest.raises(ValueError, match=r"column 0: std = 5e-07 .* below the floor"):
        check_normalizer({"mode": "meanstd", "low": [0.0], "high": [5e-7]}, where="ckpt")
    with pytest.raises(ValueError, match="ckpt: the 'action' normalization is not"):
        check_normalizer({"mode": "quantiles", "low": [0.0], "high": [1.0]}, where="ckpt")


def _edit(path: Path, feature: str, key: str, column: int, value: float) -> None:
    data = json.loads(path.read_text())
    stats = data["features"][feature] if "features" in data else data[feature]
    stats[key][column] = value
    path.write_text(json.dumps(data))  # json writes NaN/Infinity, as a careless tool would


def _line(err: str, command: str) -> str:
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines[-1].startswith(f"flexpack {command}: error: "), err
    return lines[-1]


@pytest.mark.parametrize("where,key,value,message", [
    ("latents/stats.json", "q01", math.nan, "feature 'action' column 2: q01 is nan"),
    ("latents/stats.json", "q99", math.inf, "feature 'action' column 2: q99 is inf"),
    ("latents/stats.json", "q99", -0.9999, "feature 'action' column 2: q90 = "),  # q99 below the others
    ("meta/stats.json", "q01", 0.99, "feature 'action' column 2: q01 = 0.99 > q10 = "),
])
def test_check_dataset_and_train_refuse_a_broken_statistics_file(capsys, tiny_dataset, tmp_path, where, key, value,
                                                                 message):
    root = tmp_path / "ds"
    shutil.copytree(tiny_dataset, root)
    _edit(root / where, "action", key, 2, value)
    mode = "lerobot" if where.startswith("meta") else "pooled"
    code = main(["check-dataset", str(root), "--action-stats", mode])
    out = capsys.readouterr().out
    assert code == 1 and f"[stats] dataset: {root / where}: {message}" in out, out
    run = tmp_path / "run"
    code, err = run_cli(capsys, "train", str(TINY), *set_args(tiny_sets(root, run, "schedule.steps=1",
                                                                        f"data.action_stats={mode}")))
    line = _line(err, "train")
    assert code == 2 and f"{root / where}: {message}" in line
    assert not (run / "checkpoints").exists()  # nothing trained on them


def _run_with(folder: Path, root: Path, normalizer: dict) -> Path:
    """A run folder whose checkpoint carries ``normalizer`` as the statistics its weights were trained with."""
    cfg = tiny_config(root, folder)
    folder.mkdir(parents=True)
    runfolder.mark(folder)  # a run folder flexpack wrote: its marker, as train leaves it
    runfolder.record_start(folder, cfg.to_dict(), start_step=0, world_size=1)
    checkpoint.save(folder / "checkpoints", 2, build_model(cfg), None, config=cfg.to_dict(),
                    extra={"action_normalizer": normalizer})
    return folder / "checkpoints" / "step_00000002"


def test_a_checkpoints_statistics_are_checked_by_export_sample_and_resume(capsys, tiny_dataset, tmp_path):
    from flexpack.data import LatentEpisodeDataset

    dataset = LatentEpisodeDataset(tiny_dataset, action_dim=6)
    saved = resume.normalizer_state(dataset).to_json()
    saved["high"][3] = saved["low"][3] - 0.5  # q99 below q01 in column 3
    found = _run_with(tmp_path / "run", tiny_dataset, saved)
    message = f"{found / 'train_state.json'} (extra.action_normalizer): feature 'action' column 3: q01 = "
    code, err = run_cli(capsys, "export", str(tmp_path / "run"), str(tmp_path / "exp"))
    assert code == 2 and message in _line(err, "export") and not (tmp_path / "exp").exists()
    code, err = run_cli(capsys, "sample", str(tmp_path / "run"), "--checkpoint", str(tmp_path / "run"),
                        "--plots", "0")
    assert code == 2 and message in _line(err, "sample")  # the same line: the file and the key it sits under
    holder = SimpleNamespace(normalizer=dataset.normalizer)
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        resume._restore_normalizer(found, holder, saved, rank=0)
    assert holder.normalizer is dataset.normalizer  # the training dataset keeps statistics that can be right
