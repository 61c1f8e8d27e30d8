"""``flexpack config show / defaults / markdown`` and the one-line docs of every config key."""

from __future__ import annotations

import dataclasses
import typing
from pathlib import Path

import pytest

from flexpack.cli import main
from flexpack.run import config_doc
from flexpack.run.config import TrainConfig, load_config
from flexpack.run.resolve import checked

ROOT = Path(__file__).resolve().parents[1]


def all_paths() -> list[str]:
    """Every leaf key, listed straight from the dataclasses (not through config_doc)."""
    hints = typing.get_type_hints(TrainConfig)
    return [f"{s.name}.{f.name}" for s in dataclasses.fields(TrainConfig) for f in dataclasses.fields(hints[s.name])]


def test_every_field_has_a_doc():
    listed = {k.path: k.doc for k in config_doc.keys()}
    assert sorted(listed) == sorted(all_paths())
    missing = [p for p, doc in listed.items() if not doc.strip()]
    assert not missing, f"config fields without a doc comment on their line: {missing}"


def test_docs_are_read_from_trailing_and_preceding_comments():
    @dataclasses.dataclass
    class Demo:
        a: int = 1  # the a doc
        # the b doc,
        # over two lines
        b: int = 2
        c: int = 3

    assert config_doc.field_docs(Demo) == {"a": "the a doc", "b": "the b doc, over two lines", "c": ""}


def test_show_lists_every_key_with_the_resolved_set_value(capsys):
    assert main(["config", "show", str(ROOT / "configs/tiny_cpu.toml"), "--set", "schedule.steps=37",
                 "--set", "data.cameras=[\"observation.images.top\"]"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for path in all_paths():
        section, name = path.split(".")
        assert f"[{section}]" in lines
        assert any(line[2:].startswith(f"{name} = ") for line in lines), path
    steps = next(line for line in lines if line[2:].startswith("steps = "))
    assert steps.startswith("* steps = 37 ")
    assert "optimizer steps of the whole run" in steps and "(default: 1000)" in steps
    cams = next(line for line in lines if line[2:].startswith("cameras = "))
    assert cams.startswith('* cameras = ["observation.images.top"]') and "(default: unset)" in cams
    lr = next(line for line in lines if line[2:].startswith("lr = "))
    assert lr.startswith("* lr = 0.003 ")  # the file's value (tiny_cpu.toml), not the default
    decay = next(line for line in lines if line[2:].startswith("decay = "))
    assert decay.startswith("  decay = \"cosine\"") and "(default:" not in decay


def test_bad_set_key_is_one_line_and_exit_2(capsys):
    assert main(["config", "show", "--set", "schedule.stepz=3"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("flexpack config: error: --set schedule.stepz=3: unknown config key(s) schedule.stepz")


def test_defaults_round_trip(tmp_path, capsys):
    assert main(["config", "defaults"]) == 0
    text = capsys.readouterr().out
    path = tmp_path / "defaults.toml"
    path.write_text(text)
    assert load_config(path).to_dict() == checked(TrainConfig()).to_dict()
    # every key is there: set, or commented out when its default is None (TOML has no null)
    for k in config_doc.keys():
        line = f"# {k.name} = " if k.default is None else f"{k.name} = {config_doc.toml_value(k.default)}"
        assert f"[{k.section}]" in text and line in text, k.path
        assert f"# {k.doc}" in text


def test_defaults_load_back_a_changed_value(tmp_path, capsys):
    # the file really drives the values: editing one line of it changes exactly that key
    assert main(["config", "defaults"]) == 0
    text = capsys.readouterr().out.replace("\nwarmup_steps = 100\n", "\nwarmup_steps = 7\n", 1)
    path = tmp_path / "edited.toml"
    path.write_text(text)
    assert load_config(path).schedule.warmup_steps == 7


def test_config_md_is_current():
    committed = (ROOT / "docs/CONFIG.md").read_text()
    assert committed == config_doc.render_markdown(), (
        f"docs/CONFIG.md is stale: regenerate it with `{config_doc.REGENERATE}`")
    for path in all_paths():
        assert f"| `{path.split('.')[1]}` |" in committed


@pytest.mark.parametrize("command", ["train", "verify", "sample"])
def test_help_of_config_commands_points_to_config_show(command, capsys):
    with pytest.raises(SystemExit) as exc:
        main([command, "--help"])
    assert exc.value.code == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "flexpack config show" in out and "flexpack config defaults" in out and "docs/CONFIG.md" in out
