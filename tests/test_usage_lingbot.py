"""docs/USAGE.md "Fine-tune LingBot-VA from LeRobot": every shell block and the Python snippet of the section run.

The blocks are read from docs/USAGE.md (the ``bash`` block after each marker, the section's ``python`` block), so the
docs cannot drift from what runs. The fast tests check them without running: every ``flexpack`` line parses with the
command line's own parser, the configs they name exist, the made episodes are long enough for the forecast the block
asks for, the snippet uses no undefined name and gives the policy every camera of ``obs_cam_keys``.

``<!-- lingbot-demo -->`` runs as written in a fresh folder (``flexpack`` is this checkout). ``<!-- lingbot-finetune
-->`` and the snippet run at tiny shapes with only these substitutions:

- the block's first line (``export DATA=... START=... WAN=... RUN=... POLICY=...``) is replaced by the same variables
  pointing into a temporary folder: ``DATA`` a repo id resolved in a temporary lerobot cache (``HF_LEROBOT_HOME``)
  holding a synthetic two-camera dataset, ``START`` a tiny ``lingbot_va`` policy saved with LeRobot's own API,
  ``WAN`` a tiny Wan2.2-style VAE, umT5 and tokenizer (``tests/lingbot_tiny.py``), ``RUN`` and ``POLICY`` new folders;
- ``cuda`` becomes ``cpu`` (the encode devices, the snippet's device);
- the ``train`` line gets ``--set`` values for a 3-step run in 120-token packs (no workers, no progress bar, a
  1-step warm-up, the held-out loss and a log line every step) and ``model.preset=lingbot-va-tiny``:
  ``flexpack sample`` builds the model its run's saved config describes, and that preset gives the tiny
  checkpoint's shape;
- ``python`` is this interpreter.

The snippet runs after the block in a fresh interpreter whose environment holds the block's variables.
"""

from __future__ import annotations

import ast
import builtins
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
USAGE = ROOT / "docs" / "USAGE.md"
HEADING = "## Fine-tune LingBot-VA from LeRobot"
CAMS = ["observation.images.cam0", "observation.images.cam1"]


def section() -> str:
    text = USAGE.read_text()
    body = text[text.index(HEADING) + len(HEADING):]
    return body[:body.index("\n## ")]


def shell_block(marker: str) -> str:
    part = section()
    return part[part.index(f"<!-- {marker} -->"):].split("```bash\n", 1)[1].split("```", 1)[0]


def python_snippet() -> str:
    (snippet,) = re.findall(r"```python\n(.*?)```", section(), flags=re.S)
    return snippet


def commands(block: str) -> list[str]:
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_section_is_these_blocks_and_nothing_else() -> None:
    """Every block of the section is one the tests run: two shell blocks behind their markers, one Python snippet."""
    part = section()
    assert part.count("```bash\n") == 2 and part.count("```python\n") == 1 and part.count("```") == 6
    assert "sample.every` refuses" not in part and "refuses this family" not in part
    demo, finetune = commands(shell_block("lingbot-demo")), commands(shell_block("lingbot-finetune"))
    for block, steps in ((demo, ("make-dataset", "encode", "train", "verify", "sample", "export")),
                         (finetune, ("encode", "check-dataset", "train", "sample", "export"))):
        assert [c for s in steps for c in block if c.startswith(f"flexpack {s} ")], steps
    assert finetune[0].startswith("export DATA=") and "configs/lingbot_va_finetune.toml" in " ".join(finetune)
    assert any("--val" in c.split() for c in finetune if c.startswith("flexpack sample"))


@pytest.mark.parametrize("marker", ["lingbot-demo", "lingbot-finetune"])
def test_every_flexpack_line_parses_and_names_files_that_exist(marker) -> None:
    from flexpack.cli import build_parser

    for line in commands(shell_block(marker)):
        if not line.startswith("flexpack "):
            continue
        argv = shlex.split(line.split("#")[0].replace("$", "X"))[1:]
        build_parser(argv).parse_args(argv)  # argparse exits on an unknown flag or a bad value
        for name in re.findall(r"configs/\S+\.toml", line):
            assert (ROOT / name).is_file(), name


def test_the_made_episodes_are_long_enough_for_the_forecast() -> None:
    """The demo's make-dataset draws episodes at least --min-frames long: each has room for one chunk of context
    (the cut points sit on chunk boundaries, 4 latent frames) plus the --horizon its sample lines ask for."""
    from flexpack.data.lengths import latent_frames
    from flexpack.families.lingbot.config import PRESETS

    block = commands(shell_block("lingbot-demo"))
    (make,) = [c for c in block if c.startswith("flexpack make-dataset")]
    shortest = int(re.search(r"--min-frames (\d+)", make)[1])
    chunk = PRESETS["lingbot-va-tiny"].frame_chunk_size
    for line in (c for c in block if c.startswith("flexpack sample")):
        horizon = int(re.search(r"--horizon (\d+)", line)[1])
        assert latent_frames(shortest, 4) >= chunk + horizon, line
    assert latent_frames(9, 4) < chunk + 4  # make-dataset's default shortest episode has no room


def test_the_snippet_defines_every_name_and_feeds_every_camera() -> None:
    tree = ast.parse(python_snippet())
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            bound |= {(a.asname or a.name).split(".")[0] for a in node.names}
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.comprehension):
            bound |= {n.id for n in ast.walk(node.target) if isinstance(n, ast.Name)}
    used = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    assert used <= bound, used - bound
    assert "for key in cfg.obs_cam_keys" in python_snippet()


def _script(block: str, *, lines: list[str] | None = None) -> str:
    head = ["set -euo pipefail", f'flexpack() {{ "{sys.executable}" -m flexpack.cli "$@"; }}',
            f'python() {{ "{sys.executable}" "$@"; }}']
    return "\n".join(head + (lines if lines is not None else commands(block)))


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(PYTHONPATH=f"{ROOT}{os.pathsep}{env.get('PYTHONPATH', '')}", HF_HUB_OFFLINE="1", **extra)
    return env


@pytest.mark.slow  # ~1 min: make, encode, 40 steps, verify, two samplings, an export
def test_the_demo_block_runs_as_written(tmp_path) -> None:
    pytest.importorskip("lerobot.policies.lingbot_va")
    clone = tmp_path / "clone"
    shutil.copytree(ROOT / "configs", clone / "configs")
    proc = subprocess.run(["bash", "-c", _script(shell_block("lingbot-demo"))], cwd=clone, env=_env(),
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-6000:]
    out = clone / "out"
    assert "OK: max rel err" in proc.stdout and re.search(r"^step 40/40 ", proc.stdout, flags=re.M)
    run = json.loads((out / "lingbot-run" / "samples" / "forecast_step_00000040" / "metrics.json").read_text())
    export = json.loads(next((out / "lingbot-policy" / "samples").glob("*/metrics.json")).read_text())
    assert run["pairs"] >= 3 and "note: episodes" not in proc.stderr  # every held-out episode had room for a cut
    assert export["action_mse"] == pytest.approx(run["action_mse"], rel=1e-6)
    assert export["latent_mse"] == pytest.approx(run["latent_mse"], rel=1e-6)
    assert "writing a policy LeRobot cannot run as it trained (--allow-unrunnable): its latents came from the " \
           "'pool' encoder" in proc.stderr
    assert json.loads((out / "lingbot-policy" / "config.json").read_text())["type"] == "lingbot_va"


def _twin(tmp_path: Path) -> dict[str, str]:
    """The tiny stand-ins of the fine-tune block's five variables (the module docstring)."""
    from flexpack.data.synthetic import make_synthetic_dataset
    from lingbot_tiny import save_frozen_modules, save_policy

    home = tmp_path / "lerobot-home"
    make_synthetic_dataset(home / "local" / "robot", lengths=[49, 57, 53, 61, 49, 57, 53, 61], cameras=2,
                           scene="orbit", seed=5)
    save_policy(tmp_path / "start", obs_cam_keys=CAMS)
    save_frozen_modules(tmp_path / "wan", text_dim=64)
    return {"DATA": "local/robot", "START": str(tmp_path / "start"), "WAN": str(tmp_path / "wan"),
            "RUN": str(tmp_path / "run"), "POLICY": str(tmp_path / "policy"), "HF_LEROBOT_HOME": str(home)}


@pytest.mark.slow  # ~1 min: encode with the VAE and umT5, 3 steps, a sampling, an export, LeRobot's select_action
def test_the_finetune_block_and_the_snippet_run_at_tiny_shapes(tmp_path) -> None:
    pytest.importorskip("lerobot.policies.lingbot_va")
    pytest.importorskip("diffusers")
    from safetensors.torch import load_file

    from flexpack.data import cache

    paths = _twin(tmp_path)
    lines = commands(shell_block("lingbot-finetune"))
    first = "export " + " ".join(f"{k}={shlex.quote(v)}" for k, v in paths.items() if k != "HF_LEROBOT_HOME")
    tiny = ("--set data.max_tokens=120 --set data.num_workers=0 --set log.progress=false --set checkpoint.every=0 "
            "--set schedule.steps=3 --set schedule.warmup_steps=1 --set validation.every=1 --set log.every=1 "
            "--set model.preset=lingbot-va-tiny")
    twin = [first] + [line.replace("cuda", "cpu") + (f" {tiny}" if line.startswith("flexpack train") else "")
                      for line in lines[1:]]
    proc = subprocess.run(["bash", "-c", _script("", lines=twin)], cwd=ROOT, env=_env(**paths), capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, "\n".join(twin) + "\n" + proc.stdout[-4000:] + proc.stderr[-6000:]

    data = Path(paths["HF_LEROBOT_HOME"]) / "local" / "robot"
    latent = cache.read_latent_header(data / "latents" / "video" / "cam0+cam1" / "episode_000000.safetensors")
    assert latent.encoder == f"wan-vae:{paths['WAN']}/vae" and latent.cameras == CAMS  # obs_cam_keys' order
    assert cache.read_text_header(data / "latents" / "text" / "task_000000.safetensors").encoder == \
        f"umt5:{paths['WAN']}:512"
    n = len(load_file(Path(paths["START"]) / "model.safetensors"))
    assert f"tensors matched the model by name and shape and were loaded, all {n} of the model's tensors" in proc.stdout
    recs = [json.loads(x) for x in (Path(paths["RUN"]) / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "val_loss" in r] == [1, 2, 3]
    assert [r["lr"] for r in recs if "loss" in r] == [0.0, 1e-5, 1e-5]  # LeRobot's warm-up from 0, then constant
    sampled = json.loads(next((Path(paths["RUN"]) / "samples").glob("*/metrics.json")).read_text())
    assert sampled["pairs"] >= 1 and sampled["mode"] == "forecast"
    exported = json.loads((Path(paths["POLICY"]) / "config.json").read_text())
    assert exported["obs_cam_keys"] == CAMS and exported["wan_pretrained_path"] == paths["WAN"]
    assert "--allow-unrunnable" not in proc.stderr  # the VAE and umT5 latents: an export LeRobot runs

    # the snippet, as written but for its device, in a fresh interpreter of the shell's environment; a wrapper reads
    # what it made: the action, and the weights LeRobot's policy holds against the export's model.safetensors
    (tmp_path / "snippet.py").write_text(python_snippet().replace('"cuda"', '"cpu"'))
    check = (
        "import json, runpy, sys, torch\n"
        "from safetensors.torch import load_file\n"
        "ns = runpy.run_path(sys.argv[1], run_name='__usage__')\n"
        "state, weights = ns['policy'].state_dict(), load_file(sys.argv[2])\n"
        "same = all(torch.equal(state[k].float(), v.to(state[k].dtype).float()) for k, v in weights.items())\n"
        "a = ns['action']\n"
        "print(json.dumps({'shape': list(a.shape), 'finite': bool(torch.isfinite(a).all()), 'same': same,\n"
        "                  'covered': set(weights) <= set(state), 'cams': list(ns['observation'])}))\n")
    proc = subprocess.run([sys.executable, "-c", check, str(tmp_path / "snippet.py"),
                           str(Path(paths["POLICY"]) / "model.safetensors")], cwd=tmp_path, env=_env(**paths),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"shape": [1, 6], "finite": True, "same": True, "covered": True, "cams": CAMS}
