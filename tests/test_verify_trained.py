"""``verify --checkpoint RUN`` checks what the run trained: it reads the checkpoint's own config (as ``export``
does) and says so, and a config or ``--set`` that disagrees with it on the model, mask, objective or token
geometry is one line; ``sample`` refuses such a config alike. ``run_config`` is the one place that finds it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flexpack.families.wan.model import WanVA
from flexpack.run.config import load_config, save_config
from flexpack.run.resolve import model_config_of
from flexpack.run.state import checkpoint
from flexpack.run.state.trained import differences, run_config

ROOT = Path(__file__).resolve().parents[1]
TINY = str(ROOT / "configs" / "tiny_cpu.toml")
CHUNKED = ("model.mask='chunk_causal'", "model.chunk_size=2")


def trained_run(tmp_path: Path, *sets: str, own: bool = True) -> tuple[Path, Path]:
    """A run folder whose one checkpoint trained ``tiny_cpu.toml`` with ``sets``: (run, checkpoint). ``own``: the
    checkpoint carries its config.json (as training writes it); else only the run's first config.json."""
    cfg = load_config(TINY, [f"--set {s}".split(" ", 1)[1] for s in sets])
    run = tmp_path / "run"
    model = WanVA(model_config_of(cfg))
    found = checkpoint.save(run / "checkpoints", 3, model, None, config=cfg.to_dict() if own else None)
    save_config(load_config(TINY), run / "config.json")  # the first start's config: another mask
    return run, found


def _verify(capsys, *args: str) -> tuple[int, str, str]:
    from flexpack.cli import main

    rc = main(["verify", *args, "--synthetic", "--micro-batches", "1"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_run_config_prefers_the_checkpoints_own(tmp_path):
    run, found = trained_run(tmp_path, *CHUNKED)
    assert run_config(run) == found / "config.json" == run_config(found) == run_config(run, found)
    assert load_config(run_config(run)).model.mask == "chunk_causal"
    bare, found_bare = trained_run(tmp_path / "b", *CHUNKED, own=False)
    assert run_config(bare) == bare / "config.json" == run_config(found_bare)  # the run's: the checkpoint has none
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text("{}")  # diffusers' config
    (export / "flexpack_config.json").write_text("{}")
    assert run_config(export) == export / "flexpack_config.json"
    with pytest.raises(FileNotFoundError, match="no config.json"):
        run_config(tmp_path / "nothing")


def test_verify_checkpoint_uses_the_runs_config_and_says_so(capsys, tmp_path, one_thread):
    run, found = trained_run(tmp_path, *CHUNKED)
    rc, out, err = _verify(capsys, "--checkpoint", str(run))
    assert rc == 0 and "OK: max rel err" in out, err
    assert (f"verify: config of {found / 'config.json'} (the run): model.family 'wanva', "
            "model.mask 'chunk_causal', chunk 2") in err
    # the run's own config passed as CONFIG agrees; keys that say where and how to run may differ
    rc, out, err = _verify(capsys, str(found / "config.json"), "--checkpoint", str(run),
                           "--set", "runtime.dtype='bfloat16'", "--set", "data.max_tokens=48")
    assert rc == 0 and f"agreeing with {found / 'config.json'}" in err


def test_a_config_that_disagrees_with_the_run_is_one_line(capsys, tmp_path, one_thread):
    run, found = trained_run(tmp_path, *CHUNKED)
    rc, out, err = _verify(capsys, TINY, "--checkpoint", str(run))  # tiny_cpu.toml: a document mask
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert err.startswith(f"flexpack verify: error: {TINY} disagrees with what {found / 'config.json'} was trained")
    assert "model.mask = 'document', trained 'chunk_causal'" in err and "model.chunk_size = None, trained 2" in err
    rc, out, err = _verify(capsys, "--checkpoint", str(run), "--set", "data.action_steps=2")
    assert rc == 2 and "the run's config with --set data.action_steps=2 disagrees" in err
    assert "data.action_steps = 2, trained 4" in err
    from flexpack.cli import main

    assert main(["verify"]) == 2 and "or --checkpoint RUN" in capsys.readouterr().err


def test_differences_cover_model_objective_and_geometry_not_where_or_how():
    base = load_config(TINY)
    same = load_config(TINY, ["data.root='/elsewhere'", "runtime.dtype='bfloat16'", "data.max_tokens=48",
                              "model.overrides.attn_backend='flex'", "data.num_workers=2"])
    assert differences(same, base) == {}
    other = load_config(TINY, ["objective.shift=2.5", "model.overrides.num_layers=3",
                               "data.cameras=['a']"])
    assert set(differences(other, base)) == {"objective.shift", "model.num_layers", "data.cameras"}


def test_sample_refuses_a_config_that_disagrees_with_the_checkpoint(capsys, tmp_path):
    from flexpack.cli import main

    run, found = trained_run(tmp_path, *CHUNKED)
    rc = main(["sample", TINY, "--checkpoint", str(run)])
    err = capsys.readouterr().err
    assert rc == 2 and len(err.strip().splitlines()) == 1
    assert err.startswith("flexpack sample: error: ") and "model.mask = 'document', trained 'chunk_causal'" in err
    assert json.loads((found / "config.json").read_text())["model"]["mask"] == "chunk_causal"  # nothing rewritten
