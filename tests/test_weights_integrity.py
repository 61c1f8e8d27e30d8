"""Damaged weights are one line, before any step or sample: an export cut short or overwritten (sample), a
model.pretrained file cut short (export, verify, train: where the config reads it), non-finite weights in a
checkpoint (resume, sample, export, the EMA) or an export named by their first tensor, and a NaN in
model.pretrained reported as the checkpoint's, not as a learning-rate problem."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot.policies.lingbot_va", reason="the installed lerobot has no lingbot_va policy")

from safetensors.torch import load_file, save_file  # noqa: E402

from flexpack.run.resolve import config_family, model_config_of  # noqa: E402
from flexpack.run.state import checkpoint  # noqa: E402
from helpers import TINY, run_cli, save_policy, set_args, tiny_sets  # noqa: E402

LINGBOT = ["model.family=lingbot-va", "model.preset=lingbot-va-tiny"]
FAST = ["--horizon", "4", "--plots", "0", "--samples", "1", "--set", "model.overrides.num_inference_steps=2",
        "--set", "model.overrides.action_num_inference_steps=2"]
pytestmark = pytest.mark.usefixtures("one_thread")


def one_line(code: int, err: str, command: str) -> str:
    """The one error line of a command's stderr (notes and warnings before it aside), exit status 2."""
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err and sum("error:" in x for x in lines) == 1, err
    assert lines[-1].startswith(f"flexpack {command}: error: "), err
    return lines[-1]


def cut(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def poison(path: Path, key: str | None = None) -> str:
    """One NaN in a tensor of the safetensors file ``path`` (``key``, default its 6th); returns the key."""
    tensors = load_file(path)
    key = key or sorted(tensors)[5]
    tensors[key].view(-1)[0] = float("nan")
    save_file(tensors, path)
    return key


@pytest.fixture(scope="module")
def fine_tuned(tiny_dataset, tmp_path_factory):
    """A lingbot-va run fine-tuned 1 step from a LeRobot policy (EMA kept) and its export: (root, run, export)."""
    from flexpack.cli import main

    root = tmp_path_factory.mktemp("integrity")
    save_policy(root / "policy", attention_head_dim=24)
    sets = [*tiny_sets(tiny_dataset, root / "run", "schedule.steps=1", "optim.ema_decay=0.5"), *LINGBOT,
            f'model.pretrained="{root / "policy"}"']
    assert main(["train", str(TINY), *set_args(sets)]) == 0
    assert main(["export", str(root / "run"), str(root / "export"), "--allow-unrunnable"]) == 0
    return root, root / "run", root / "export"


def test_a_damaged_export_is_one_line_in_sample(fine_tuned, tmp_path, capsys) -> None:
    _, _, export = fine_tuned
    for damage, said in (("cut", "model.safetensors: not a readable safetensors file (Error while deserializing "
                                 "header: incomplete metadata, file not fully covered); the export is damaged (cut "
                                 "short?): export the run again"),
                         ("config", "config.json: not readable as JSON"),
                         ("processor", "policy_preprocessor.json: not readable as JSON"),
                         ("nan", "holds non-finite values (1 NaN and 0 infinite of ")):
        copy = tmp_path / damage
        shutil.copytree(export, copy)
        if damage == "cut":
            cut(copy / "model.safetensors")
        elif damage == "nan":
            poison(copy / "model.safetensors", "transformer.patch_embedding_mlp.weight")
        else:
            (copy / f"{'policy_preprocessor' if damage == 'processor' else 'config'}.json").write_text("{")
        code, err = run_cli(capsys, "sample", str(copy), "--out", str(tmp_path / f"s-{damage}"), *FAST)
        line = one_line(code, err, "sample")
        assert said in line and str(copy) in line, line
        assert not (tmp_path / f"s-{damage}").exists()
    assert f"{tmp_path / 'nan'}: weight 'patch_embed.weight' holds" in line


def test_a_cut_model_pretrained_is_one_line_where_it_is_read(fine_tuned, tmp_path, capsys) -> None:
    """export and verify resolve the run's config, which reads model.pretrained's header; sample does not read it."""
    root, run, _ = fine_tuned
    weights = root / "policy" / "model.safetensors"
    intact = weights.read_bytes()
    cut(weights)
    try:
        said = f"{weights}: not a readable safetensors file (Error while deserializing header"
        code, err = run_cli(capsys, "export", str(run), str(tmp_path / "out"), "--allow-unrunnable")
        assert said in one_line(code, err, "export") and not (tmp_path / "out").exists()
        code, err = run_cli(capsys, "verify", "--checkpoint", str(run))
        assert said in one_line(code, err, "verify")
        code, err = run_cli(capsys, "train", str(TINY), *set_args([*tiny_sets("unused", tmp_path / "new"), *LINGBOT,
                                                                    f'model.pretrained="{root / "policy"}"']))
        assert said in one_line(code, err, "train")
        code, err = run_cli(capsys, "sample", str(run), "--out", str(tmp_path / "s"), *FAST)
        assert code == 0, err  # the weights and the shape come from the checkpoint
    finally:
        weights.write_bytes(intact)


def test_nonfinite_checkpoint_weights_are_named_before_any_step_or_sample(tiny_dataset, tmp_path, capsys,
                                                                          monkeypatch) -> None:
    """A checkpoint written with a NaN weight (as a diverged or damaged run would leave it, its manifest intact):
    resume, sample, sample --ema and export each name the first non-finite tensor and stop."""
    from flexpack.commands.train import train
    from helpers import tiny_config

    real = checkpoint.Checkpointer.save

    def save_with_nan(self, step, model, *a, **k):
        with torch.no_grad():
            model.get_parameter("patch_embed.weight").view(-1)[:2] = float("nan")
            if k.get("ema") is not None:
                k["ema"].state_dict()["blocks.0.ffn.fc1.weight"].view(-1)[0] = float("inf")
        return real(self, step, model, *a, **k)

    cfg = tiny_config(tiny_dataset, tmp_path / "run", *LINGBOT, "schedule.steps=1", "optim.ema_decay=0.5")
    monkeypatch.setattr(checkpoint.Checkpointer, "save", save_with_nan)
    train(cfg)
    monkeypatch.undo()
    found = tmp_path / "run" / "checkpoints" / "step_00000001"
    assert checkpoint.problem(found) is None  # intact as files
    said = f"{found}: weight 'model.patch_embed.weight' holds non-finite values (2 NaN and 0 infinite of "
    runs = {"sample": ["sample", str(tmp_path / "run"), "--out", str(tmp_path / "s"), *FAST],
            "export": ["export", str(tmp_path / "run"), str(tmp_path / "out"), "--allow-unrunnable"],
            "train": ["train", str(found / "config.json"), "--set", "schedule.steps=2"]}
    for command, argv in runs.items():
        code, err = run_cli(capsys, *argv)
        assert said in one_line(code, err, command), err
    assert not (tmp_path / "s").exists() and not (tmp_path / "out").exists()
    assert json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[-1])["step"] == 1  # no step 2
    with pytest.raises(ValueError, match=r"weight 'ema.blocks.0.ffn.fc1.weight' holds non-finite values \(0 NaN and 1 "
                                         r"infinite of [\d,]+ values\); no step or sample can use them"):
        checkpoint.read_ema(found)


def test_a_nan_in_model_pretrained_is_named_not_blamed_on_the_learning_rate(tiny_dataset, tmp_path, capsys) -> None:
    from flexpack.run.pretrained import load_pretrained
    from helpers import tiny_config

    save_policy(tmp_path / "policy")
    key = poison(tmp_path / "policy" / "model.safetensors")
    sets = [*tiny_sets(tiny_dataset, tmp_path / "run", "schedule.steps=2"), *LINGBOT,
            f'model.pretrained="{tmp_path / "policy"}"']
    code, err = run_cli(capsys, "train", str(TINY), *set_args(sets))
    line = one_line(code, err, "train")
    want = (f"model.pretrained = '{tmp_path / 'policy'}': {tmp_path / 'policy' / 'model.safetensors'}: weight "
            f"{key!r} holds non-finite values (1 NaN and 0 infinite of ")
    assert want in line and "the checkpoint itself is damaged" in line and "optim.lr" not in line, line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # no step was taken
    cfg = tiny_config(tiny_dataset, tmp_path / "run", *LINGBOT, f'model.pretrained="{tmp_path / "policy"}"')
    fam, m = config_family(cfg), model_config_of(cfg)
    with torch.device("meta"):
        model = fam.build(m)
    with pytest.raises(ValueError, match=f"weight {key!r} holds non-finite values"):  # the sharded path's loader
        load_pretrained(model, str(tmp_path / "policy"), m, fam, device=torch.device("cpu"), seed=0)
