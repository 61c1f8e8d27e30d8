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

from flexpack.models.lingbot_convert import to_lerobot_state_dict  # noqa: E402
from flexpack.run.config import save_config  # noqa: E402
from flexpack.run.model import build_model  # noqa: E402
from flexpack.run.pretrained import load_pretrained  # noqa: E402
from flexpack.training.loop import train  # noqa: E402
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
    m = cfg.model.resolved()
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
        fam, m = cfg.model.model_family(), cfg.model.resolved()
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
