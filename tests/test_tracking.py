"""Metrics a user can watch: TensorBoard and W&B log every numeric key of metrics.jsonl; train says where
its outputs are; flexpack plot draws metrics.jsonl."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from flexpack.cli import main as cli_main
from flexpack.run.config import load_config
from flexpack.training.observe import tracking
from flexpack.training.observe.plot import plot_metrics, read_metrics
from helpers import TINY, set_args, tiny_sets


def _scalars_from_tb(folder: Path) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(folder))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_scalars_are_every_numeric_key_but_step():
    rec = {"step": 3, "loss": 1.5, "lr": 1e-4, "step_s": 0.25, "peak_mem_gb": 12, "mfu": 0.41, "resumed": True,
           "bad": math.nan, "note": "text", "val": {"loss": 2.0}}
    assert tracking.scalars(rec) == {"loss": 1.5, "lr": 1e-4, "step_s": 0.25, "peak_mem_gb": 12.0, "mfu": 0.41,
                                     "val/loss": 2.0}


def test_tensorboard_logs_new_keys_and_drops_replayed_steps_on_resume(tmp_path):
    cfg = load_config(None, ["log.tensorboard=true"])
    with tracking.MetricSinks(tmp_path, cfg.log) as sinks:
        for step in (1, 2, 3):
            sinks.log({"step": step, "loss": 1.0 / step, "step_s": 0.5 * step})
    with tracking.MetricSinks(tmp_path, cfg.log, start_step=2) as sinks:  # resumed from the step-2 checkpoint
        sinks.log({"step": 3, "loss": 0.25, "step_s": 9.0, "mfu": 0.5})
    got = _scalars_from_tb(tmp_path / "tb")
    assert got["train/loss"] == [(1, 1.0), (2, 0.5), (3, 0.25)]
    assert got["train/step_s"] == [(1, 0.5), (2, 1.0), (3, 9.0)]
    assert got["train/mfu"] == [(3, 0.5)]


def test_tags_are_grouped_train_val_sample():
    assert [tracking.group(k) for k in ("loss", "lr", "val_loss", "val_action_loss", "val/loss", "sample_mse",
                                        "sample/action_mse", "waste/pad")] == [
        "train/loss", "train/lr", "val/loss", "val/action_loss", "val/loss", "sample/mse", "sample/action_mse",
        "train/waste/pad"]


def test_wandb_gets_the_same_scalars(tmp_path, monkeypatch):
    calls: dict = {"log": []}

    class FakeRun:
        def log(self, values, step):
            calls["log"].append((step, values))

        def finish(self, exit_code=0):
            calls["finish"] = exit_code

    def init(**kw):
        calls["init"] = kw
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", SimpleNamespace(init=init))
    cfg = load_config(None, ["log.wandb=true", "log.tensorboard=false", "log.wandb_project=demo",
                             'log.wandb_entity="lab"', 'log.wandb_tags=["aloha", "pack"]'])
    with tracking.MetricSinks(tmp_path / "myrun", cfg.log, config=cfg.to_dict()) as sinks:
        sinks.log({"step": 1, "loss": 2.0, "waste": 0.1, "val_loss": 3.0, "tag": "x"})
    assert calls["init"]["project"] == "demo" and calls["init"]["name"] == "myrun"
    assert calls["init"]["entity"] == "lab" and calls["init"]["tags"] == ["aloha", "pack"]
    assert calls["init"]["dir"] == str(tmp_path / "myrun") and calls["init"]["config"]["log"]["wandb"] is True
    assert calls["log"] == [(1, {"train/loss": 2.0, "train/waste": 0.1, "val/loss": 3.0})] and calls["finish"] == 0
    # the run id is stored in the run folder on the first start; a resume continues that W&B run
    first = calls["init"]["id"]
    assert (tmp_path / "myrun" / "wandb_run_id").read_text().strip() == first and calls["init"]["resume"] == "allow"
    with tracking.MetricSinks(tmp_path / "myrun", cfg.log, config=cfg.to_dict(), start_step=1) as sinks:
        sinks.log({"step": 2, "loss": 1.0})
    assert calls["init"]["id"] == first
    with tracking.MetricSinks(tmp_path / "fresh", cfg.log, config=cfg.to_dict()):
        pass
    assert calls["init"]["id"] != first  # another run folder, another W&B run
    with tracking.MetricSinks(tmp_path / "other", cfg.log, config=cfg.to_dict(), rank=1) as sinks:  # only rank 0 logs
        sinks.log({"step": 1, "loss": 2.0})
    assert len(calls["log"]) == 2  # the two of rank 0's runs above


def test_missing_wandb_is_one_line_before_any_work(monkeypatch):
    from flexpack.commands.train import train

    monkeypatch.setitem(sys.modules, "wandb", None)  # import fails as if not installed
    cfg = load_config(None, ["log.wandb=true", 'data.root="/nonexistent/data"'])
    with pytest.raises(ValueError,
                       match=r"^log.wandb = true needs the wandb package: pip install 'flexpack\[wandb\]'"):
        train(cfg)


@pytest.mark.usefixtures("one_thread")
def test_train_logs_to_tensorboard_prints_outputs_and_plots(tiny_dataset, tmp_path, capsys):
    out = tmp_path / "run"
    args = ["train", str(TINY), *set_args(tiny_sets(tiny_dataset, out, "schedule.steps=3"))]
    assert cli_main(args) == 0
    printed = capsys.readouterr().out
    for line in (f"run folder   {out}", f"metrics      {out / 'metrics.jsonl'}", f"tensorboard  {out / 'tb'}",
                 f"checkpoint   {out / 'checkpoints' / 'step_00000003'}", f"plot         flexpack plot {out}"):
        assert line in printed, printed
    records = read_metrics(out)
    tb = {k.removeprefix("train/"): v for k, v in _scalars_from_tb(out / "tb").items()}
    assert set(tb) == set(tracking.scalars(records[0]))  # every key, all under train/
    assert {"loss", "latent_loss", "action_loss", "lr", "grad_norm", "tokens_per_s", "waste"} <= set(tb)
    for key, points in tb.items():
        assert [s for s, _ in points] == [1, 2, 3]
        assert [v for _, v in points] == pytest.approx([r[key] for r in records], rel=1e-6)
    # the plot, also from a metrics file whose last line a kill tore
    assert cli_main(["plot", str(out)]) == 0
    png = out / "metrics.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    torn = tmp_path / "torn.jsonl"
    torn.write_text((out / "metrics.jsonl").read_text() + '{"step": 4, "lo')
    assert len(read_metrics(torn)) == 3
    assert plot_metrics(torn, tmp_path / "torn.png").stat().st_size > 10_000


def test_plot_errors_are_one_line(tmp_path, capsys):
    assert cli_main(["plot", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err.strip() == f"flexpack plot: error: {tmp_path / 'missing'} does not exist"
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError,
                       match=r"empty/metrics.jsonl does not exist \(is .*empty a run folder of `flexpack train`"):
        read_metrics(tmp_path / "empty")
    bad = tmp_path / "metrics.jsonl"
    bad.write_text('{"step": 1, "loss": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON record"):
        read_metrics(tmp_path)
    bad.write_text("")
    with pytest.raises(ValueError, match="holds no records yet"):
        read_metrics(bad)
    assert json.loads('{"step": 1}')  # a record needs only its step
    bad.write_text('{"step": 1}\n')
    assert plot_metrics(bad).name == "metrics.png"


def test_real_wandb_offline_resume_continues_the_stored_run(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, ["log.wandb=true", "log.tensorboard=false"])
    run = tmp_path / "run"
    with tracking.MetricSinks(run, cfg.log, config=cfg.to_dict()) as sinks:
        sinks.log({"step": 1, "loss": 2.0})
    with tracking.MetricSinks(run, cfg.log, config=cfg.to_dict(), start_step=1) as sinks:
        sinks.log({"step": 2, "loss": 1.0})
    run_id = (run / "wandb_run_id").read_text().strip()
    offline = sorted(p.name for p in (run / "wandb").glob("offline-run-*"))
    assert len(offline) == 2 and all(name.endswith(f"-{run_id}") for name in offline)


def test_plot_pairs_each_loss_with_its_validation_and_draws_held_out_samples_against_the_baselines(tmp_path):
    from flexpack.training.observe.plot import metrics_figure

    records = [{"step": s, "loss": 2.0 / s, "latent_loss": 1.5 / s, "action_loss": 0.5 / s, "smooth": 0.1, "lr": 1e-3,
                "grad_norm": 1.0, "tokens_per_s": 100.0} for s in range(1, 11)]
    for r in records[4::5]:
        r.update({"val_loss": r["loss"] * 1.1, "val_latent_loss": r["latent_loss"] * 1.1,
                  "val_action_loss": r["action_loss"] * 1.1, "val_smooth": 0.2})
        for w, v in (("action", 0.1), ("latent", 0.02)):
            r.update({f"sample/{w}_mse": v, f"sample/{w}_mse_kmean": v / 2, f"sample/last/{w}_mse": 1.0,
                      f"sample/mean/{w}_mse": 0.5})
    fig = metrics_figure(records, "run")
    by_label = {ln.get_label(): ln for ax in fig.axes for ln in ax.get_lines()}
    for train_key, val_key in (("loss", "val_loss"), ("latent_loss", "val_latent_loss"),
                               ("action_loss", "val_action_loss"), ("smooth", "val_smooth")):  # a part by its name
        train, val = by_label[f"{train_key} (train)"], by_label[f"{train_key} (validation)"]
        assert train.get_color() == val.get_color() and val.get_linestyle() == "--"
        assert list(val.get_xdata()) == [5, 10]
    assert len({by_label[f"{k} (train)"].get_color() for k in ("loss", "latent_loss", "action_loss", "smooth")}) == 4
    panels = {ax.get_ylabel(): ax for ax in fig.axes}
    for w in ("action", "latent"):
        lines = {ln.get_label(): ln for ln in panels[f"held-out {w} MSE"].get_lines()}
        assert set(lines) == {"model (1 sample)", "model (mean of samples)", "baseline: last", "baseline: mean"}
        assert list(lines["baseline: last"].get_ydata()) == [1.0, 1.0]
        assert lines["baseline: last"].get_linewidth() < lines["model (1 sample)"].get_linewidth()
    # a run without sampling: no such panels; with one sample per pair its mean is not drawn twice
    plain = metrics_figure([{k: v for k, v in r.items() if not k.startswith("sample/")} for r in records])
    assert not any(ax.get_ylabel().startswith("held-out") for ax in plain.axes)
    for r in records[4::5]:
        r["sample/action_mse_kmean"] = r["sample/action_mse"]
    single = {ax.get_ylabel(): ax for ax in metrics_figure(records).axes}["held-out action MSE"]
    assert "model (mean of samples)" not in [ln.get_label() for ln in single.get_lines()]
