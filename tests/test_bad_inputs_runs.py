"""A folder is a run only if flexpack wrote it: the run marker is a file flexpack can verify, a run of an
earlier version (no marker) is adopted only with the whole structure flexpack writes and says so, and a
file flexpack would write but did not is refused by name. Every refusal is one line and leaves the folder
byte for byte as it was."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from flexpack.errors import UserError
from flexpack.run.model import build_model
from flexpack.run.state import checkpoint, provenance, runfolder
from helpers import TINY, run_cli, set_args, tiny_config, tiny_sets


def _tree(folder: Path) -> dict[str, str | bytes]:
    """Every entry under ``folder``: a file's bytes, ``"dir"``, or where a symbolic link points."""
    out: dict[str, str | bytes] = {}
    for root, dirs, files in os.walk(folder):
        for name in dirs + files:
            p = Path(root) / name
            rel = str(p.relative_to(folder))
            out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else ("dir" if p.is_dir() else p.read_bytes())
    return out


def _train_refused(capsys, out: Path, *extra: str) -> str:
    """``flexpack train`` into ``out``: exit 2 and its one error line (refused before any data is read)."""
    code, err = run_cli(capsys, "train", str(TINY), *set_args(tiny_sets(out / "no-data", out)), *extra)
    assert code == 2 and "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.strip()]
    assert lines[-1].startswith("flexpack train: error: "), err
    return lines[-1]


def _earlier_run(folder: Path, metrics: str | None = None) -> Path:
    """A run folder as an earlier flexpack wrote it (no marker), made by flexpack's own functions."""
    cfg = tiny_config(folder / "no-data", folder)
    runfolder.record_start(folder, cfg.to_dict(), start_step=0, world_size=1)
    checkpoint.save(folder / "checkpoints", 2, build_model(cfg), None, config=cfg.to_dict())
    lines = [{"step": 1, "loss": 1.5, "lr": 1e-3}, {"step": 2, "loss": 1.2, "lr": 1e-3}]
    (folder / "metrics.jsonl").write_text(metrics if metrics is not None
                                          else "".join(json.dumps(r) + "\n" for r in lines))
    return folder


@pytest.mark.parametrize("kind,why", [
    ("empty", "is empty"), ("folder", "is a folder"), ("link", "is a symbolic link (to "),
    ("text", "is not JSON"), ("foreign", "holds no flexpack-run-v1 run id"), ("list", "holds no flexpack-run-v1"),
])
def test_a_marker_flexpack_did_not_write_is_refused_and_nothing_is_changed(capsys, tmp_path, kind, why):
    run = tmp_path / "mine"
    run.mkdir()
    (run / "metrics.jsonl").write_text("epoch 1: acc 0.91\n")
    marker = run / runfolder.MARKER
    if kind == "folder":
        marker.mkdir()
    elif kind == "link":  # a link to a genuine marker of another run still is not this folder's
        good = tmp_path / "other"
        good.mkdir()
        runfolder.mark(good)
        marker.symlink_to(good / runfolder.MARKER)
    else:
        marker.write_text({"empty": "", "text": "mine\n", "foreign": '{"format": "mine", "run_id": "x"}',
                           "list": "[1, 2]"}[kind])
    before = _tree(run)
    line = _train_refused(capsys, run)
    assert f"holds .flexpack-run, which {why}" in line and "not a run marker flexpack wrote" in line
    assert _tree(run) == before


def test_a_marker_flexpack_writes_holds_a_run_id_and_the_first_version_is_still_one(tmp_path):
    runfolder.mark(tmp_path)
    data = json.loads((tmp_path / runfolder.MARKER).read_text())
    assert data["format"] == "flexpack-run-v1" and len(data["run_id"]) == 32 and data["created"]
    assert provenance.marker_problem(tmp_path / runfolder.MARKER) is None
    (tmp_path / runfolder.MARKER).write_text(json.dumps({"flexpack_run": 1}) + "\n")
    assert provenance.marker_problem(tmp_path / runfolder.MARKER) is None
    runfolder.claim(tmp_path)


@pytest.mark.parametrize("beside", ["history", "checkpoint"])
def test_top_level_keys_do_not_make_a_run(capsys, tmp_path, beside):
    user = tmp_path / "user"
    user.mkdir()
    (user / "config.json").write_text(json.dumps({"data": 1, "model": "mine", "runtime": [2]}))
    (user / "metrics.jsonl").write_text('{"epoch": 1, "acc": 0.91}\n')
    if beside == "history":
        (user / "config_history.jsonl").write_text("my history\n")
    else:
        (user / "checkpoints" / "step_00000001").mkdir(parents=True)
        (user / "checkpoints" / "step_00000001" / "manifest.json").write_text("{}")
    before = _tree(user)
    line = _train_refused(capsys, user)
    assert "holds files flexpack did not write" in line and "(not a run of an earlier flexpack version: " in line
    assert _tree(user) == before and not (user / runfolder.MARKER).exists()  # metrics.jsonl not emptied


def test_an_earlier_versions_run_is_adopted_with_a_note_and_its_metrics_kept(capfd, tmp_path):
    run = _earlier_run(tmp_path / "run")
    metrics = (run / "metrics.jsonl").read_text()
    runfolder.claim(run)
    assert "is a run of an earlier flexpack version (no .flexpack-run" in capfd.readouterr().err
    assert provenance.marker_problem(run / runfolder.MARKER) is None
    assert (run / "metrics.jsonl").read_text() == metrics


@pytest.mark.parametrize("damage,why", [
    ("metrics", "metrics.jsonl: line 2 ('my own note') is not a line flexpack writes"),
    ("history", "config_history.jsonl line 1 is not a line flexpack writes"),
    ("config", "config.json is not a flexpack config"),
    ("checkpoint", "checkpoints/ holds no checkpoint with a valid manifest"),
    ("foreign_in_checkpoints", "checkpoints/mine.txt is not a checkpoint folder flexpack writes"),
])
def test_a_run_of_an_earlier_version_needs_all_of_flexpacks_structure(capsys, tmp_path, damage, why):
    run = _earlier_run(tmp_path / "run")
    if damage == "metrics":
        (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\nmy own note\n')
    elif damage == "history":
        (run / "config_history.jsonl").write_text('{"config": {}}\n{"start_step": 0}\n')
    elif damage == "config":
        cfg = json.loads((run / "config.json").read_text())
        cfg["model"]["preset"] = "mine"
        (run / "config.json").write_text(json.dumps(cfg))
    elif damage == "checkpoint":
        (run / "checkpoints" / "step_00000002" / "manifest.json").write_text("{}")
    else:
        (run / "checkpoints" / "mine.txt").write_text("keep")
    before = _tree(run)
    line = _train_refused(capsys, run)
    assert "holds files flexpack did not write" in line and why in line, line
    assert _tree(run) == before


def test_a_marked_runs_metrics_holding_a_foreign_line_is_refused_not_cut(capsys, tmp_path):
    run = _earlier_run(tmp_path / "run")
    runfolder.mark(run)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n{"step": 9, "loss": 0.5}\nresult: 0.5 (mine)\n')
    before = _tree(run)
    line = _train_refused(capsys, run)
    assert f"{run / 'metrics.jsonl'}: line 3 ('result: 0.5 (mine)') is not a line flexpack writes" in line
    with pytest.raises(UserError, match="line 3"):
        runfolder.cut_metrics(run, 1)
    assert _tree(run) == before


def test_a_folder_named_like_a_run_file_is_not_one(tmp_path):
    run = _earlier_run(tmp_path / "run")
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl").mkdir()
    assert provenance.earlier_run_problem(run) == f"{run / 'metrics.jsonl'} is a folder"
