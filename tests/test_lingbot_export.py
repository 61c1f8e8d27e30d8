"""`flexpack export RUN OUT --format lerobot`: a lingbot-va run as a LeRobot lingbot_va policy folder that LeRobot's
own API loads strictly, with processors holding the run's action statistics; what LeRobot cannot represent, and a
format the family cannot be written in, in one line."""

from __future__ import annotations

import errno
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("lerobot.policies.lingbot_va", reason="the installed lerobot has no lingbot_va policy")

from lerobot.policies.factory import make_pre_post_processors  # noqa: E402
from lerobot.policies.lingbot_va.configuration_lingbot_va import LingBotVAConfig  # noqa: E402
from lerobot.policies.lingbot_va.modeling_lingbot_va import LingBotVAPolicy  # noqa: E402

from flexpack.commands.train import train  # noqa: E402
from flexpack.data import action_stats  # noqa: E402
from flexpack.data.episodes import EpisodeSource  # noqa: E402
from flexpack.data.normalization import ActionStats  # noqa: E402
from flexpack.families.lingbot import export_lerobot  # noqa: E402
from flexpack.families.lingbot.convert import to_lerobot_state_dict  # noqa: E402
from flexpack.run.compose import compose  # noqa: E402
from flexpack.run.model import build_model  # noqa: E402
from flexpack.run.state import checkpoint  # noqa: E402
from helpers import run_cli, tiny_config  # noqa: E402
from lingbot_tiny import save_frozen_modules  # noqa: E402


def exported(cfg):
    """``cfg`` composed as ``flexpack export`` composes a checkpoint's config."""
    return compose(cfg, "export", device=torch.device("cpu"))


LINGBOT = ["model.family=lingbot-va", "model.preset=lingbot-va-tiny"]
CAM = "observation.images.cam0"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def lingbot_run(tiny_dataset, tmp_path_factory):
    """A tiny lingbot-va run (2 steps, EMA kept) on the demo data: (config, run folder)."""
    cfg = tiny_config(tiny_dataset, tmp_path_factory.mktemp("lingbot") / "run", "schedule.steps=2",
                      "schedule.rewarmup_steps=0", "optim.ema_decay=0.5", *LINGBOT)
    train(cfg)
    return cfg, Path(cfg.runtime.out_dir)


def _weights(cfg, ema: bool = False) -> dict[str, torch.Tensor]:
    model = build_model(cfg)
    found = checkpoint.latest(Path(cfg.runtime.out_dir) / "checkpoints")
    checkpoint.load(found, model, restore_rng=False)
    return to_lerobot_state_dict(checkpoint.read_ema(found) if ema else model.state_dict())


def _processors(folder: Path):
    """(preprocessor, postprocessor, the postprocessor's action statistics) as LeRobot's factory loads them."""
    pre, post = make_pre_post_processors(LingBotVAConfig.from_pretrained(folder), pretrained_path=str(folder))
    (step,) = [s for s in post.steps if type(s).__name__ == "UnnormalizerProcessorStep"]
    return pre, post, step.stats["action"]


def test_export_loads_in_lerobot_with_the_runs_statistics(lingbot_run, tmp_path, capsys) -> None:
    """The lingbot-va family's default format is LeRobot's policy folder: LingBotVAPolicy.from_pretrained loads it
    strictly (every tensor, no missing or unexpected key), holding the checkpoint's weights (and under ema/ the EMA
    ones); config.json carries the run's fields; the postprocessor maps [-1, 1] back with the pooled q01 / q99 the
    checkpoint trained with."""
    cfg, run = lingbot_run
    out = tmp_path / "policy"
    code, err = run_cli(capsys, "export", str(run), str(out), "--ema", "--wan-pretrained-path", "/frozen/wan",
                        "--allow-unrunnable")  # trained on the pool / hash stand-ins
    assert code == 0, err
    raw = json.loads((out / "config.json").read_text())
    assert (raw["type"], raw["attn_mode"], raw["device"]) == ("lingbot_va", "torch", None)
    assert raw["used_action_channel_ids"] == list(range(6)) and raw["obs_cam_keys"] == [CAM]
    assert (raw["action_per_frame"], raw["frame_chunk_size"], raw["height"], raw["width"]) == (4, 4, 32, 32)
    assert (raw["num_layers"], raw["num_attention_heads"], raw["text_dim"], raw["wan_pretrained_path"]) == (
        2, 2, 64, "/frozen/wan")
    assert raw["input_features"] == {CAM: {"type": "VISUAL", "shape": [3, 32, 32]}}
    assert raw["output_features"] == {"action": {"type": "ACTION", "shape": [6]}}
    for folder, ema in ((out, False), (out / "ema", True)):
        config = LingBotVAConfig.from_pretrained(folder)
        config.dtype = "float32"
        policy = LingBotVAPolicy.from_pretrained(folder, config=config, strict=True)  # raises on a missing key
        want = _weights(cfg, ema)
        got = policy.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want), folder
    assert not torch.equal(_weights(cfg, True)["transformer.proj_out.weight"],
                           _weights(cfg)["transformer.proj_out.weight"])
    # the statistics: the checkpoint's (its train_state.json), which are the dataset's pooled q01 / q99
    saved = json.loads(next((run / "checkpoints").glob("step_*/train_state.json")).read_text())["extra"]
    src = EpisodeSource(cfg.data.root)
    pooled = action_stats.pooled(src, Path(cfg.data.root) / "latents")["features"]["action"]
    pre, post, stats = _processors(out)
    assert list(stats["q01"]) == pytest.approx(saved["action_normalizer"]["low"], rel=1e-6)
    assert list(stats["q99"]) == pytest.approx(pooled["q99"], rel=1e-6)
    lo, hi = (torch.as_tensor(stats[k], dtype=torch.float32) for k in ("q01", "q99"))
    assert torch.allclose(post(torch.stack([-torch.ones(6), torch.ones(6)])), torch.stack([lo, hi]), atol=1e-6)
    assert [type(s).__name__ for s in pre.steps][:2] == ["RenameObservationsProcessorStep",
                                                         "AddBatchDimensionProcessorStep"]
    assert json.loads((out / "export.json").read_text())["format"] == "lerobot"


def test_formats_the_family_cannot_be_written_in(lingbot_run, tiny_dataset, tmp_path, capsys) -> None:
    """--format picks among the family's formats (its registry entry): a lingbot-va run has no diffusers layout, a
    WanVA run no LeRobot lingbot_va one; options of another format, and a full disk, are one line; nothing is
    written."""
    _, run = lingbot_run
    cases = [(["--format", "diffusers"], "exports as ['lerobot', 'lingbot-upstream'], not --format 'diffusers'"),
             (["--no-policy"], "--no-policy applies to --format diffusers"),
             (["--format", "onnx"], "not --format 'onnx'")]
    for extra, msg in cases:
        code, err = run_cli(capsys, "export", str(run), str(tmp_path / "o"), *extra)
        assert code == 2 and msg in err and err.count("\n") == 1, err
    wan = tiny_config(tiny_dataset, tmp_path / "wan", "schedule.steps=1")
    train(wan)
    for extra, msg in ((["--format", "lerobot"], "exports as ['diffusers'], not --format 'lerobot'"),
                       (["--wan-pretrained-path", "x"], "--wan-pretrained-path applies to --format lerobot"),
                       (["--allow-unrunnable"], "--allow-unrunnable applies to --format lerobot")):
        code, err = run_cli(capsys, "export", str(tmp_path / "wan"), str(tmp_path / "o"), *extra)
        assert code == 2 and msg in err, err
    assert not (tmp_path / "o").exists()


def test_a_full_disk_leaves_nothing(lingbot_run, tmp_path, capsys, monkeypatch) -> None:
    _, run = lingbot_run

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(export_lerobot, "write_policy", full)
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "o"), "--allow-unrunnable")
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert code == 2 and "cannot write the export (No space left on device)" in line, err
    assert not (tmp_path / "o").exists() and not list(tmp_path.glob(".tmp-*"))


def test_flexpack_sample_runs_the_run_and_its_export(lingbot_run, tmp_path, capsys) -> None:
    """`flexpack sample` on the family (LeRobot's two streams with guidance, packed): the run and its LeRobot
    export give the same metrics (metrics.json as WanVA's: the model against the baselines); rollout runs; the
    sampling fields (LeRobot's step counts and guidance) may be set at sample time, --steps is one line."""
    _, run = lingbot_run
    fast = ["--set", "model.overrides.num_inference_steps=3", "--set", "model.overrides.action_num_inference_steps=4"]
    out = tmp_path / "policy"
    assert run_cli(capsys, "export", str(run), str(out), "--allow-unrunnable")[0] == 0
    got = {}
    for name, src, extra in (("run", run, []), ("export", out, []), ("plain", run, ["--set",
                             "model.overrides.guidance_scale=1"]), ("rollout", run, ["--mode", "rollout"])):
        code, err = run_cli(capsys, "sample", str(src), "--horizon", "4", "--plots", "0", "--samples", "1", "--out",
                            str(tmp_path / name), *fast, *extra)
        assert code == 0, err
        got[name] = json.loads((tmp_path / name / "metrics.json").read_text())
    m = got["run"]
    assert {"action_mse", "action_mse_raw", "latent_mse", "baselines", "per_episode", "pair_list"} <= set(m)
    assert set(m["baselines"]) == {"last", "mean"} and m["steps"] == 3 and m["pairs"] == 2 and m["mode"] == "forecast"
    assert m["model_calls"] == 2 * (2 * 3 + 4)  # 2 packs of one pair (60-token packs), video guided, actions not
    assert got["export"]["action_mse"] == pytest.approx(m["action_mse"], rel=1e-6)
    assert got["export"]["latent_mse"] == pytest.approx(m["latent_mse"], rel=1e-6)
    assert got["plain"]["model_calls"] == 2 * (3 + 4) and got["plain"]["latent_mse"] != m["latent_mse"]
    assert got["rollout"]["mode"] == "rollout" and got["rollout"]["pairs"] == 4
    code, err = run_cli(capsys, "sample", str(run), "--steps", "3", "--out", str(tmp_path / "x"))
    assert code == 2 and "samples with its config's solver steps" in err and err.count("\n") == 1, err


def test_an_export_lerobot_cannot_run_is_refused_unless_allowed(lingbot_run, tmp_path, capsys) -> None:
    """The run trained on latents and texts of the pool / hash stand-ins (the cache records its encoders): LeRobot's
    policy encodes frames and prompts with its own Wan2.2 VAE and UMT5, so the export is refused in one line naming
    both encoders and their files, nothing written; --allow-unrunnable writes it, saying why on stderr. A frozen
    VAE or text encoder of another width at --wan-pretrained-path is a reason too."""
    cfg, run = lingbot_run
    latents = Path(cfg.data.root) / "latents"
    latent_file, text_file = latents / "video" / "cam0" / "episode_000000.safetensors", latents / "text" / \
        "task_000000.safetensors"
    why = (f"its latents came from the 'pool' encoder ({latent_file}), which LeRobot's policy cannot run: it encodes "
           "camera frames with the Wan2.2 VAE of wan_pretrained_path (flexpack encode --encoder wan-vae:PATH, then "
           f"train again); its task texts came from the 'hash:64x16' encoder ({text_file}), which LeRobot's policy "
           "cannot run: it encodes prompts with the UMT5 of wan_pretrained_path (flexpack encode --text-encoder "
           "umt5:PATH, then train again)")
    frozen = save_frozen_modules(tmp_path / "wan", text_dim=32)  # a UMT5 of width 32 for a model of text_dim 64
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "o"), "--wan-pretrained-path", str(frozen))
    (line,) = [x for x in err.splitlines() if "error:" in x]
    assert code == 2 and line == (
        "flexpack export: error: --format lerobot: LeRobot's lingbot_va policy could not run this export as it "
        f"trained: {why}; wan_pretrained_path {frozen}/text_encoder/config.json has d_model = 32, but the model's "
        "text_dim = 64 (set --wan-pretrained-path to the VAE and text encoder the run's cache was encoded with); pass "
        "--allow-unrunnable to write it anyway"), err
    assert not (tmp_path / "o").exists()
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "o"), "--allow-unrunnable")
    assert code == 0 and (tmp_path / "o" / "model.safetensors").is_file(), err
    assert f"export: warning: writing a policy LeRobot cannot run as it trained (--allow-unrunnable): {why}\n" in err
    assert "robbyant/lingbot-va-base/{vae,text_encoder}/config.json not readable here" in err  # offline, not cached


@pytest.mark.parametrize("sets, msg", [
    (["objective.num_train_timesteps=500"], "num_train_timesteps = 500, but LeRobot's lingbot_va policy needs 1000"),
    (["data.stride=8"], "data.stride = 8 video frames"),
    (["data.normalize=false"], "data.normalize = false"),
    (["model.overrides.in_channels=16"], "in_channels = 16, but LeRobot's lingbot_va policy needs 48"),
])
def test_configs_lerobot_cannot_represent(tiny_dataset, tmp_path, sets, msg) -> None:
    cfg = tiny_config(tiny_dataset, tmp_path, *LINGBOT, *sets)
    with pytest.raises(ValueError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        export_lerobot.check_config(exported(cfg))


def test_fields_cameras_and_statistics_lerobot_has_no_place_for(tiny_dataset, tmp_path, monkeypatch) -> None:
    cfg = tiny_config(tiny_dataset, tmp_path, *LINGBOT)
    export_lerobot.check_config(exported(cfg))  # the tiny run itself is representable
    norm = ActionStats(mode="quantile", low=(0.0,) * 6, high=(1.0,) * 6)
    assert export_lerobot.policy_layout(exported(cfg), norm)["obs_cam_keys"] == [CAM]
    with pytest.raises(ValueError, match="with 'meanstd' statistics"):
        export_lerobot.policy_layout(exported(cfg), replace(norm, mode="meanstd"))
    with pytest.raises(ValueError, match=r"statistics cover 5 columns, but used_action_channel_ids = \[0, 1, 2, 3, "
                                         r"4, 5\] places 6: the actions do not map"):
        export_lerobot.policy_layout(exported(cfg), replace(norm, low=(0.0,) * 5, high=(1.0,) * 5))
    other = tiny_config(tiny_dataset, tmp_path, *LINGBOT, 'model.overrides.obs_cam_keys=["observation.images.top"]')
    with pytest.raises(ValueError, match="'observation.images.top' is not in the dataset"):
        export_lerobot.policy_layout(exported(other), norm)
    monkeypatch.setattr(export_lerobot, "TRAINING_ONLY", ("chunk_range", "window_range", "attn_backend",
                                                          "activation_checkpointing"))
    with pytest.raises(ValueError, match="LeRobot's lingbot_va config has no field 'noisy_cond_prob'"):
        export_lerobot.check_config(exported(cfg))


def test_lerobot_runs_the_export_end_to_end(lingbot_run, tmp_path, capsys) -> None:
    """LeRobot's own factory loads the export (make_policy over the dataset's metadata, make_pre_post_processors)
    with frozen modules from a local wan_pretrained_path, and select_action on fake observations (the dataset's
    camera size, its task) gives finite actions of the dataset's action shape, unnormalized by the postprocessor
    with the run's q01 / q99: the first chunk from one observation, the next after its observations and actions
    went back into the KV cache (its streaming VAE and UMT5 included)."""
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.datasets.lerobot_dataset import LeRobotDatasetMetadata
    from lerobot.policies.factory import make_policy

    cfg, run = lingbot_run
    frozen = save_frozen_modules(tmp_path / "wan", text_dim=64)
    out = tmp_path / "policy"
    code, err = run_cli(capsys, "export", str(run), str(out), "--wan-pretrained-path", str(frozen),
                        "--allow-unrunnable")  # trained on the pool / hash stand-ins
    assert code == 0, err
    config = PreTrainedConfig.from_pretrained(out)
    config.pretrained_path, config.dtype, config.device = out, "float32", "cpu"
    meta = LeRobotDatasetMetadata("local/tiny", root=cfg.data.root)
    policy = make_policy(config, ds_meta=meta)
    pre, post = make_pre_post_processors(config, pretrained_path=str(out),
                                         preprocessor_overrides={"device_processor": {"device": "cpu"}})
    *_, stats = _processors(out)
    lo, hi = (torch.as_tensor(stats[k], dtype=torch.float32) for k in ("q01", "q99"))
    g = torch.Generator().manual_seed(0)
    chunk = (config.frame_chunk_size - 1) * config.action_per_frame  # the first chunk drops its given frame
    policy.reset()
    actions = []
    for _ in range(chunk + 2):  # the whole first chunk, then the first actions of the next
        obs = {CAM: torch.rand(3, 32, 32, generator=g), "task": "pick up the red cube"}
        raw = policy.select_action(pre(obs))
        actions.append((raw, post(raw)))
    for raw, act in actions:
        assert raw.shape == act.shape == (1, 6) and torch.isfinite(act).all()
        assert torch.allclose(act, (raw + 1) / 2 * (hi - lo) + lo, atol=1e-5)  # QUANTILES, the run's statistics
    assert policy._frame_st_id == config.frame_chunk_size  # the observed chunk went back into the cache
    assert not torch.allclose(actions[0][0], actions[chunk][0])  # a new chunk
