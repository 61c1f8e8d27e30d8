"""``make demo``'s closing summary lists the outputs that exist, and only those."""

from __future__ import annotations

import json

from flexpack.tools import demo


def test_summary_lists_existing_outputs_only(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    (out / "demo-data" / "latents").mkdir(parents=True)
    text = demo.summary(out)
    assert "dataset" in text and "latent cache  out/demo-data/latents" in text
    assert "run folder" not in text and "action stats" not in text and "sampler stats" not in text

    (out / "demo-data" / "latents" / "stats.json").write_text("{}")
    run = out / "demo-run"
    (run / "tb").mkdir(parents=True)
    (run / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 3.5}) + "\n"
                                       + json.dumps({"step": 40, "loss": 1.25})
                                       + '\n{"step": 41, "lo')  # a torn last line is skipped
    (run / "metrics.png").write_bytes(b"png")
    (out / "stats_pack.png").write_bytes(b"png")
    samples = run / "samples" / "step_00000040"
    samples.mkdir(parents=True)
    (samples / "metrics.json").write_text("{}")  # unreadable as a forecast: no table
    (samples / "actions_ep0.png").write_bytes(b"png")
    rows = dict(demo.outputs(out, run, out / "demo-data"))
    assert "sample video" not in rows  # none written
    for ep in (3, 0, 7):
        (samples / f"episode_00000{ep}.mp4").write_bytes(b"mp4")
    rows = dict(demo.outputs(out, run, out / "demo-data"))
    assert rows["sample video"] == "out/demo-run/samples/step_00000040/episode_000000.mp4  (and 2 more beside it)"
    assert rows["run folder"] == "out/demo-run" and rows["plot"] == "out/demo-run/metrics.png"
    assert rows["metrics"] == "out/demo-run/metrics.jsonl  (loss 3.5 (step 1) -> 1.25 (step 40))"
    assert rows["tensorboard"].startswith("out/demo-run/tb  (tensorboard --logdir out/demo-run/tb)")
    assert rows["sample metrics"] == "out/demo-run/samples/step_00000040/metrics.json"
    assert rows["sample plot"] == "out/demo-run/samples/step_00000040/actions_ep0.png"
    assert rows["sampler stats"] == "out/stats_pack.png" and "checkpoint" not in rows  # none written
    text = demo.summary(out, bin_dir=".venv/bin")
    assert text.splitlines()[1] == "== flexpack demo: done ==" and "source .venv/bin/activate" in text
    assert ".venv/bin/flexpack export out/demo-run" in text


def test_summary_prints_the_forecast_against_both_baselines(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "out"
    samples = out / "demo-run" / "samples"
    samples.mkdir(parents=True)
    base = {"last": {"action_mse": 1.25, "latent_mse": 0.072}, "mean": {"action_mse": 0.5, "latent_mse": 0.03}}
    (samples / "metrics.json").write_text(json.dumps({
        "action_mse": 0.04, "action_mse_kmean": 0.02, "latent_mse": 0.024, "latent_mse_kmean": 0.018,
        "baselines": base, "samples": 4, "horizon": 4, "pair_list": [[0, 2, 4], [1, 2, 4], [1, 5, 4]]}))
    text = demo.summary(out)
    lines = text.splitlines()
    head = lines.index("Held-out forecast, 4 latent frames ahead (3 cut points x 4 sample(s), "
                       "out/demo-run/samples/metrics.json):")
    assert lines[head + 1].split() == ["model", "mean", "of", "4", "last", "mean", "model/best"]
    assert lines[head + 2].split() == ["action", "MSE", "0.04", "0.02", "1.25", "0.5", "0.08x"]  # 0.04 / 0.5
    assert lines[head + 3].split() == ["latent", "MSE", "0.024", "0.018", "0.072", "0.03", "0.8x"]
    assert "last: the last context action / latent frame repeated" in lines[head + 4]
