"""`flexpack export --format lerobot --dataset NAME` of a run on a mixture (`[[data.datasets]]`): each entry's own
q01 / q99 (its norm_stat, pooled within itself, or pooled over the entries of one embodiment), action channels and
cameras, as the checkpoint recorded them per entry (`extra.entry_normalizers`) and LeRobot loads them; without
--dataset where the entries differ, or with an unknown name: one line naming the choices; a checkpoint written
before the per-entry record still exports each entry's statistics; a resume keeps the checkpoint's."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

pytest.importorskip("lerobot.policies.lingbot_va", reason="the installed lerobot has no lingbot_va policy")

from lerobot.policies.factory import make_pre_post_processors  # noqa: E402
from lerobot.policies.lingbot_va.configuration_lingbot_va import LingBotVAConfig  # noqa: E402
from lerobot.policies.lingbot_va.modeling_lingbot_va import LingBotVAPolicy  # noqa: E402

from flexpack.data.bundle_synthetic import SyntheticDataset, write_bundle  # noqa: E402
from flexpack.run.state import resume  # noqa: E402
from helpers import BUNDLE_CAMS, LINGBOT_TINY, run_cli, tiny_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
MAIN, LEFT, RIGHT = BUNDLE_CAMS
ARM3 = [0, 1, 29]  # entry "arm3": its 3 action columns' places in the 30-d space
# entry "a"'s norm_stat (upstream's file: q01 / q99 over the 30-d space)
NORM_A = {"q01": [-1.0 - 0.1 * c for c in range(30)], "q99": [1.0 + 0.05 * c for c in range(30)]}
# (dataset folder, episode, segment [start, end)) of entry "arm3"'s bundle
ARM3_SEGMENTS = [("e", 0, 0, 25), ("e", 0, 10, 33), ("e", 1, 2, 30)]


def _bundles(base: Path) -> tuple[Path, Path]:
    """Entry "a": a T of three cameras, 6 action columns; entry "arm3": two cameras side by side, 3 columns."""
    a = write_bundle(base / "a", [SyntheticDataset(name="d", episodes=[[(0, 30)], [(0, 21)]], cameras=BUNDLE_CAMS,
                                                   action_columns=6)], text=(16, 64))
    b = write_bundle(base / "b", [SyntheticDataset(name="e", episodes=[[(0, 25), (10, 33)], [(2, 30)]],
                                                   cameras={MAIN: (4, 4), LEFT: (4, 4)}, action_columns=3)],
                     text=(16, 64), seed=5)
    return a, b


def _mixture(a: Path, b: Path, norm: Path) -> str:
    return (f"data.datasets=[{{root = '{a}', weight = 1.0, norm_stat = '{norm}'}}, {{root = '{b}', name = 'arm3', "
            f"weight = 2.0, action_channels = {ARM3}, cameras = ['{MAIN}', '{LEFT}']}}]")


@pytest.fixture(scope="module")
def mixture_run(tmp_path_factory):
    """A 2-step lingbot-va-tiny run on the two-entry mixture: (config, run folder, entry a's root, arm3's root)."""
    from flexpack.commands.train import train

    base = tmp_path_factory.mktemp("mixture")
    a, b = _bundles(base)
    norm = base / "norm_a.json"
    norm.write_text(json.dumps(NORM_A))
    cfg = tiny_config("", base / "run", *LINGBOT_TINY, "data.root=", _mixture(a, b, norm), "data.max_tokens=800",
                      "schedule.steps=2", "schedule.rewarmup_steps=0")
    train(cfg)
    return cfg, Path(cfg.runtime.out_dir), a, b


def _pooled(root: Path, segments) -> tuple[np.ndarray, np.ndarray]:
    """q01 / q99 of the segments' parquet rows (stride 1, frame_ids from each segment's start), read here."""
    rows = []
    for name, ep, s, e in segments:
        table = pq.read_table(root / name / "data" / "chunk-000" / f"episode_{ep:06d}.parquet")
        rows.append(np.array(table.column("action").to_pylist())[s:e])
    pooled = np.concatenate(rows)
    return np.quantile(pooled, 0.01, axis=0), np.quantile(pooled, 0.99, axis=0)


def _processor_stats(folder: Path) -> dict[str, list[float]]:
    _, post = make_pre_post_processors(LingBotVAConfig.from_pretrained(folder), pretrained_path=str(folder))
    (step,) = [s for s in post.steps if type(s).__name__ == "UnnormalizerProcessorStep"]
    return {k: torch.as_tensor(step.stats["action"][k], dtype=torch.float64).tolist() for k in ("q01", "q99")}


def _train_state(run: Path) -> dict:
    return json.loads(next((run / "checkpoints").glob("step_*/train_state.json")).read_text())


def test_the_checkpoint_records_each_entrys_statistics(mixture_run) -> None:
    _, run, _, b = mixture_run
    extra = _train_state(run)["extra"]
    assert extra["action_normalizer"] is None  # the entries' statistics differ: no one shared record
    rec_a, rec_b = extra["entry_normalizers"]
    assert (rec_a["name"], rec_a["mode"], rec_b["name"], rec_b["mode"]) == ("a", "quantile", "arm3", "quantile")
    assert rec_a["low"] == pytest.approx(NORM_A["q01"]) and rec_a["high"] == pytest.approx(NORM_A["q99"])
    q01, q99 = _pooled(b, ARM3_SEGMENTS)
    assert [rec_b["low"][c] for c in ARM3] == pytest.approx(q01.tolist(), rel=1e-9)
    assert [rec_b["high"][c] for c in ARM3] == pytest.approx(q99.tolist(), rel=1e-9)


def test_each_entry_exports_its_own_statistics_channels_and_cameras(mixture_run, tmp_path, capsys) -> None:
    """--dataset a: three cameras as a T, channels 0..5, q01 / q99 its norm_stat's; --dataset arm3: two cameras side
    by side, channels [0, 1, 29], q01 / q99 pooled over its own rows; LeRobot loads both strictly."""
    _, run, _, b = mixture_run
    q01_b, q99_b = _pooled(b, ARM3_SEGMENTS)
    want = {
        "a": ([MAIN, LEFT, RIGHT], "robotwin_tshape", list(range(6)), [NORM_A["q01"][c] for c in range(6)],
              [NORM_A["q99"][c] for c in range(6)]),
        "arm3": ([MAIN, LEFT], "width_concat", ARM3, q01_b.tolist(), q99_b.tolist()),
    }
    for name, (cams, layout, used, q01, q99) in want.items():
        out = tmp_path / name
        code, err = run_cli(capsys, "export", str(run), str(out), "--dataset", name)
        assert code == 0, err
        raw = json.loads((out / "config.json").read_text())
        assert (raw["obs_cam_keys"], raw["camera_layout"], raw["used_action_channel_ids"]) == (cams, layout, used)
        assert raw["output_features"] == {"action": {"type": "ACTION", "shape": [len(used)]}}
        assert list(raw["input_features"]) == cams
        stats = _processor_stats(out)
        assert stats["q01"] == pytest.approx(q01, rel=1e-6) and stats["q99"] == pytest.approx(q99, rel=1e-6)
        norm = json.loads((out / "normalization.json").read_text())
        assert (norm["entry"], norm["channels"], norm["columns"]) == (name, used, len(used))
        assert norm["column_low"] == pytest.approx(q01, rel=1e-9)
        config = LingBotVAConfig.from_pretrained(out)
        config.dtype = "float32"
        LingBotVAPolicy.from_pretrained(out, config=config, strict=True)
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "one"), "--dataset", "arm3/e")  # ENTRY/DATASET
    assert code == 0, err
    assert json.loads((tmp_path / "one" / "config.json").read_text())["used_action_channel_ids"] == ARM3


def test_the_upstream_export_of_an_entry_writes_its_channels_and_statistics(mixture_run, tmp_path, capsys) -> None:
    _, run, _, b = mixture_run
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "up"), "--format", "lingbot-upstream",
                        "--dataset", "arm3")
    assert code == 0, err
    fields = json.loads((tmp_path / "up" / "flexpack_export.json").read_text())
    up = fields["upstream_config"]
    q01, _ = _pooled(b, ARM3_SEGMENTS)
    assert up["obs_cam_keys"] == [MAIN, LEFT] and up["used_action_channel_ids"] == ARM3
    assert [up["norm_stat"]["q01"][c] for c in ARM3] == pytest.approx(q01.tolist(), rel=1e-9)
    assert fields["source_columns"]["q01"] == pytest.approx(q01.tolist(), rel=1e-9)
    assert fields["data_root"] == str(b)


def test_without_dataset_or_with_an_unknown_name_one_line_names_the_choices(mixture_run, tmp_path, capsys) -> None:
    _, run, _, _ = mixture_run
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "o"))
    assert code == 2 and err.count("\n") == 1 and "export: checkpoint" not in err, err  # before any weight is read
    assert ("the run's data.datasets entries differ in their action channels (a: [0, 1, 2, 3, 4, 5]; arm3: "
            "[0, 1, 29]); pick the one the export describes with --dataset NAME (one of ['a', 'arm3'])") in err
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "o"), "--dataset", "arm4")
    assert code == 2 and err.count("\n") == 1, err
    assert ("--dataset 'arm4': not a dataset of the run's mixture (its data.datasets entries ['a', 'arm3'], or "
            "ENTRY/DATASET: ['a/d', 'arm3/e'])") in err
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "o"), "--dataset", "arm3/f")
    assert code == 2 and err.count("\n") == 1 and "--dataset 'arm3/f': not a dataset of the bundle" in err, err
    assert not (tmp_path / "o").exists()


def test_a_checkpoint_without_per_entry_records_exports_each_entrys_statistics(mixture_run, tmp_path,
                                                                               capsys) -> None:
    """A checkpoint written before entries' statistics were recorded (its extra holds action_normalizer: null):
    the export computes the entry's from its data, as training did, and says so."""
    from flexpack.run.model import build_model
    from flexpack.run.state import checkpoint

    cfg, run, _, b = mixture_run
    old = tmp_path / "old"
    checkpoint.save(old / "checkpoints", 2, build_model(cfg), None, config=cfg.to_dict(),
                    extra={"action_normalizer": None})
    code, err = run_cli(capsys, "export", str(old), str(tmp_path / "o"), "--dataset", "arm3")
    assert code == 0, err
    assert "records no per-entry statistics (an older checkpoint); computing 'arm3''s from its data" in err
    q01, _ = _pooled(b, ARM3_SEGMENTS)
    assert _processor_stats(tmp_path / "o")["q01"] == pytest.approx(q01.tolist(), rel=1e-6)


def test_entries_of_one_embodiment_export_their_shared_statistics(tmp_path, capsys) -> None:
    """Two entries naming one embodiment (same channels and cameras) share q01 / q99 pooled over both: either
    name, and no --dataset at all, writes those; they are the statistics the checkpoint recorded."""
    from flexpack.commands.train import train

    a = write_bundle(tmp_path / "a", [SyntheticDataset(name="d", episodes=[[(0, 30)], [(0, 21)]],
                                                       cameras=BUNDLE_CAMS, action_columns=6)], text=(16, 64))
    c = write_bundle(tmp_path / "c", [SyntheticDataset(name="f", episodes=[[(0, 25), (4, 37)]],
                                                       cameras=BUNDLE_CAMS, action_columns=6)], text=(16, 64), seed=3)
    cfg = tiny_config("", tmp_path / "run", *LINGBOT_TINY, "data.root=", "data.max_tokens=800", "schedule.steps=1",
                      "schedule.rewarmup_steps=0",
                      f"data.datasets=[{{root = '{a}', embodiment = 'aloha'}}, {{root = '{c}', embodiment = 'aloha'}}]")
    train(cfg)
    rows = []
    for root, name, ep, s, e in [(a, "d", 0, 0, 30), (a, "d", 1, 0, 21), (c, "f", 0, 0, 25), (c, "f", 0, 4, 37)]:
        table = pq.read_table(root / name / "data" / "chunk-000" / f"episode_{ep:06d}.parquet")
        rows.append(np.array(table.column("action").to_pylist())[s:e])
    q01, q99 = np.quantile(np.concatenate(rows), 0.01, axis=0), np.quantile(np.concatenate(rows), 0.99, axis=0)
    extra = _train_state(tmp_path / "run")["extra"]
    assert extra["action_normalizer"]["low"][:6] == pytest.approx(q01.tolist(), rel=1e-9)
    for args in ([], ["--dataset", "a"], ["--dataset", "c"]):
        out = tmp_path / f"o{len(args)}{args[-1] if args else ''}"
        code, err = run_cli(capsys, "export", str(tmp_path / "run"), str(out), *args)
        assert code == 0, err
        stats = _processor_stats(out)
        assert stats["q01"] == pytest.approx(q01.tolist(), rel=1e-6)
        assert stats["q99"] == pytest.approx(q99.tolist(), rel=1e-6)


def test_a_resume_keeps_the_checkpoints_statistics_of_each_entry(mixture_run, tmp_path, capsys) -> None:
    """Entry statistics that moved since the checkpoint (another norm_stat file today) are replaced by the
    checkpoint's on a resume, with a warning; the other entry keeps its own."""
    from flexpack.run.build import open_dataset

    _, run, a, b = mixture_run
    norm = tmp_path / "moved.json"
    norm.write_text(json.dumps({"q01": [-3.0] * 30, "q99": [3.0] * 30}))
    ds = open_dataset(tiny_config("", tmp_path / "again", *LINGBOT_TINY, "data.root=", _mixture(a, b, norm),
                                  "data.max_tokens=800"))
    assert ds.entry_normalizers[0].low.tolist() == [-3.0] * 30
    before_b = ds.entry_normalizers[1].low.copy()
    found = next((run / "checkpoints").glob("step_*"))
    resume._restore_entry_normalizers(found, ds, _train_state(run), rank=0)
    assert "keeping the checkpoint's" in capsys.readouterr().err
    np.testing.assert_allclose(ds.entry_normalizers[0].low, NORM_A["q01"])
    np.testing.assert_array_equal(ds.entry_normalizers[1].low, before_b)
