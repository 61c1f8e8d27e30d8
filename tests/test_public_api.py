"""The public API holds: every name of ``flexpack.__all__`` imports, and every path that moved still works for a
minor version, warning with a DeprecationWarning that names the new place (CHANGELOG.md lists them); the
HF-style packing keys count the tokens per frame the collate recorded."""

from __future__ import annotations

import importlib
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import flexpack
from flexpack.packing.collate import PackCollate, PadCollate

ROOT = Path(__file__).resolve().parents[1]
# old module path -> the module it moved to (every module of flexpack.training.runstate included)
MOVED = {
    "flexpack.training.config": "flexpack.run.config",
    "flexpack.training.checkpoint": "flexpack.run.state.checkpoint",
    **{f"flexpack.training.runstate.{m}": f"flexpack.run.state.{m}"
       for m in ("checkpoint", "resume", "runfolder", "faults", "manifest", "safeload")},
    # each family's code moved into its folder (flexpack/families/<name>/), no file left at the old path
    "flexpack.models.wan": "flexpack.families.wan.model",
    "flexpack.models.wan_config": "flexpack.families.wan.config",
    "flexpack.models.wan_convert": "flexpack.families.wan.convert",
    "flexpack.models.lingbot": "flexpack.families.lingbot.model",
    "flexpack.models.lingbot_config": "flexpack.families.lingbot.config",
    "flexpack.models.lingbot_convert": "flexpack.families.lingbot.convert",
    "flexpack.models.lingbot_family": "flexpack.families.lingbot.family",
    "flexpack.flow.lingbot": "flexpack.families.lingbot.objective",
    "flexpack.sampling.lingbot": "flexpack.families.lingbot.sampler",
    "flexpack.tools.export_lerobot": "flexpack.families.lingbot.export_lerobot",
    "flexpack.tools.export_upstream": "flexpack.families.lingbot.export_upstream",
    "flexpack.tools.export_bundle": "flexpack.families.lingbot.export_bundle",
    "flexpack.attention.mask_lingbot": "flexpack.families.lingbot.mask",
    # the config reference documents the config class itself: it belongs with it in run/
    "flexpack.tools.config_doc": "flexpack.run.config_doc",
}
# names that moved out of a module that stays: (old module, name) -> the module it moved to
MOVED_NAMES = {
    **{("flexpack.models", n): "flexpack.families.wan.model" for n in ("WanVA", "WanVAOutput")},
    **{("flexpack.models", n): "flexpack.families.wan.config" for n in ("WanVAConfig", "PRESETS", "wan_config")},
    **{("flexpack.models", n): "flexpack.families.lingbot.model" for n in ("LingbotVA",)},
    **{("flexpack.models", n): "flexpack.families.lingbot.config" for n in ("LingbotConfig", "lingbot_config")},
    ("flexpack.attention.masks", "lingbot_mask"): "flexpack.families.lingbot.mask",
    **{("flexpack.tools.export", n): "flexpack.families.wan.export"
       for n in ("ACTION_FORMAT", "load_export", "write_diffusers", "write_weights")},
    **{("flexpack.tools.export_extras", n): "flexpack.families.wan.export_policy"
       for n in ("POLICY_TYPE", "write_extras", "write_policy_folder")},
    ("flexpack.run.root", "run_for"): "flexpack.run.compose",
    ("flexpack.run.build", "build_run"): "flexpack.run.compose",
}


def _items(frames: list[int]) -> list[dict]:
    return [dict(latent=torch.zeros(4, f, 1, 1), episode_index=i) for i, f in enumerate(frames)]


def test_every_public_name_imports_and_the_list_is_explicit():
    """``from flexpack import NAME`` for each name of ``__all__`` gives the object of the module that defines it;
    ``__all__`` is a literal list (what users import, not whatever the lazy table holds), kept sorted, and a
    fresh ``import flexpack`` imports neither torch nor lerobot."""
    assert flexpack.__all__ == sorted(flexpack.__all__) and len(set(flexpack.__all__)) == len(flexpack.__all__)
    assert set(flexpack.__all__) == set(flexpack._LAZY)
    for name in flexpack.__all__:
        value = getattr(flexpack, name)
        assert value is getattr(importlib.import_module(flexpack._LAZY[name]), name), name
    ns: dict = {}
    exec("from flexpack import *", ns)  # noqa: S102 (the star import takes exactly __all__)
    assert set(ns) - {"__builtins__"} == set(flexpack.__all__)
    assert {"PackCollate", "TrainConfig", "load_config", "train", "LingbotVA"} <= set(flexpack.__all__)
    code = "import sys, flexpack; print('torch' in sys.modules, 'lerobot' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.parametrize("old,new", sorted(MOVED.items()))
def test_moved_modules_warn_naming_the_new_place_and_give_its_objects(old, new, monkeypatch):
    for name in [m for m in sys.modules if m == old]:  # imported by another test: import it afresh
        monkeypatch.delitem(sys.modules, name)
    parent, _, leaf = old.rpartition(".")
    if leaf in vars(sys.modules.get(parent, sys)):  # not hasattr: a package may warn for a moved name of its own
        monkeypatch.delattr(sys.modules[parent], leaf)
    with pytest.warns(DeprecationWarning) as seen:
        shim = importlib.import_module(old)
    (w,) = [w for w in seen if old in str(w.message)]
    assert str(w.message) == (f"{old} is deprecated: it moved to {new}; import that instead (the old path goes in "
                              "flexpack 0.3)")
    assert w.filename == __file__  # said at the importing line, not inside the import system
    real = importlib.import_module(new)
    public = [n for n in vars(real) if not n.startswith("_")]
    assert public and all(getattr(shim, n) is getattr(real, n) for n in public)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        shim.nope  # noqa: B018


def test_every_shim_is_listed_here():
    """Each deprecated old module path (a shim file, ``tests/test_layers.py: shims``, or one of
    ``flexpack.MOVED_MODULES``) is tested above."""
    from test_layers import shims

    assert {**shims(), **flexpack.MOVED_MODULES} == MOVED


@pytest.mark.parametrize("old,name", sorted(MOVED_NAMES))
def test_moved_names_warn_naming_the_new_place_and_give_its_objects(old, name, monkeypatch):
    module = importlib.import_module(old)
    if name in vars(module):  # the old submodule of that name, imported by the test above, shadows the name
        monkeypatch.delattr(module, name)
    new = MOVED_NAMES[old, name]
    with pytest.warns(DeprecationWarning) as seen:
        value = getattr(module, name)
    (w,) = seen
    assert str(w.message) == (f"{old}.{name} is deprecated: it moved to {new}; import it from there (the old path "
                              "goes in flexpack 0.3)")
    assert w.filename == __file__
    assert value is getattr(importlib.import_module(new), name)


def test_old_import_statements_keep_working():
    """The forms the old paths were imported with: a name from the module, the module from its package."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from flexpack.run.config import load_config as new_load
        from flexpack.run.state import checkpoint as new_checkpoint
        from flexpack.run.state.faults import NonFiniteError
        from flexpack.training import checkpoint
        from flexpack.training.config import TrainConfig, load_config
        from flexpack.training.runstate import checkpoint as runstate_checkpoint
        from flexpack.training.runstate.faults import NonFiniteError as old_error
    assert load_config is new_load and isinstance(load_config(None, ["schedule.steps=3"]), TrainConfig)
    assert checkpoint.latest is runstate_checkpoint.latest is new_checkpoint.latest
    assert old_error is NonFiniteError


def test_pack_collate_tokens_per_frame_is_deprecated_and_still_counts_tokens():
    """``PackCollate(budget, tokens_per_frame=N)`` warns naming ``PackCollate.from_token_budget`` and its batches
    count the HF-style keys in those tokens, as ``from_token_budget``'s do (no argument needed)."""
    said = r"PackCollate\(frame_budget, tokens_per_frame=\.\.\.\) is deprecated .*use PackCollate\.from_token_budget\("
    with pytest.warns(DeprecationWarning, match=said + r"max_tokens, tokens_per_frame\)"):
        old = PackCollate(12, tokens_per_frame=2)
    new = PackCollate.from_token_budget(24, tokens_per_frame=2)
    assert (old.frame_budget, new.frame_budget, old.tokens_per_frame, new.tokens_per_frame) == (12, 12, 2, 2)
    a, b = old(_items([3, 5, 2])), new(_items([3, 5, 2]))
    assert a.tokens_per_frame == b.tokens_per_frame == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a recorded count warns about nothing
        ka, kb = a.hf_packing_kwargs(), b.hf_packing_kwargs()
    assert ka["cu_seq_lens_q"].tolist() == kb["cu_seq_lens_q"].tolist() == [0, 6, 16, 20]
    assert ka["max_length_q"] == 10 and kb["position_ids"].shape == (1, 24)
    with pytest.raises(ValueError, match="tokens_per_frame must be positive, got 0"), pytest.warns(DeprecationWarning):
        PackCollate(12, tokens_per_frame=0)


def test_hf_packing_kwargs_counts_the_recorded_tokens_an_argument_wins_and_no_record_warns():
    batch = PackCollate.from_token_budget(40, tokens_per_frame=4)(_items([2, 3]))
    assert batch.hf_packing_kwargs()["cu_seq_lens_q"].tolist() == [0, 8, 20]  # 4 tokens per frame
    assert batch.hf_packing_kwargs(1)["cu_seq_lens_q"].tolist() == [0, 2, 5]  # the caller's unit wins
    moved = batch.to("cpu")
    assert moved.tokens_per_frame == 4 and moved.hf_packing_kwargs()["max_length_q"] == 12
    bare = PackCollate(10)(_items([2, 3]))
    assert bare.tokens_per_frame is None
    with pytest.warns(UserWarning, match=r"records no tokens per frame .*PackCollate\.from_token_budget.* count "
                                         r"latent frames; pass tokens_per_frame="):
        frames = bare.hf_packing_kwargs()
    assert frames["cu_seq_lens_q"].tolist() == [0, 2, 5]  # the old count: one per latent frame


def test_batch_extras_is_deprecated_and_gives_the_packing_keys():
    batch = PackCollate.from_token_budget(40, tokens_per_frame=4)(_items([2, 3]))
    with pytest.warns(DeprecationWarning, match=r"Batch\.extras is deprecated .*use Batch\.hf_packing_kwargs\(\)"):
        extras = batch.extras
    want = batch.hf_packing_kwargs()
    assert extras.keys() == want.keys() and all(torch.equal(torch.as_tensor(extras[k]), torch.as_tensor(want[k]))
                                                for k in want)
    assert extras["cu_seq_lens_q"].tolist() == [0, 8, 20]
    with pytest.warns(DeprecationWarning):
        assert PadCollate(4)(_items([2, 3])).extras == {}  # pad mode had none


def test_the_changelog_records_every_move():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "## [Unreleased]" in text and "### Deprecated" in text
    for old, new in MOVED.items():
        if old.startswith("flexpack.training.runstate."):
            old, new = "flexpack.training.runstate", "flexpack.run.state"
        assert f"`{old}`" in text and f"`{new}`" in text, old
    for name in ("PackCollate.from_token_budget", "Batch.extras", "Batch.hf_packing_kwargs()", "flexpack 0.3"):
        assert name in text, name


def test_train_given_a_config_is_deprecated_naming_the_run_form(tmp_path):
    """``loop.train(config)`` and ``loop.train(config, run=run)``, the forms before the loop took a Run, work as they
    did (the start-up from the config, then the run's steps), warning at the calling line with a DeprecationWarning
    that names the call to use; ``loop.train(run)`` warns about nothing."""
    from flexpack.errors import UserError
    from flexpack.run.config import load_config
    from flexpack.run.memory_data import synthetic_run
    from flexpack.training.loop import train

    cfg = load_config(ROOT / "configs" / "tiny_cpu.toml", [
        f'runtime.out_dir="{tmp_path / "run"}"', "log.progress=false", "log.tensorboard=false", "checkpoint.every=0",
        "data.max_tokens=60", "schedule.steps=1"])
    with pytest.warns(DeprecationWarning) as seen, pytest.raises(UserError, match="--stop-after must be an integer"):
        train(cfg, stop_after=-1)  # the start-up runs from the config, as before: its stop-step check refuses
    (w,) = [w for w in seen if "loop.train" in str(w.message)]
    assert str(w.message) == (
        'flexpack.training.loop.train(config) is deprecated: call train(compose(config, "train")) '
        "(flexpack.run.compose), or flexpack.commands.train.train(config) (what flexpack train runs: the start-up "
        "before any data is opened); the config form goes in flexpack 0.3")
    assert w.filename == __file__
    run = synthetic_run(cfg, text_len=4)
    with pytest.warns(DeprecationWarning) as seen:
        old = train(cfg, run=run, stop_after=0)  # built and loaded, no step taken
    (w,) = [w for w in seen if "loop.train" in str(w.message)]
    assert str(w.message) == ("flexpack.training.loop.train(config, run=run) is deprecated: call train(run), the run "
                              "holding its config; the config form goes in flexpack 0.3")
    assert w.filename == __file__ and old.step == old.start_step == 0 and old.model is not None
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*is deprecated", category=DeprecationWarning)
        new = train(run, stop_after=1)
    assert new.step == 1 and len(new.losses) == 1


def test_the_changelog_records_the_train_deprecation():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert "`flexpack.training.loop.train(config)`" in text and "`train(run)`" in text
