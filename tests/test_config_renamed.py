"""Keys that [runtime] once held load at their new place (flexpack.run.config_renamed.RENAMED): a TOML file and
--set with one note per key on stderr, a run's saved config.json without one; each section checks its own
values and names the key as it is now."""

import json

import pytest

from flexpack.run.config import RENAMED, TrainConfig, load_config
from flexpack.run.state.runfolder import record_start

# a value for every moved key, none of them the default
VALUES = {
    "activation_checkpointing": 2, "compile": True, "activation_memory_budget": 0.5, "float8": "rowwise",
    "profile_steps": 3, "profile_warmup": 1, "peak_tflops": 500.0, "log_every": 7, "progress": False,
    "tensorboard": False, "wandb": True, "wandb_project": "p", "wandb_entity": "e", "wandb_tags": ["a", "b"],
    "eval_every": 4, "sample_every": 5, "sample_steps": 6, "sample_episodes": 2, "sample_cuts": 3,
    "sample_horizon": 8, "sample_plots": 1, "sample_draws": 2, "sample_min_context": 3, "sample_ema": True,
}
HELD = ["data.val_fraction=0.25", "objective.chunk_size=2", "optim.ema_decay=0.99"]  # what the values need


def _toml(value):
    return json.dumps(value)  # every value here is a JSON literal TOML reads alike


def _new_style() -> str:
    tables: dict[str, list[str]] = {}
    for old, value in VALUES.items():
        section, key = RENAMED[old].split(".")
        tables.setdefault(section, []).append(f"{key} = {_toml(value)}")
    return "".join(f"[{s}]\n" + "\n".join(lines) + "\n" for s, lines in tables.items())


def test_every_moved_key_is_in_the_table_and_names_a_field():
    assert set(VALUES) == set(RENAMED)
    cfg = TrainConfig()
    for new in RENAMED.values():
        section, key = new.split(".")
        assert hasattr(getattr(cfg, section), key), new
    assert not any(hasattr(cfg.runtime, old) for old in RENAMED)


def test_old_toml_keys_load_as_the_new_ones_with_one_note_each(tmp_path, capsys):
    new = tmp_path / "new.toml"
    new.write_text('[runtime]\ndevice = "cpu"\n' + _new_style())
    old = tmp_path / "old.toml"
    old.write_text('[runtime]\ndevice = "cpu"\n' + "".join(f"{k} = {_toml(v)}\n" for k, v in VALUES.items()))
    want = load_config(new, HELD)
    assert capsys.readouterr().err == ""
    got = load_config(old, HELD)
    assert got == want and got.sample.every == 5 and got.parallel.float8 == "rowwise" and got.log.every == 7
    err = capsys.readouterr().err.splitlines()
    assert sorted(err) == sorted(f"config: runtime.{k} is now {RENAMED[k]}" for k in VALUES)


def test_old_set_keys_load_as_the_new_ones_with_a_note(capsys):
    old = load_config(None, [*HELD, "runtime.sample_every=5", "runtime.log_every=3", "runtime.device=cpu"])
    assert capsys.readouterr().err.splitlines() == ["config: runtime.sample_every is now sample.every",
                                                    "config: runtime.log_every is now log.every"]
    assert old == load_config(None, [*HELD, "sample.every=5", "log.every=3", "runtime.device=cpu"])
    assert capsys.readouterr().err == ""


def test_set_of_an_old_key_overrides_the_file_and_errors_name_the_set(tmp_path, capsys):
    f = tmp_path / "c.toml"
    f.write_text("[sample]\nevery = 3\n")
    assert load_config(f, [*HELD, "runtime.sample_every=9"]).sample.every == 9
    with pytest.raises(ValueError, match=r"^--set runtime\.sample_steps=0: sample\.steps must be an integer from 1"):
        load_config(f, [*HELD, "runtime.sample_steps=0"])


def _old_saved(cfg: TrainConfig) -> dict:
    """``cfg`` as a run made before the split saved it: every moved key back under runtime."""
    d = cfg.to_dict()
    for old, new in RENAMED.items():
        section, key = new.split(".")
        d["runtime"][old] = d[section][key]
    for section in {n.split(".")[0] for n in RENAMED.values()}:
        del d[section]
    return json.loads(json.dumps(d))


def test_an_older_runs_config_json_loads_quietly_and_resumes_without_changes(tmp_path, capsys):
    cfg = load_config(None, [*HELD, "sample.every=5", "parallel.float8=rowwise", "log.wandb_tags=['x']",
                             f"runtime.out_dir={json.dumps(str(tmp_path / 'run'))}"])
    capsys.readouterr()
    saved = tmp_path / "config.json"
    saved.write_text(json.dumps(_old_saved(cfg), indent=2))
    assert "sample_every" in saved.read_text()
    assert load_config(saved) == cfg
    assert capsys.readouterr().err == ""  # a saved config: no notes
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps(_old_saved(cfg)))  # the first start, before the split
    assert record_start(run, cfg.to_dict(), start_step=10, world_size=1) == {}
    moved = load_config(None, [*HELD, "sample.every=10", f"runtime.out_dir={json.dumps(str(run))}",
                               "parallel.float8=rowwise", "log.wandb_tags=['x']"])
    assert record_start(run, moved.to_dict(), start_step=20, world_size=1) == {"sample.every": [5, 10]}


def test_one_key_under_both_names(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text("[runtime]\nsample_every = 5\n[sample]\nevery = 5\n")
    assert load_config(f, HELD).sample.every == 5  # the same value twice: fine
    f.write_text("[runtime]\nsample_every = 5\n[sample]\nevery = 6\n")
    with pytest.raises(ValueError, match=r"c\.toml: runtime\.sample_every = 5 and sample\.every = 6 are one setting"):
        load_config(f, HELD)
    f.write_text("[runtime]\nactivation_checkpointing = true\n[parallel]\nactivation_checkpointing = 1\n")
    with pytest.raises(ValueError, match="runtime.activation_checkpointing = True and parallel"):
        load_config(f)  # true (every block) is not 1 (the first block)
    assert load_config(None, [*HELD, "runtime.sample_every=5", "sample.every=5"]).sample.every == 5
    with pytest.raises(ValueError, match=r"--set runtime\.sample_every=5 and --set sample\.every=6 are one setting"):
        load_config(None, [*HELD, "runtime.sample_every=5", "sample.every=6"])
    assert load_config(None, [*HELD, "sample.every=5", "sample.every=6"]).sample.every == 6  # last wins


@pytest.mark.parametrize("setting, message", [
    ("runtime.dtype=float16", "runtime.dtype must be one of"),
    ("runtime.cpu_threads=0", "runtime.cpu_threads must be"),
    ("runtime.out_dir=''", "runtime.out_dir is empty"),
    ("runtime.device=tpu", "runtime.device must be"),
    ("parallel.compile=maybe", "parallel.compile must be true, false or 'auto'"),
    ("parallel.activation_checkpointing=-1", "parallel.activation_checkpointing must be true, false or a block"),
    ("parallel.activation_checkpointing=all", "parallel.activation_checkpointing must be true, false, a block"),
    ("parallel.activation_memory_budget=2.0", "parallel.activation_memory_budget must be between 0 and 1"),
    ("parallel.float8=int4", "parallel.float8 must be one of"),
    ("profile.steps=-1", "profile.steps must be >= 0"),
    ("profile.warmup=-1", "profile.warmup must be >= 0"),
    ("profile.peak_tflops=0.0", "profile.peak_tflops must be a positive number"),
    ("log.every=0", "log.every must be positive"),
    ("validation.every=-1", "validation.every must be >= 0"),
    ("sample.every=-1", "sample.every must be >= 0"),
    ("sample.steps=0", "sample.steps must be an integer from 1 to 10,000"),
    ("sample.episodes=0", "sample.episodes must be an integer from 1"),
    ("sample.cuts=0", "sample.cuts must be an integer from 1"),
    ("sample.horizon=-1", "sample.horizon must be an integer from 0"),
    ("sample.plots=-1", "sample.plots must be an integer from 0"),
    ("sample.draws=0", "sample.draws must be an integer from 1"),
    ("sample.min_context=-1", "sample.min_context must be an integer from 0"),
    ("validation.every=2", "validation.every=2 needs held-out episodes"),
    ("sample.ema=true", "sample.ema = true needs EMA weights"),
])
def test_each_section_checks_its_values_naming_the_key(setting, message):
    with pytest.raises(ValueError, match=f"^--set {setting}: " + message.replace(".", r"\.").replace("(", r"\(")):
        load_config(None, [setting])
