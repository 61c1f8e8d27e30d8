"""Datasets named by LeRobot repo id, resolved in lerobot's local cache (HF_LEROBOT_HOME); never downloaded."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("lerobot")

from flexpack.cli import main as cli_main  # noqa: E402
from flexpack.data.hub import resolve_root  # noqa: E402
from flexpack.data.synthetic import make_synthetic_dataset  # noqa: E402


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_LEROBOT_HOME", str(tmp_path / "lerobot-home"))
    return tmp_path / "lerobot-home"


def test_repo_id_resolves_in_the_lerobot_cache(home, tmp_path, monkeypatch, capsys):
    root = make_synthetic_dataset(home / "testorg" / "tiny", lengths=[9, 13], seed=1)
    monkeypatch.chdir(tmp_path)  # no ./testorg/tiny: the id is looked up in the cache
    assert resolve_root("testorg/tiny") == root
    assert cli_main(["encode", "--dataset", "testorg/tiny", "--no-progress"]) == 0
    assert (root / "latents" / "text").is_dir()  # the cache goes beside the resolved dataset
    assert cli_main(["check-dataset", "testorg/tiny"]) == 0
    assert cli_main(["stats", "--dataset", "testorg/tiny", "--mode", "pack", "--json", "--tokens-per-frame", "5",
                     "--max-tokens", "100"]) == 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["episodes"] == 2
    # a local folder of that name wins over the cache
    local = make_synthetic_dataset(tmp_path / "testorg" / "tiny", lengths=[9], seed=2)
    assert resolve_root("testorg/tiny") == local.relative_to(tmp_path)


def test_missing_repo_id_says_where_it_looked_and_how_to_download(home, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as info:
        resolve_root("someorg/absent")
    msg = str(info.value)
    assert str(home / "someorg" / "absent" / "meta" / "info.json") in msg
    assert "hf download someorg/absent --repo-type dataset" in msg and "\n" not in msg
    assert cli_main(["encode", "--dataset", "someorg/absent", "--no-progress"]) == 2
    assert "not in the LeRobot cache" in capsys.readouterr().err
    from flexpack.run.compose import build_run
    from flexpack.run.config import load_config

    with pytest.raises(FileNotFoundError, match="someorg/absent: no such folder"):
        build_run(load_config(overrides=["data.root='someorg/absent'"]))
