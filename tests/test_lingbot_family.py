"""The lingbot-va registry entry: the training config's keys mapped onto the family (or refused in one line),
its geometry, and the data conventions of LeRobot's policy in the dataset and collate path."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flexpack.models.registry import families
from flexpack.run.build import open_dataset
from flexpack.run.compose import run_for
from flexpack.run.config import load_config
from flexpack.run.resolve import model_config_of
from flexpack.run.root import geometry_for
from helpers import TINY, tiny_sets

LINGBOT = ["model.family=lingbot-va", "model.preset=lingbot-va-tiny"]


def cfg(*extra: str, root: str = "unused"):
    return load_config(TINY, [*tiny_sets(root, "unused"), *LINGBOT, *extra])


def test_tiny_cpu_config_maps_onto_the_family() -> None:
    """configs/tiny_cpu.toml as it stands: its overrides become LingbotConfig fields, objective.shift the
    video noise shift, the mask the family's; the WanVA defaults are untouched."""
    assert "lingbot-va" in families()
    c = cfg()
    m = model_config_of(c)
    assert type(m).__name__ == "LingbotConfig"
    assert (m.in_channels, m.text_dim, m.attn_backend) == (48, 64, "dense")
    assert m.used_action_channel_ids == tuple(range(6)) and m.action_dim == 30 and m.action_channels == 30
    assert m.snr_shift == 3.0 and m.action_snr_shift == 0.05  # objective.shift = 3.0 mapped; action_shift default
    assert c.model.mask == "lingbot" and c.model.chunk_size is None
    assert (m.num_heads, m.head_dim, m.dim) == (2, 32, 64)
    wan = load_config(TINY, tiny_sets("unused", "unused"))
    assert wan.model.mask == "document" and model_config_of(wan).action_channels == 6
    # a replaced objective is applied to the resolved config before any objective, not on top of it
    from dataclasses import replace

    again = replace(c, objective=replace(c.objective, shift=5.0))
    assert model_config_of(again).snr_shift == 5.0 and model_config_of(c).snr_shift == 3.0


def test_aliases_and_objective_keys() -> None:
    m = model_config_of(cfg("model.overrides.num_heads=4", "model.overrides.head_dim=24", "objective.action_shift=0.5",
            "objective.num_train_timesteps=500", "objective.latent_weight=0.5"))
    assert (m.num_attention_heads, m.attention_head_dim, m.action_snr_shift, m.num_train_timesteps) == (4, 24, 0.5, 500)
    m = model_config_of(cfg("model.overrides={used_action_channel_ids=[3, 1, 7], in_channels=48}"))
    assert m.used_action_channel_ids == (3, 1, 7)
    with pytest.raises(ValueError, match=r"sets used_action_channel_ids twice \(as 'action_channels' and as "
                                         r"'used_action_channel_ids'\)"):
        cfg("model.overrides.used_action_channel_ids=[3, 1, 7]")


@pytest.mark.parametrize("setting,message", [
    ("model.overrides.dim=128", r"model.overrides.dim does not apply to model.family = 'lingbot-va': it is "
                                r"num_attention_heads \* attention_head_dim"),
    ("model.overrides.action_channels=0", r"action_channels must be >= 1 for model.family = 'lingbot-va'"),
    ("model.chunk_size=2", r"model.chunk_size=2 does not apply to model.family = 'lingbot-va'"),
    ("model.mask=document", r"model.mask must be one of \('lingbot',\) for model.family = 'lingbot-va'"),
    ("objective.weighting=bell", r"objective.weighting = 'bell' does not apply to model.family = 'lingbot-va'"),
    ("objective.chunk_size=2", r"objective.chunk_size = 2 does not apply"),
    ("objective.teacher_forcing=true", r"objective.teacher_forcing = True does not apply"),
    ("model.overrides.snr_shift=4.0", r"objective.shift = 3.0 and model.overrides.snr_shift both set"),
    ("objective.num_train_timesteps=999.5", r"num_train_timesteps must be an integer >= 1"),
    ("model.overrides.attention_head_dim=10", r"attention_head_dim=10 does not fit LeRobot's RoPE"),
])
def test_what_does_not_apply_is_one_line(setting: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        cfg(setting, "data.val_fraction=0.5")
    assert "\n" not in str(err.value)


def test_geometry_two_copies_and_action_steps() -> None:
    c = cfg()
    g = geometry_for(model_config_of(c), (2, 4), c)
    assert (g.video_tokens, g.action_tokens, g.copies, g.frame_budget) == (2, 4, 2, 10)
    bad = cfg("data.action_steps=2")
    with pytest.raises(ValueError, match=r"data.action_steps = 2, but the lingbot-va model takes 4 action steps "
                                         r"per latent frame \(action_per_frame, from model.preset = "
                                         r"'lingbot-va-tiny'\); set data.action_steps = 4"):
        geometry_for(model_config_of(bad), (2, 4), bad)
    # WanVA: one copy without teacher forcing, as before
    wan = load_config(TINY, tiny_sets("unused", "unused"))
    assert geometry_for(model_config_of(wan), (2, 4), wan).copies == 1


def test_collate_pads_text_to_the_prompt_length_all_attended(tmp_path) -> None:
    """Every episode's text becomes max_sequence_length rows (its own first, zeros after, whatever the cache
    held beyond text_len) with text_len = that length; WanVA keeps each text's own length."""
    from flexpack.run.memory_data import RandomEpisodes

    ds = RandomEpisodes([3, 5], channels=48, hw=(2, 2), action_channels=30, action_steps=4, text_len=7, text_dim=64)
    items = [ds[0], {**ds[1], "text_len": 4}]
    run = run_for(ds, cfg())
    batch = run.collate(items)
    assert batch.text.shape == (2, 512, 64) and batch.layout.text_len.tolist() == [512, 512]
    assert torch.equal(batch.text[0, :7], items[0]["text"]) and torch.equal(batch.text[1, :4], items[1]["text"][:4])
    assert batch.text[1, 4:].abs().sum() == 0 and batch.text[0, 7:].abs().sum() == 0
    wan = load_config(TINY, tiny_sets("unused", "unused", "model.overrides.action_channels=30"))
    assert run_for(ds, wan).collate(items).layout.text_len.tolist() == [7, 4]
    with pytest.raises(ValueError, match=r"episode 1: its text has 600 tokens, more than the model's 512"):
        run.collate([{**ds[1], "text": torch.zeros(600, 64), "text_len": 600}])


def test_dataset_actions_scattered_at_used_channels(tiny_dataset) -> None:
    """The dataset's 6 action columns land at used_action_channel_ids of the 30-d action space, the mask True
    exactly there (and where the step exists); normalized to [-1, 1] from the pooled q01/q99. Latent frame f
    carries the actions taken at video frames 4f-4 .. 4f-1 (WanVA's alignment: 4f-3 .. 4f), frame 0 none."""
    ids = [9, 2, 17, 0, 29, 5]
    ds = open_dataset(cfg(f"model.overrides={{used_action_channel_ids={ids}, in_channels=48, text_dim=64}}",
                          root=str(tiny_dataset)))
    base = open_dataset(load_config(TINY, tiny_sets(tiny_dataset, "unused")))  # WanVA: column j -> channel j
    it, ref = ds[1], base[1]
    assert it["action"].shape == (30, *ref["action"].shape[1:])
    others = [c for c in range(30) if c not in ids]
    assert not it["action_mask"][others].any() and it["action"][others].abs().sum() == 0
    assert it["action_mask"][ids][:, 1:].all() and not it["action_mask"][:, 0].any()
    assert it["action"].abs().max() <= 1.0
    # in video-frame order: WanVA's steps are the actions of frames 0, 1, ..., 4F-4; LingBot-VA's of 0 .. 4F-5
    ours = it["action"][ids].flatten(1)[:, it["action_mask"][ids].flatten(1)[0]]
    wan = ref["action"][:6].flatten(1)[:, ref["action_mask"][:6].flatten(1)[0]]
    assert ours.shape[1] == wan.shape[1] - 1 and torch.equal(ours, wan[:, :-1])


def test_missing_action_columns_and_cameras_are_one_line(tiny_dataset, tmp_path) -> None:
    """Each names the field, where its value came from (the override the user wrote), what is missing, and advice
    that fits the family's 30-d action space."""
    with pytest.raises(ValueError, match=r"'action' has 6 columns, but used_action_channel_ids = "
                                         r"\[0, 1, 2, 3, 4, 5, 6\] \(from model.overrides.action_channels\) places 7: "
                                         r"channel\(s\) \[6\] would have no column; set model.overrides."
                                         r"action_channels = 6 \(channels 0..5 of the 30-d action space\)"):
        open_dataset(cfg("model.overrides.action_channels=7", root=str(tiny_dataset)))
    with pytest.raises(ValueError, match=r"camera \['observation.images.image2'\] of obs_cam_keys = "
                                         r"\['observation.images.cam0', 'observation.images.image2'\] \(from "
                                         r"model.overrides.obs_cam_keys\) is not in the dataset, whose cameras are "
                                         r"\['observation.images.cam0'\]"):
        open_dataset(cfg('model.overrides.obs_cam_keys=["observation.images.cam0", "observation.images.image2"]',
                         root=str(tiny_dataset)))
    ok = open_dataset(cfg('model.overrides.obs_cam_keys=["observation.images.cam0"]', root=str(tiny_dataset)))
    assert ok.cameras == ["observation.images.cam0"]
    # 32 action columns: more than the 30-d action space holds, so no action_channels = 32 advice
    from flexpack.data.synthetic import make_synthetic_dataset

    wide = make_synthetic_dataset(tmp_path / "wide", lengths=[9], action_dim=32, seed=0)
    with pytest.raises(ValueError) as info:
        open_dataset(cfg(root=str(wide)))
    text = str(info.value)
    assert "'action' has 32 columns, but used_action_channel_ids = [0, 1, 2, 3, 4, 5] (from " \
           "model.overrides.action_channels) places 6" in text
    assert ("the model's action space has 30 channels (action_dim = 30, from model.preset = 'lingbot-va-tiny'), too "
            "few for 32 columns: keep at most 30 of the dataset's action columns, or train a model of a wider action "
            "space (model.overrides.action_dim >= 32)") in text
    assert "action_channels = 32" not in text and "\n" not in text


def test_cameras_follow_obs_cam_keys_order(tmp_path) -> None:
    """Two cameras: the dataset reads the latent cache of the cameras joined in obs_cam_keys order (the order
    LeRobot concatenates its per-camera latents on width), and refuses data.cameras in another order."""
    pytest.importorskip("lerobot")
    from flexpack.data.synthetic import make_synthetic_dataset

    root = make_synthetic_dataset(tmp_path / "ds", lengths=[9, 5], cameras=2, seed=3)
    keys = '["observation.images.cam1", "observation.images.cam0"]'
    ds = open_dataset(cfg(f"model.overrides.obs_cam_keys={keys}", root=str(root)))
    assert ds.cameras == ["observation.images.cam1", "observation.images.cam0"]
    assert ds.latent_file(0).parent.name == "cam1+cam0"
    with pytest.raises(ValueError, match=r"on width in the order of obs_cam_keys = \['observation.images.cam1', "
                                         r"'observation.images.cam0'\] \(from model.overrides.obs_cam_keys\), but "
                                         r"data.cameras = \['observation.images.cam0', 'observation.images.cam1'\]"):
        open_dataset(cfg(f"model.overrides.obs_cam_keys={keys}", "data.cameras=['cam0', 'cam1']", root=str(root)))
    # a cache of one camera: the missing latents name the camera never encoded and the command that encodes both
    from flexpack.data.encode import encode_dataset

    encode_dataset(root, cameras=["observation.images.cam0"], progress=False)
    with pytest.raises(FileNotFoundError) as info:
        open_dataset(cfg(f"model.overrides.obs_cam_keys={keys}", root=str(root)))[0]
    assert ("latent file does not exist: the cache holds latents of camera set(s) ['cam0'] "
            f"({root / 'latents' / 'video'}), none of ['observation.images.cam1', 'observation.images.cam0'] joined on "
            "width in this order (camera(s) ['observation.images.cam1'] never encoded); run `flexpack encode --dataset "
            "DATASET --cameras observation.images.cam1 observation.images.cam0`") in str(info.value)


def test_quantile_normalization_is_lerobots() -> None:
    """flexpack's q01/q99 map equals LeRobot's QUANTILES normalization (its NormalizerProcessorStep) on values
    inside [q01, q99]; outside, flexpack clips to [-1, 1] where LeRobot does not (stated in docs/USAGE.md)."""
    pytest.importorskip("lerobot")
    from lerobot.configs.types import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.processor import NormalizerProcessorStep

    from flexpack.data.actions import ActionNormalizer

    q01, q99 = np.array([-1.0, 0.0, 2.0]), np.array([1.0, 0.5, 6.0])
    x = np.array([[-0.5, 0.1, 2.5], [0.9, 0.45, 5.9], [2.0, -1.0, 7.0]], dtype=np.float32)
    ours = ActionNormalizer.from_stats({"q01": q01, "q99": q99}, 3)(x)
    step = NormalizerProcessorStep(features={"action": PolicyFeature(type=FeatureType.ACTION, shape=(3,))},
                                   norm_map={FeatureType.ACTION: NormalizationMode.QUANTILES},
                                   stats={"action": {"q01": q01, "q99": q99}})
    theirs = step._normalize_action(torch.from_numpy(x), inverse=False).numpy()
    np.testing.assert_allclose(ours[:2], theirs[:2], rtol=1e-6, atol=1e-6)
    assert np.abs(theirs[2]).max() > 1 and np.abs(ours[2]).max() == 1.0
