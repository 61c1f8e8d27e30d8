"""A model family registered from outside flexpack (``tests/toy_family.py``: its model, config, preset,
objective, export format and export reader) trains, verifies, samples and exports through the command line and
the API, and flexpack's generic code reads everything it needs from the family's registry entry: the objective
class, the blocks (a callable here, not an attribute name) and the export writer."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lerobot")

from flexpack.models import registry  # noqa: E402
from flexpack.parallel.blocks import block_list  # noqa: E402
from flexpack.parallel.parallelize import ParallelOptions, parallelize  # noqa: E402
from flexpack.run.compose import build_run  # noqa: E402
from flexpack.run.state import checkpoint  # noqa: E402
from helpers import TINY, run_cli, set_args, tiny_config, tiny_sets  # noqa: E402
from toy_family import NAME, ToyModel, ToyObjective, read_toy, toy_family  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
TOY = (f"model.family='{NAME}'", "model.preset='toy'", "model.overrides={in_channels=48, text_dim=64, "
       "action_channels=6, attn_backend='dense'}", "data.val_episodes=[0, 2]", "log.tensorboard=false",
       "data.max_tokens=120")  # 8 tokens per frame: 4 latent pixels, 4 action steps


@pytest.fixture(scope="module")
def toy():
    registry.register(NAME, toy_family)
    yield NAME
    registry._FAMILIES.pop(NAME)


@pytest.fixture(scope="module")
def trained(toy, tiny_dataset, tmp_path_factory):
    run = tmp_path_factory.mktemp("toy") / "run"
    code = run_cli_plain("train", str(TINY), *set_args(tiny_sets(tiny_dataset, run, *TOY, "schedule.steps=4")))
    assert code == 0
    return tiny_dataset, run


def run_cli_plain(*argv: str) -> int:
    from flexpack.cli import main

    try:
        return main(list(argv))
    except SystemExit as exc:
        return exc.code


def test_the_run_asks_the_family_for_its_model_objective_and_blocks(toy, tiny_dataset, tmp_path):
    run = build_run(tiny_config(tiny_dataset, tmp_path / "a", *TOY))
    assert run.family is registry.family(NAME) and isinstance(run.objective, ToyObjective)
    assert run.model_config.in_channels == 48 and run.model_config.width == 32
    model = run.build_model()
    assert isinstance(model, ToyModel) and run.family.block_list(model) is model.layers
    assert run.parallel.blocks is run.family.blocks and registry.family_of(model) is run.family
    batch = run.collate([run.dataset[i] for i in next(iter(run.sampler))])
    out = model(batch, timestep=torch.full(batch.layout.frame_doc.shape, 500.0))
    assert out.video.shape == batch.latent.shape and out.action.shape == batch.action.shape


def test_parallelize_checkpoints_the_blocks_the_family_names(toy):
    model = ToyModel(registry.family(NAME).config("toy"))
    parallelize(model, device=torch.device("cpu"),
                options=ParallelOptions(activation_checkpointing=True, blocks=registry.family(NAME).blocks))
    assert [type(b).__name__ for b in block_list(model, lambda m: m.layers)] == ["CheckpointWrapper"] * 2


def test_train_writes_a_checkpoint_of_the_toy_that_loads_back(trained):
    _, run = trained
    found = checkpoint.latest(run / "checkpoints")
    assert json.loads((found / "train_state.json").read_text())["step"] == 4
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in rows if "loss" in r]
    assert len(losses) == 4 and all(torch.isfinite(torch.tensor(losses)))
    model = ToyModel(registry.family(NAME).config("toy", in_channels=48, text_dim=64, action_channels=6))
    checkpoint.load(found, model, restore_rng=False)
    saved = checkpoint.read_tensors(found)
    assert set(saved) == set(model.state_dict()) and torch.equal(model.video_in.weight, saved["video_in.weight"])


def test_verify_finds_packed_and_per_episode_forwards_equal(trained, capsys):
    root, run = trained
    code, err = run_cli(capsys, "verify", str(TINY), *set_args(tiny_sets(root, run, *TOY)),
                        "--checkpoint", str(run))
    assert code == 0, err


def test_sample_and_export_through_the_command_line(trained, tmp_path, capsys):
    root, run = trained
    argv = ("--episodes", "0,2", "--steps", "2", "--plots", "0", "--cuts", "1", "--horizon", "2",
            "--min-context", "1", "--samples", "1")
    code, err = run_cli(capsys, "sample", str(run), "--checkpoint", str(run), "--out", str(tmp_path / "s"), *argv)
    assert code == 0, err
    from_run = json.loads((tmp_path / "s" / "metrics.json").read_text())
    assert from_run["episodes"] == [0, 2] and from_run["action_mse"] > 0

    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "e"), "--format", "toy")
    assert code == 0, err
    assert json.loads((tmp_path / "e" / "export.json").read_text())["format"] == "toy"
    model = read_toy(str(tmp_path / "e"), registry.family(NAME).config("toy", in_channels=48, text_dim=64,
                                                                         action_channels=6))
    trained_model = ToyModel(model.config)
    checkpoint.load(checkpoint.latest(run / "checkpoints"), trained_model, restore_rng=False)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), trained_model.state_dict().values()))

    code, err = run_cli(capsys, "sample", str(tmp_path / "e"), "--checkpoint", str(tmp_path / "e"),
                        "--out", str(tmp_path / "s2"), *argv)
    assert code == 0, err
    from_export = json.loads((tmp_path / "s2" / "metrics.json").read_text())
    assert from_export["action_mse"] == pytest.approx(from_run["action_mse"], rel=1e-5)


def test_a_format_of_another_family_is_refused_in_one_line(trained, tmp_path, capsys):
    _, run = trained
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "d"), "--format", "diffusers")
    assert code == 2 and "checkpoint exports as ['toy'], not --format 'diffusers'" in err
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "d"), "--no-policy")  # an option of wanva's format
    assert code == 2 and "--no-policy applies to --format diffusers (its OUT/lerobot_policy/" in err
    assert "not to the 'toy' export" in err
