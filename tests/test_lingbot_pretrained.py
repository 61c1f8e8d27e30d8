"""model.pretrained for the lingbot-va family: a policy folder saved by LeRobot's own API (config.json +
model.safetensors with transformer.* keys) or an upstream diffusers-style transformer/ folder -> fine-tune,
resume, in one process and through the streaming loader of the sharded path; bad checkpoints in one line."""

from __future__ import annotations

import json
import re

import pytest
import torch

pytest.importorskip("lerobot.policies.lingbot_va", reason="the installed lerobot has no lingbot_va policy")

from lerobot.policies.lingbot_va.modeling_lingbot_va import LingBotVAPolicy  # noqa: E402

from flexpack.commands.train import train  # noqa: E402
from flexpack.families.lingbot.convert import to_lerobot_state_dict  # noqa: E402
from flexpack.run.config import save_config  # noqa: E402
from flexpack.run.model import build_model  # noqa: E402
from flexpack.run.pretrained import load_pretrained  # noqa: E402
from flexpack.run.resolve import config_family, model_config_of  # noqa: E402
from helpers import TINY, run_cli, set_args, tiny_config, tiny_sets, torchrun_worker  # noqa: E402
from lingbot_tiny import save_policy  # noqa: E402

LINGBOT = ["model.family=lingbot-va", "model.preset=lingbot-va-tiny"]
pytestmark = pytest.mark.usefixtures("one_thread")


def assert_holds(model: torch.nn.Module, policy: LingBotVAPolicy) -> None:
    want = policy.state_dict()
    got = to_lerobot_state_dict(model.state_dict())
    assert got.keys() == want.keys()
    for k, v in want.items():
        assert torch.equal(got[k], v.float()), k


def test_fine_tune_and_resume_from_a_lerobot_policy(tiny_dataset, tmp_path, capsys) -> None:
    """The policy folder gives the model's weights (strict, every tensor) and its training fields (noise shift,
    cameras); `flexpack train` fine-tunes from it, and a stopped run resumes to the uninterrupted run's losses."""
    policy = save_policy(tmp_path / "policy")
    sets = [*tiny_sets(tiny_dataset, tmp_path / "a", "schedule.steps=3", "schedule.rewarmup_steps=0",
                       "objective.shift=5.0"), *LINGBOT, f'model.pretrained="{tmp_path / "policy"}"']
    cfg = tiny_config(tiny_dataset, tmp_path / "b", *sets[len(tiny_sets("", "")):])
    m = model_config_of(cfg)
    assert (m.snr_shift, m.obs_cam_keys, m.used_action_channel_ids) == (4.0, ("observation.images.cam0",),
                                                                        tuple(range(6)))
    assert_holds(build_model(cfg), policy)
    code, err = run_cli(capsys, "train", str(TINY), *set_args(sets), keep_stdout=True)
    assert code == 0, err
    # the start line names the weights, their shape and the tensors matched: every one of LeRobot's
    out = capsys.readouterr().out
    n = len(policy.state_dict())
    assert (f"model.pretrained: {tmp_path / 'policy'} (1 safetensors file, shape from "
            f"{tmp_path / 'policy' / 'config.json'}): dim 64 (2 heads x 32), 2 layers, ffn 128, 48 latent channels, "
            f"text 64; ") in out
    assert f"; {n} tensors matched the model by name and shape and were loaded, all {n} of the model's tensors " \
           "came from it\n" in out
    full = [json.loads(x)["loss"] for x in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    first = train(cfg, stop_after=1)
    capsys.readouterr()
    second = train(cfg)
    assert "model.pretrained:" not in capsys.readouterr().out  # a resume starts from its checkpoint, not from these
    assert (second.start_step, second.step) == (1, 3)
    assert first.losses + second.losses == pytest.approx(full, rel=1e-5)


def test_upstream_transformer_folder_and_the_streaming_loader(tmp_path) -> None:
    """An upstream checkpoint folder (transformer/ with diffusers' config.json and weights) loads as the
    policy does; the sharded path's streaming loader (tensor by tensor through the family's convert_tensor
    into a model built on the meta device) fills the same weights."""
    policy = save_policy(tmp_path / "policy", seed=1)
    policy.transformer.save_pretrained(tmp_path / "upstream" / "transformer", max_shard_size="60KB")
    assert (tmp_path / "upstream" / "transformer" / "diffusion_pytorch_model.safetensors.index.json").exists()
    for path in (tmp_path / "upstream", tmp_path / "policy"):
        cfg = tiny_config("unused", "unused", *LINGBOT, f'model.pretrained="{path}"')
        assert_holds(build_model(cfg), policy)
        fam, m = config_family(cfg), model_config_of(cfg)
        with torch.device("meta"):
            model = fam.build(m)
        load_pretrained(model, str(path), m, fam, device=torch.device("cpu"), seed=0)
        assert_holds(model, policy)


@pytest.mark.parametrize("change,message", [
    ("type", r"not a checkpoint config of the lingbot-va family: .*a LeRobot policy of type 'pi0', not 'lingbot_va'"),
    ("width", r"model.overrides.num_attention_heads=4 but .*config.json has num_attention_heads=2"),
    ("tensors", r"model.safetensors: tensor '[\w.]+' has shape \([\d, ]+\), the config needs \([\d, ]+\) "
                r"\(a checkpoint of another width\?\)"),
    ("layout", r"camera_layout 'robotwin_tshape'; flexpack's latent cache joins cameras on width"),
    ("cameras", r"camera \['observation.images.image'\] of obs_cam_keys = \['observation.images.image'\] \(from "
                r"model.pretrained's config.json, .*/policy/config.json\) is not in the dataset, whose cameras are "
                r"\['observation.images.cam0'\]"),
    ("columns", r"'action' has 6 columns, but used_action_channel_ids = \[0, 1, 2, 3, 4, 5, 6\] \(from "
                r"model.pretrained's config.json, .*/policy/config.json\) places 7: channel\(s\) \[6\] would have no "
                r"column; set model.overrides.action_channels = 6"),
])
def test_bad_checkpoints_are_one_line_and_exit_2(tiny_dataset, tmp_path, capsys, change, message) -> None:
    policy = tmp_path / "policy"
    extra = []
    if change == "cameras":
        save_policy(policy, obs_cam_keys=["observation.images.image"])
    else:
        save_policy(policy)
    cfg_file = policy / "config.json"
    raw = json.loads(cfg_file.read_text())
    if change == "type":
        raw["type"] = "pi0"
    elif change == "layout":
        raw["camera_layout"] = "robotwin_tshape"
    elif change == "width":
        extra = ["model.overrides.num_heads=4"]
    elif change == "columns":  # the checkpoint's 7 channels (the tiny config's action_channels = 6 replaced)
        raw["used_action_channel_ids"] = list(range(7))
        extra = ["model.overrides={in_channels=48, text_dim=64, attn_backend='dense'}"]
    elif change == "tensors":  # a config.json of another width than its weights
        raw["num_attention_heads"] = 1
    cfg_file.write_text(json.dumps(raw))
    sets = [*tiny_sets(tiny_dataset, tmp_path / "run", "schedule.steps=1"), *LINGBOT, f'model.pretrained="{policy}"',
            *extra]
    code, err = run_cli(capsys, "train", str(TINY), *set_args(sets))
    assert code == 2, err
    line = err.strip().splitlines()[-1]
    assert line.startswith("flexpack train: error: ") and len(err.strip().splitlines()) == 1, err
    assert re.search(message, line), line


@pytest.mark.slow  # two torchrun ranks: ~20 s
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_fsdp2_start_from_a_lerobot_policy(tiny_dataset, tmp_path) -> None:
    """Under FSDP2 (2 CPU ranks over gloo) each rank streams its shards of the policy's tensors; the sharded
    start equals the single-process one and training takes its steps (the frozen text projection of the
    action embedder shares an FSDP group with trained tensors)."""
    save_policy(tmp_path / "policy", seed=2)
    cfg = tiny_config(tiny_dataset, tmp_path / "run", *LINGBOT, f'model.pretrained="{tmp_path / "policy"}"',
                      "schedule.steps=2", "checkpoint.every=1")
    save_config(cfg, tmp_path / "cfg.json")
    torchrun_worker("dist_pretrained_worker.py", tmp_path / "cfg.json", tmp_path, cwd=tmp_path)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert r0["param_types"] == ["DTensor"] and r0["steps"] == 2
    single = build_model(cfg).state_dict()
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert set(loaded) == set(single)
    for name, value in single.items():
        assert torch.equal(loaded[name], value), name


def test_the_recorded_model_gives_the_shape_without_model_pretrained(tmp_path) -> None:
    """A checkpoint's record (train_state.json extra.model_config) and an export's config.json give the model
    config sample builds: the record's shape fields and checkpoint defaults over the preset, model.overrides
    winning, model.pretrained cleared and not read; a checkpoint without a record has none."""
    from flexpack.run.state.trained import MODEL_KEY, model_record, pinned, recorded_model

    ckpt = tmp_path / "run" / "checkpoints" / "step_00000002"
    ckpt.mkdir(parents=True)
    (ckpt / "train_state.json").write_text(json.dumps({"step": 2, "extra": {}}))
    assert recorded_model(tmp_path / "run") is None and recorded_model(ckpt) is None
    cfg = tiny_config("unused", "unused", *LINGBOT, "model.overrides.num_inference_steps=3")
    width = model_record(model_config_of(cfg)) | {"attention_head_dim": 24, "num_layers": 1, "ffn_dim": 96,
                                                  "num_inference_steps": 9, "chunk_range": [2, 2]}
    (ckpt / "train_state.json").write_text(json.dumps({"step": 2, "extra": {MODEL_KEY: width}}))
    record = recorded_model(ckpt)
    assert record.where == ckpt / "train_state.json" and record.fields == width
    m = model_config_of(pinned(cfg, record))
    assert (m.attention_head_dim, m.dim, m.num_layers, m.ffn_dim) == (24, 48, 1, 96)  # the preset's: 32, 64, 2, 128
    assert m.num_inference_steps == 3  # model.overrides wins over the record
    assert m.chunk_range == (1, 4)  # neither a shape field nor a checkpoint default: the config's own
    assert pinned(cfg, record).model.pretrained == "" and pinned(cfg, None) is cfg
    ours = tiny_config("unused", "unused", *LINGBOT, "model.overrides.ffn_dim=64")
    assert model_config_of(pinned(ours, record)).ffn_dim == 64  # a set shape field stays (sample's check names it)
    # an export of the family's format: its config.json, read as model.pretrained's would be
    policy = tmp_path / "export"
    save_policy(policy, attention_head_dim=24, num_layers=1, guidance_scale=2.5)
    (policy / "flexpack_config.json").write_text(json.dumps({"model": {"family": "lingbot-va"}}))
    record = recorded_model(policy)
    assert record.where == policy / "config.json" and record.fields["attention_head_dim"] == 24
    assert record.fields["obs_cam_keys"] == ["observation.images.cam0"] and "chunk_range" not in record.fields
    m = model_config_of(pinned(cfg, record))
    assert (m.dim, m.num_layers, m.guidance_scale) == (48, 1, 2.5)  # the policy's guidance: a checkpoint default
    (policy / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"export/config.json: not readable as JSON"):
        recorded_model(policy)


def test_sample_a_run_fine_tuned_from_a_policy_of_another_width(tiny_dataset, tmp_path, capsys) -> None:
    """A run fine-tuned from a LeRobot policy 48 wide (the lingbot-va-tiny preset: 64) samples, and so does its
    export, in the policy's shape, after the policy folder has moved away: the weights are the checkpoint's, the
    run and the export give the same numbers; a --set of a shape field is still refused as another model."""
    from flexpack.commands.sample import load_trained, load_weights
    from flexpack.run.compose import compose
    from flexpack.run.state import checkpoint

    save_policy(tmp_path / "policy", attention_head_dim=24)
    run = tmp_path / "run"
    sets = [*tiny_sets(tiny_dataset, run, "schedule.steps=2"), *LINGBOT, f'model.pretrained="{tmp_path / "policy"}"']
    code, err = run_cli(capsys, "train", str(TINY), *set_args(sets))
    assert code == 0, err
    assert run_cli(capsys, "export", str(run), str(tmp_path / "export"), "--allow-unrunnable")[0] == 0
    (tmp_path / "policy").rename(tmp_path / "moved")  # the run and the export must not need it
    fast = ["--horizon", "4", "--plots", "0", "--samples", "1", "--set", "model.overrides.num_inference_steps=2",
            "--set", "model.overrides.action_num_inference_steps=2"]
    trained = checkpoint.read_tensors(checkpoint.latest(run / "checkpoints"))
    got = {}
    for name in ("run", "export"):
        code, err = run_cli(capsys, "sample", str(tmp_path / name), "--out", str(tmp_path / f"s-{name}"), *fast)
        assert code == 0, err
        got[name] = json.loads((tmp_path / f"s-{name}" / "metrics.json").read_text())
        model_run = compose(load_trained(tmp_path / name, (), tmp_path / name), "export")  # the model alone: no data
        model, _, _ = load_weights(model_run, tmp_path / name)
        assert (model.family_config.attention_head_dim, model.config.dim) == (24, 48)
        assert all(torch.equal(v, trained[k]) for k, v in model.state_dict().items()), name
    assert got["run"]["pairs"] == 2 and got["export"]["action_mse"] == pytest.approx(got["run"]["action_mse"], rel=1e-6)
    assert got["export"]["latent_mse"] == pytest.approx(got["run"]["latent_mse"], rel=1e-6)
    code, err = run_cli(capsys, "sample", str(run), "--set", "model.overrides.attention_head_dim=32", *fast)
    assert code == 2 and "model.attention_head_dim = 32, trained 24" in err and err.count("\n") == 1, err


def test_a_resume_of_another_model_is_refused_before_any_weights_load(tiny_dataset, tmp_path, capsys,
                                                                       monkeypatch) -> None:
    """Resuming a run fine-tuned from a policy with another preset, another model.pretrained shape or another
    family is one line naming the key, the checkpoint's value and the new one; no weights are read for it and
    the run folder is left as it was. The same config resumes."""
    from flexpack.run import pretrained

    save_policy(tmp_path / "policy", attention_head_dim=24)
    save_policy(tmp_path / "wider")  # the preset's width: 2 heads of 32
    run = tmp_path / "run"
    sets = [*tiny_sets(tiny_dataset, run, "schedule.steps=1"), *LINGBOT, f'model.pretrained="{tmp_path / "policy"}"']
    assert run_cli(capsys, "train", str(TINY), *set_args(sets))[0] == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}

    def no_weights(*a, **k):
        raise AssertionError("weights were loaded")

    monkeypatch.setattr(pretrained, "load_single", no_weights)
    ckpt = run / "checkpoints" / "step_00000001"
    for extra, named in (
            (["model.preset=lingbot-va-5b"], "model.preset is 'lingbot-va-tiny' there and 'lingbot-va-5b' now"),
            ([f'model.pretrained="{tmp_path / "wider"}"'],
             "model.attention_head_dim is 24 there and 32 now (model.pretrained)"),
            (["model.family=wanva", "model.preset=small", 'model.pretrained=""'],
             "model.family is 'lingbot-va' there and 'wanva' now; model.preset is 'lingbot-va-tiny' there and "
             "'small' now")):
        code, err = run_cli(capsys, "train", str(TINY), *set_args([*sets, "schedule.steps=2", *extra]))
        assert code == 2 and err.count("\n") == 1, err
        assert err.startswith(f"flexpack train: error: cannot resume from {ckpt}: its model has another shape or "
                              f"family ({named}); its weights are of its own model"), err
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    monkeypatch.undo()
    code, err = run_cli(capsys, "train", str(TINY), *set_args([*sets, "schedule.steps=2"]))
    assert code == 0 and json.loads((run / "checkpoints" / "step_00000002" / "train_state.json").read_text())[
        "step"] == 2, err
