"""``flexpack stats``: frames-file parsing, JSON and table output, plot, error exits."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from flexpack.cli import main
from flexpack.packing.lengths import latent_frames, read_frames_file

ROOT = Path(__file__).resolve().parents[1]
REF = ROOT / "data" / "episode_frames_ref.txt"
PACK = ["--mode", "pack", "--max-tokens", "65536", "--tokens-per-frame", "36", "--world-size", "8"]
PAD = ["--mode", "pad", "--batch-size", "4", "--pool-factor", "50", "--pad-multiple", "8", "--world-size", "8"]
KEYS = {"waste", "distinct_shapes", "micro_batches", "batches_per_rank", "samples", "rank_imbalance",
        "mode", "parameters"}


def stats_json(capsys, *argv: str) -> dict:
    assert main(["stats", *argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # exactly one JSON object
    return json.loads(out)


@pytest.mark.parametrize("n, f", [(1, 1), (4, 1), (5, 2), (8, 2), (9, 3), (660, 165), (1449, 363)])
def test_latent_frames(n, f):
    assert latent_frames(n) == f


def test_latent_frames_rejects_bad_counts():
    with pytest.raises(ValueError, match="n=0"):
        latent_frames(0)
    assert latent_frames(10, stride=1) == 10


def test_read_frames_file(tmp_path):
    p = tmp_path / "f.txt"
    p.write_text("# header\n\n5\n  9  # inline comment\n1\n")
    assert read_frames_file(p) == [2, 3, 1]


@pytest.mark.parametrize(
    "text, match",
    [
        ("5\n9\nabc\n", r"f\.txt:3: .*'abc'"),
        ("# c\n5\n0\n", r"f\.txt:3: video frame count must be >= 1, got 0"),
        ("5\n2.5\n", r"f\.txt:2: "),
        ("# only comments\n\n", r"f\.txt: no episode lengths"),
    ],
)
def test_read_frames_file_errors(tmp_path, text, match):
    p = tmp_path / "f.txt"
    p.write_text(text)
    with pytest.raises(ValueError, match=match):
        read_frames_file(p)


def test_json_pack_reference(capsys):
    d = stats_json(capsys, "--frames-file", str(REF), *PACK)
    assert KEYS <= d.keys()
    assert d["mode"] == "pack" and d["parameters"]["max_tokens"] == 65536 and d["episodes"] == 1280
    assert d["waste"] <= 0.010 and d["distinct_shapes"] == 1 and d["rank_imbalance"] <= 1.02
    assert d["micro_batches"] == 8 * d["batches_per_rank"]
    assert d["samples"] == 1280 + d["repeated_samples"]


def test_json_pad_reference(capsys):
    d = stats_json(capsys, "--frames-file", str(REF), *PAD)
    assert KEYS <= d.keys() and d["mode"] == "pad"
    assert d["waste"] <= 0.03 and d["distinct_shapes"] == 34
    assert d["micro_batches"] == 320 and d["batches_per_rank"] == 40 and d["samples"] == 1280
    assert sum(d["padded_frames_histogram"].values()) == 320


def test_json_small_exact(tmp_path, capsys):
    # latent frames 2, 3, 1, 2; one sorted pool: ep 2 (F=1), eps 0 and 3 (F=2), ep 1 (F=3) ->
    # batches {2, 0|3} padded to 2 frames and {3|0, 1} padded to 3: 8 used of 10 computed
    p = tmp_path / "f.txt"
    p.write_text("5\n9\n1\n8\n")
    d = stats_json(capsys, "--frames-file", str(p), "--mode", "pad", "--batch-size", "2",
                   "--pad-multiple", "1", "--tokens-per-frame", "1")
    assert d["waste"] == pytest.approx(0.2) and d["distinct_shapes"] == 2
    assert d["micro_batches"] == 2 and d["tokens_used"] == 8 and d["tokens_computed"] == 10


def test_table_output(capsys):
    assert main(["stats", "--frames-file", str(REF), *PACK, "--epoch", "1", "--seed", "3"]) == 0
    out = capsys.readouterr().out
    assert "waste" in out and "rank imbalance" in out and "seed=3" in out and "epoch=1" in out


def test_plot_writes_png(tmp_path, capsys):
    png = tmp_path / "stats.png"
    assert main(["stats", "--frames-file", str(REF), *PAD, "--plot", str(png)]) == 0
    data = png.read_bytes()
    assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000
    assert os.listdir(tmp_path) == ["stats.png"]  # the temporary file was renamed, not left behind
    umask = os.umask(0)
    os.umask(umask)
    assert png.stat().st_mode & 0o777 == 0o666 & ~umask  # an ordinary file, not mkstemp's private 0600


def test_plot_into_missing_folder_fails_cleanly(tmp_path, capsys):
    assert main(["stats", "--frames-file", str(REF), *PAD, "--plot", str(tmp_path / "no" / "x.png")]) == 2
    assert "cannot write plot" in capsys.readouterr().err


def test_bad_frames_file_exit_code(tmp_path, capsys):
    p = tmp_path / "bad_frames.txt"
    p.write_text("# ok\n12\n\nseven\n")
    assert main(["stats", "--frames-file", str(p), "--mode", "pad"]) == 2
    err = capsys.readouterr().err
    assert "bad_frames.txt:4" in err and "seven" in err and "Traceback" not in err


def test_missing_frames_file_exit_code(tmp_path, capsys):
    assert main(["stats", "--frames-file", str(tmp_path / "nope.txt"), "--mode", "pack"]) == 2
    assert "nope.txt" in capsys.readouterr().err


def test_episode_over_budget_and_crop(tmp_path, capsys):
    p = tmp_path / "f.txt"
    p.write_text("41\n400\n")  # latent 11 and 100 frames
    argv = ["stats", "--frames-file", str(p), "--mode", "pack", "--max-tokens", "50", "--tokens-per-frame", "1"]
    assert main(argv) == 2
    assert "episode 1 has 100 latent frames" in capsys.readouterr().err
    d = stats_json(capsys, *argv[1:], "--crop")
    assert d["micro_batches"] == 2 and d["distinct_shapes"] == 1


def test_dataset_source_errors(tmp_path, capsys):
    assert main(["stats", "--dataset", str(tmp_path), "--mode", "pad"]) == 2
    assert str(tmp_path) in capsys.readouterr().err


def test_dataset_source_reads_lengths_lazily(monkeypatch, capsys):
    import flexpack.data.lengths as lengths_mod

    calls = []

    def fake(root, stride=4):
        calls.append((root, stride))
        return [3, 5, 9, 2, 11] if root == "ds" else []

    monkeypatch.setattr(lengths_mod, "dataset_latent_frames", fake)
    d = stats_json(capsys, "--dataset", "ds", "--stride", "2", "--mode", "pad", "--batch-size", "5",
                   "--pad-multiple", "1", "--tokens-per-frame", "1")
    assert calls == [("ds", 2)] and d["episodes"] == 5 and d["source"] == "ds"
    assert d["tokens_used"] == 30 and d["tokens_computed"] == 55 and d["micro_batches"] == 1
    assert main(["stats", "--dataset", "empty", "--mode", "pad"]) == 2
    assert "lists no episodes" in capsys.readouterr().err


def test_exactly_one_source():
    with pytest.raises(SystemExit) as e:
        main(["stats", "--frames-file", str(REF), "--dataset", "x", "--mode", "pad"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        main(["stats", "--mode", "pad"])


def test_command_line_process(tmp_path):
    """The real entry point: exit code 2 and a one-line message, no traceback."""
    p = tmp_path / "frames.txt"
    p.write_text("9\n-3\n")
    r = subprocess.run([sys.executable, "-m", "flexpack.cli", "stats", "--frames-file", str(p), "--mode", "pad"],
                       cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "frames.txt:2" in r.stderr and "Traceback" not in r.stderr


def test_dataset_geometry_comes_from_its_latent_cache(tiny_dataset, capsys):
    pytest.importorskip("lerobot")
    # the tiny cache: 2x2 latents, patch 2 -> 1 video token + 4 action steps = 5 tokens per frame (as train)
    d = stats_json(capsys, "--dataset", str(tiny_dataset), "--mode", "pack", "--max-tokens", "100")
    assert d["parameters"]["tokens_per_frame"] == 5 and d["samples"] == 6
    assert main(["stats", "--dataset", str(tiny_dataset), "--mode", "pack", "--max-tokens", "30"]) == 2
    err = capsys.readouterr().err
    assert "= 50 tokens > --max-tokens 30" in err and "pass --crop" in err and "crop=True" not in err
