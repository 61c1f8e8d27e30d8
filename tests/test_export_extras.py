"""``flexpack export`` for the ecosystem: the model card, the LeRobot-style policy folder (read back with
lerobot's own loaders) and ``--push-to-hub`` (against a local-folder stand-in of the Hub API)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("lerobot")

from flexpack.cli import main as cli_main  # noqa: E402
from flexpack.commands.train import train  # noqa: E402
from flexpack.data import action_stats  # noqa: E402
from flexpack.data.actions import ActionNormalizer  # noqa: E402
from flexpack.data.episodes import EpisodeSource  # noqa: E402
from flexpack.run.model import build_model  # noqa: E402
from flexpack.run.state import checkpoint  # noqa: E402
from flexpack.tools.export_extras import push_to_hub  # noqa: E402
from helpers import tiny_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def exported(tiny_dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("extras")
    cfg = tiny_config(tiny_dataset, tmp / "run", "schedule.steps=2")
    train(cfg)
    samples = tmp / "run" / "samples" / "step_00000002"  # what a sampling run leaves
    samples.mkdir(parents=True)
    (samples / "metrics.json").write_text(json.dumps({"action_mse": 0.125, "episodes": 3, "note": "x"}))
    assert cli_main(["export", str(tmp / "run"), str(tmp / "out")]) == 0
    return cfg, tmp


def test_model_card_names_base_data_steps_config_losses_and_samples(exported):
    cfg, tmp = exported
    card = (tmp / "out" / "README.md").read_text()
    assert card.startswith("---\nlibrary_name: flexpack\nlicense: apache-2.0\n")
    records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
    assert (f"- `loss`: {records[-1]['loss']:.5g}" in card
            and f"- `action_loss`: {records[-1]['action_loss']:.5g}" in card)
    assert "| base model | none (random init, preset 'small') |" in card
    assert f"`{cfg.data.root}` (6 episodes, {sum(EpisodeSource(cfg.data.root).video_frames)} frames" in card
    assert "| steps | 2 of 2 (pack mode, 60 tokens per micro-batch" in card
    assert "- `action_mse`: 0.125" in card and "- `episodes`: 3" in card
    assert "note" not in card.split("## Sample")[1].split("##")[0]
    assert '"max_tokens": 60' in card  # the training config


def test_policy_folder_loads_with_lerobot_and_normalizes_as_training_did(exported):
    from lerobot.processor import DataProcessorPipeline
    from safetensors.torch import load_file

    cfg, tmp = exported
    folder = tmp / "out" / "lerobot_policy"
    config = json.loads((folder / "config.json").read_text())
    assert config["type"] == "flexpack_wanva" and config["normalization_mapping"]["ACTION"] == "QUANTILES"
    assert config["input_features"]["observation.images.cam0"] == {"type": "VISUAL", "shape": [3, 32, 32]}
    assert config["output_features"] == {"action": {"type": "ACTION", "shape": [6]}}

    model = build_model(cfg)
    checkpoint.load(checkpoint.latest(Path(cfg.runtime.out_dir) / "checkpoints"), model, restore_rng=False)
    weights = load_file(folder / "model.safetensors")
    assert weights.keys() == model.state_dict().keys()
    assert all(torch.equal(weights[k], v) for k, v in model.state_dict().items())

    pre = DataProcessorPipeline.from_pretrained(folder, config_filename="policy_preprocessor.json")
    post = DataProcessorPipeline.from_pretrained(folder, config_filename="policy_postprocessor.json")
    stats = action_stats.compute(EpisodeSource(cfg.data.root))["features"]
    state = pre.steps[0].state_dict()
    np.testing.assert_allclose(state["action.q01"].numpy(), stats["action"]["q01"], rtol=1e-6)
    np.testing.assert_allclose(state["observation.state.q99"].numpy(), stats["observation.state"]["q99"], rtol=1e-6)
    # inside the bounds LeRobot's QUANTILES map equals the normalizer training used, and inverts it
    x = torch.tensor(np.linspace(stats["action"]["q01"], stats["action"]["q99"], 5), dtype=torch.float32)
    ours = ActionNormalizer.from_stats(stats["action"], 6)(x.numpy().astype(np.float64))
    normed = pre.steps[0]._normalize_action(x, inverse=False)
    np.testing.assert_allclose(normed.numpy(), ours, atol=1e-5)
    torch.testing.assert_close(post.steps[0]._normalize_action(normed, inverse=True), x, atol=1e-5, rtol=1e-5)


class LocalFolderApi:
    """The two HfApi calls push_to_hub makes, against a folder standing in for the Hub."""

    def __init__(self, hub: Path) -> None:
        self.hub, self.calls = hub, []

    def create_repo(self, *, repo_id, repo_type, private, exist_ok):
        self.calls.append(("create_repo", repo_id, repo_type, private, exist_ok))
        (self.hub / repo_id).mkdir(parents=True, exist_ok=exist_ok)

    def upload_folder(self, *, folder_path, repo_id, repo_type, commit_message):
        self.calls.append(("upload_folder", repo_id, commit_message))
        shutil.copytree(folder_path, self.hub / repo_id, dirs_exist_ok=True)
        return f"{self.hub / repo_id}@local"


def test_push_to_hub_uploads_the_whole_folder(exported, tmp_path, monkeypatch):
    _, tmp = exported
    api = LocalFolderApi(tmp_path / "hub")
    assert (push_to_hub(tmp / "out", "lab/policy", private=True, api=api)
            == f"{tmp_path / 'hub' / 'lab' / 'policy'}@local")
    assert api.calls[0] == ("create_repo", "lab/policy", "model", True, True)
    hub_repo = tmp_path / "hub" / "lab" / "policy"
    sent = sorted(str(p.relative_to(hub_repo)) for p in hub_repo.rglob("*"))
    assert sent == sorted(str(p.relative_to(tmp / "out")) for p in (tmp / "out").rglob("*"))
    # the CLI flag goes through huggingface_hub's HfApi (replaced here: no network)
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: api)
    assert cli_main(["export", str(tmp / "run"), str(tmp_path / "again"), "--no-policy",
                     "--push-to-hub", "lab/again"]) == 0
    assert (tmp_path / "hub" / "lab" / "again" / "README.md").is_file()
    assert not (tmp_path / "again" / "lerobot_policy").exists()


def test_failed_upload_is_one_line_and_keeps_the_export(exported, tmp_path, monkeypatch, capsys):
    _, tmp = exported
    import huggingface_hub

    class Offline:
        def create_repo(self, **kw):
            raise ConnectionError("no network")

    monkeypatch.setattr(huggingface_hub, "HfApi", lambda: Offline())
    assert cli_main(["export", str(tmp / "run"), str(tmp_path / "out"), "--push-to-hub", "lab/x"]) == 2
    err = capsys.readouterr().err
    last = err.strip().splitlines()[-1]  # export first names the checkpoint it used on its own line
    assert last.startswith(f"flexpack export: error: {tmp_path / 'out'} is exported, but the upload to lab/x failed "
                           "(ConnectionError: no network)") and "Traceback" not in err
    assert (tmp_path / "out" / "README.md").is_file()


def test_missing_extras_are_one_line_naming_the_extra(exported, tmp_path, monkeypatch, capsys):
    import sys

    _, tmp = exported
    monkeypatch.setitem(sys.modules, "huggingface_hub", None)  # import fails as if not installed
    assert cli_main(["export", str(tmp / "run"), str(tmp_path / "a"), "--push-to-hub", "lab/x"]) == 2
    assert "--push-to-hub needs huggingface_hub: pip install 'flexpack[hub]'" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "diffusers", None)
    assert cli_main(["export", str(tmp / "run"), str(tmp_path / "b")]) == 2
    assert ("flexpack export: error: flexpack export --format diffusers needs diffusers: pip install 'flexpack[hf]'"
            in capsys.readouterr().err)
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()  # nothing written
