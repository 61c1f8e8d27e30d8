"""`flexpack export --format lerobot` of a run on a lingbot-bundle: a LeRobot lingbot_va policy folder whose cameras,
composition (robotwin_tshape / width_concat), frames and action steps come from the bundle, with its q01 / q99 in the
source columns, loaded strictly by LeRobot's own API and run by it; what LeRobot cannot represent, and datasets
whose cameras differ, in one line; model.pretrained from a robotwin_tshape checkpoint on a bundle composing a T."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("lerobot.policies.lingbot_va", reason="the installed lerobot has no lingbot_va policy")

from lerobot.configs.policies import PreTrainedConfig  # noqa: E402
from lerobot.policies.factory import make_policy, make_pre_post_processors  # noqa: E402
from lerobot.policies.lingbot_va.configuration_lingbot_va import LingBotVAConfig  # noqa: E402
from lerobot.policies.lingbot_va.modeling_lingbot_va import LingBotVAPolicy  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from flexpack.commands.train import train  # noqa: E402
from flexpack.data.bundle import BundleDataset  # noqa: E402
from flexpack.families.lingbot import export_lerobot  # noqa: E402
from flexpack.families.lingbot.convert import to_lerobot_state_dict  # noqa: E402
from flexpack.run.build import open_dataset  # noqa: E402
from flexpack.run.compose import compose  # noqa: E402
from flexpack.run.model import build_model  # noqa: E402
from flexpack.run.resolve import model_config_of  # noqa: E402
from flexpack.run.state import checkpoint  # noqa: E402
from helpers import BUNDLE_CAMS, LINGBOT_TINY, bundle_run, run_cli, sample_run_and_export, tiny_config  # noqa: E402
from test_lingbot_export import save_frozen_modules  # noqa: E402


def exported(cfg):
    """``cfg`` composed as ``flexpack export`` composes a checkpoint's config."""
    return compose(cfg, "export", device=torch.device("cpu"))


pytestmark = pytest.mark.usefixtures("one_thread")
MAIN, LEFT, RIGHT = BUNDLE_CAMS
USED = list(range(6))


@pytest.fixture(scope="module")
def tshape_run(tmp_path_factory):
    """A 2-step lingbot-va-tiny run (EMA kept) on a two-dataset bundle composed as a T: (config, run folder)."""
    base = tmp_path_factory.mktemp("tshape")
    cfg = bundle_run(base / "bundle", base / "run", "optim.ema_decay=0.5")
    return cfg, Path(cfg.runtime.out_dir)


def _weights(run: Path, cfg, ema: bool = False) -> dict[str, torch.Tensor]:
    model = build_model(cfg)
    found = checkpoint.latest(run / "checkpoints")
    checkpoint.load(found, model, restore_rng=False)
    return to_lerobot_state_dict(checkpoint.read_ema(found) if ema else model.state_dict())


def _saved_normalizer(run: Path) -> dict:
    return json.loads(next((run / "checkpoints").glob("step_*/train_state.json")).read_text())["extra"][
        "action_normalizer"]


def _action_stats(folder: Path) -> dict[str, torch.Tensor]:
    _, post = make_pre_post_processors(LingBotVAConfig.from_pretrained(folder), pretrained_path=str(folder))
    (step,) = [s for s in post.steps if type(s).__name__ == "UnnormalizerProcessorStep"]
    return {k: torch.as_tensor(v, dtype=torch.float32) for k, v in step.stats["action"].items()}


def test_a_tshape_bundle_exports_as_robotwin_tshape(tshape_run, tmp_path, capsys) -> None:
    """The run's cameras in its order, composed as LeRobot's robotwin_tshape, frames from the datasets' info.json
    ([C, H, W] there), height / width the main camera's latents x 16; LingBotVAPolicy.from_pretrained loads the policy
    and its EMA strictly with the checkpoint's weights; the processors hold the checkpoint's 30-d q01 / q99 taken at
    used_action_channel_ids; normalization.json keeps the model-space values flexpack sample checks."""
    cfg, run = tshape_run
    out = tmp_path / "policy"
    code, err = run_cli(capsys, "export", str(run), str(out), "--ema")
    assert code == 0, err
    raw = json.loads((out / "config.json").read_text())
    assert raw["obs_cam_keys"] == [MAIN, LEFT, RIGHT] and raw["camera_layout"] == "robotwin_tshape"
    assert (raw["height"], raw["width"], raw["action_per_frame"], raw["used_action_channel_ids"]) == (64, 64, 4, USED)
    assert raw["input_features"] == {MAIN: {"type": "VISUAL", "shape": [3, 64, 64]},
                                     LEFT: {"type": "VISUAL", "shape": [3, 32, 32]},
                                     RIGHT: {"type": "VISUAL", "shape": [3, 32, 32]}}
    assert raw["output_features"] == {"action": {"type": "ACTION", "shape": [6]}}
    for folder, ema in ((out, False), (out / "ema", True)):
        config = LingBotVAConfig.from_pretrained(folder)
        config.dtype = "float32"
        policy = LingBotVAPolicy.from_pretrained(folder, config=config, strict=True)
        want, got = _weights(run, cfg, ema), policy.state_dict()
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), folder
        # LeRobot composes its cameras into the grid the run trained on (BundleDataset: wrists over the main camera)
        ds = BundleDataset(cfg.data.root, cameras=[MAIN, LEFT, RIGHT], cfg_prob=0.0)
        assert policy._latent_hw == ds.grid(ds.items[0]) == (6, 4)
    saved = _saved_normalizer(run)
    assert len(saved["low"]) == 30
    stats = _action_stats(out)
    assert stats["q01"].tolist() == pytest.approx([saved["low"][c] for c in USED], rel=1e-6)
    assert stats["q99"].tolist() == pytest.approx([saved["high"][c] for c in USED], rel=1e-6)
    norm = json.loads((out / "normalization.json").read_text())
    assert (norm["low"], norm["high"], norm["space"], norm["channels"]) == (saved["low"], saved["high"], "model", USED)
    assert norm["column_low"] == pytest.approx(stats["q01"].tolist(), rel=1e-6)


def test_lerobot_runs_the_tshape_export(tshape_run, tmp_path, capsys) -> None:
    """LeRobot's factory (make_policy over the dataset's features, a stand-in for the v2.1 metadata lerobot 0.6 no
    longer opens; make_pre_post_processors) runs the export with frozen modules: select_action on the three cameras
    at their own sizes gives finite actions of the dataset's 6 columns, unnormalized with the run's q01 / q99."""
    cfg, run = tshape_run
    frozen = save_frozen_modules(tmp_path / "wan", text_dim=64)
    out = tmp_path / "policy"
    assert run_cli(capsys, "export", str(run), str(out), "--wan-pretrained-path", str(frozen))[0] == 0
    config = PreTrainedConfig.from_pretrained(out)
    config.pretrained_path, config.dtype, config.device = out, "float32", "cpu"
    info = json.loads((Path(cfg.data.root) / "robotwin/a/meta/info.json").read_text())
    policy = make_policy(config, ds_meta=SimpleNamespace(features=info["features"]))
    pre, post = make_pre_post_processors(config, pretrained_path=str(out),
                                         preprocessor_overrides={"device_processor": {"device": "cpu"}})
    lo, hi = (_action_stats(out)[k] for k in ("q01", "q99"))
    g = torch.Generator().manual_seed(0)
    policy.reset()
    chunk = (config.frame_chunk_size - 1) * config.action_per_frame
    for _ in range(chunk + 1):
        obs = {MAIN: torch.rand(3, 64, 64, generator=g), LEFT: torch.rand(3, 32, 32, generator=g),
               RIGHT: torch.rand(3, 32, 32, generator=g), "task": "pick up the red cube"}
        raw = policy.select_action(pre(obs))
        act = post(raw)
        assert raw.shape == act.shape == (1, 6) and torch.isfinite(act).all()
        assert torch.allclose(act, (raw + 1) / 2 * (hi - lo) + lo, atol=1e-5)
    assert policy._frame_st_id == config.frame_chunk_size  # the observed T-shaped chunk went into the cache


def test_sample_gives_the_run_and_its_bundle_export_the_same_numbers(tshape_run, tmp_path, capsys) -> None:
    _, run = tshape_run
    out = tmp_path / "policy"
    assert run_cli(capsys, "export", str(run), str(out))[0] == 0
    got = sample_run_and_export(capsys, run, out, tmp_path)
    assert got["export"]["action_mse"] == pytest.approx(got["run"]["action_mse"], rel=1e-6)
    assert got["export"]["latent_mse"] == pytest.approx(got["run"]["latent_mse"], rel=1e-6)


def test_a_video_stride_of_two_is_eight_actions_a_frame(tmp_path, capsys) -> None:
    """frame_ids 2 apart make 8 action steps a latent frame: LeRobot represents it as action_per_frame = 8 (a keyframe
    every 2 actions: its observation_delta_indices step by 2); cameras of one grid export as width_concat. Exported with
    action_per_frame = 4 instead (--set), the latents' stride does not match: one line, nothing written."""
    cams = {MAIN: (2, 2), LEFT: (2, 2)}
    cfg = bundle_run(tmp_path / "bundle", tmp_path / "run", "model.overrides.action_per_frame=8",
                     "data.action_steps=8", "data.stride=8", cameras=cams, stride=2)
    out = tmp_path / "policy"
    code, err = run_cli(capsys, "export", cfg.runtime.out_dir, str(out))
    assert code == 0, err
    config = LingBotVAConfig.from_pretrained(out)
    assert (config.camera_layout, config.obs_cam_keys, config.action_per_frame) == ("width_concat", [MAIN, LEFT], 8)
    assert (config.height, config.width) == (32, 32)
    assert config.observation_delta_indices == list(range(0, config.frame_chunk_size * 4 * 2, 2))
    config.dtype = "float32"
    LingBotVAPolicy.from_pretrained(out, config=config, strict=True)
    code, err = run_cli(capsys, "export", cfg.runtime.out_dir, str(tmp_path / "o"), "--set",
                        "model.overrides.action_per_frame=4", "--set", "data.action_steps=4", "--set", "data.stride=4")
    assert code == 2 and err.count("\n") == 1 and "export: checkpoint" not in err, err  # before any weight is read
    assert ("robotwin/a's latents encode video frames 2 apart (frame_ids stride 2: 8 action steps a latent frame), "
            "but action_per_frame = 4") in err
    assert not (tmp_path / "o").exists()


def test_action_steps_lerobot_cannot_run(tshape_run, tmp_path) -> None:
    cfg = tiny_config(tshape_run[0].data.root, tmp_path, *LINGBOT_TINY, "model.overrides.action_per_frame=6",
                      "data.action_steps=6", "data.stride=6")
    with pytest.raises(ValueError, match=r"action_per_frame = 6, but LeRobot's lingbot_va policy encodes 4 keyframes "
                                         r"per latent frame.*must be a multiple of 4"):
        export_lerobot.check_config(exported(cfg))
    export_lerobot.check_config(exported(tshape_run[0]))  # data.stride is a latent cache's: a bundle's frame_ids decide


def test_datasets_whose_cameras_differ_need_dataset(tshape_run, tmp_path, capsys) -> None:
    """A bundle whose datasets' frames differ (robotwin/b's main camera 480x640, [H, W, C] with names): one line
    naming both and --dataset; --dataset picks one (its frames, the same latents); a name not in the bundle is one
    line."""
    cfg, run = tshape_run
    copy = tmp_path / "bundle"
    shutil.copytree(cfg.data.root, copy)
    info_file = copy / "robotwin/b/meta/info.json"
    info = json.loads(info_file.read_text())
    info["features"][MAIN].update(shape=[480, 640, 3], names=["height", "width", "channels"])
    info_file.write_text(json.dumps(info))
    root = ["--set", f'data.root="{copy}"']
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "o"), *root)
    assert code == 2 and err.count("\n") == 1, err
    assert "the bundle's datasets differ in their cameras (robotwin/a: " in err and "robotwin/b: " in err
    assert "pick the dataset the export describes with --dataset NAME (one of ['robotwin/a', 'robotwin/b'])" in err
    for name, shape in (("robotwin/b", [3, 480, 640]), ("robotwin/a", [3, 64, 64])):
        out = tmp_path / name.replace("/", "_")
        code, err = run_cli(capsys, "export", str(run), str(out), *root, "--dataset", name)
        assert code == 0, err
        raw = json.loads((out / "config.json").read_text())
        assert raw["input_features"][MAIN]["shape"] == shape and (raw["height"], raw["width"]) == (64, 64)
        assert ("the policy resizes them to 64x64" in err) == (name == "robotwin/b")
    code, err = run_cli(capsys, "export", str(run), str(tmp_path / "o"), "--dataset", "robotwin/c")
    assert code == 2 and "--dataset 'robotwin/c': not a dataset of the bundle" in err and err.count("\n") == 1, err


def test_pretrained_robotwin_tshape_trains_on_a_bundle_composing_a_t(tshape_run, tmp_path, capsys) -> None:
    """The LeRobot export of a T-composed bundle run (camera_layout robotwin_tshape) starts a run on that bundle
    (its weights, its cameras); on a latent cache it is refused, and a width_concat checkpoint is refused on the
    bundle: one line naming both layouts."""
    cfg, run = tshape_run
    policy = tmp_path / "policy"
    assert run_cli(capsys, "export", str(run), str(policy))[0] == 0
    again = tiny_config(cfg.data.root, tmp_path / "again", *LINGBOT_TINY, "data.max_tokens=800", "schedule.steps=1",
                        f'model.pretrained="{policy}"')
    assert model_config_of(again).obs_cam_keys == (MAIN, LEFT, RIGHT)
    model = build_model(again)
    want = load_file(policy / "model.safetensors")
    got = to_lerobot_state_dict(model.state_dict())
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    ds = open_dataset(again)
    assert {it.layout for it in ds.items} == {"tshape"}
    assert train(again).step == 1  # `flexpack train` from it: config, data and weights accepted
    raw = json.loads((policy / "config.json").read_text())
    (policy / "config.json").write_text(json.dumps({**raw, "camera_layout": "width_concat"}))
    with pytest.raises(ValueError, match=r"config.json: camera_layout 'width_concat' \(cameras composed as "
                                         r"'width_concat'\), but the bundle .* composes them as 'tshape'"):
        open_dataset(again)


def test_pretrained_robotwin_tshape_is_refused_on_a_latent_cache(tshape_run, tiny_dataset, tmp_path,
                                                                 capsys) -> None:
    _, run = tshape_run
    policy = tmp_path / "policy"
    assert run_cli(capsys, "export", str(run), str(policy))[0] == 0
    cfg = tiny_config(tiny_dataset, tmp_path / "v3", *LINGBOT_TINY, f'model.pretrained="{policy}"',
                      'model.overrides.obs_cam_keys=["observation.images.cam0"]')
    with pytest.raises(ValueError, match=r"camera_layout 'robotwin_tshape'; flexpack's latent cache joins cameras on "
                                         r"width \('width_concat'\) only"):
        open_dataset(cfg)
