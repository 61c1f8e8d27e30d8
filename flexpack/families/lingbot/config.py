"""Shape and training semantics of the ``lingbot-va`` family (LeRobot's ``lingbot_va`` policy), and its presets.

Field names follow LeRobot's ``LingBotVAConfig`` (lerobot 0.6.1) where they are the model's shape, so a
policy ``config.json`` or an upstream ``transformer/config.json`` reads into :class:`LingbotConfig`
key for key (:func:`config_from_lerobot`). The other fields are what a training step needs to do what
LeRobot's ``training_loss_from_streams`` does: action steps per latent frame, the two timestep shifts,
the noisy-condition probability, the ranges chunk size and window are drawn from, and the action
channels a dataset fills.

Token geometry of one latent frame (the run derives it, asking the registry entry:
:mod:`flexpack.families.lingbot.family`): ``(H // ph) * (W // pw)`` video tokens, ``action_per_frame``
action tokens, and two copies of every frame (noisy and clean, :data:`COPIES`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace
from typing import Any, Mapping

from flexpack.families.wan.config import WanVAConfig
from flexpack.models.rope import rope_bands

COPIES = 2  # every frame is seen twice: a noisy copy (the prediction) and a clean copy (the context)
LEROBOT_TYPE = "lingbot_va"  # the "type" of a LeRobot policy config.json of this family


@dataclass(frozen=True, kw_only=True)
class LingbotConfig:
    """LeRobot's LingBot-VA transformer shape (defaults: its 5B checkpoint) plus its training semantics."""

    # model shape: LeRobot's names and defaults
    patch_size: tuple[int, int, int] = (1, 2, 2)
    num_attention_heads: int = 24
    attention_head_dim: int = 128
    in_channels: int = 48
    out_channels: int = 48
    action_dim: int = 30  # the action space of the checkpoint; datasets fill used_action_channel_ids of it
    text_dim: int = 4096
    freq_dim: int = 256
    ffn_dim: int = 14336
    num_layers: int = 30
    cross_attn_norm: bool = True
    eps: float = 1e-6
    rope_max_seq_len: int = 1024  # kept for the config round trip; RoPE is computed from positions, no table
    # training semantics (LeRobot: config fields, or constants of training_loss_from_streams)
    action_per_frame: int = 4  # action steps (tokens) per latent frame
    snr_shift: float = 5.0  # timestep shift of the video latents' noise grid
    action_snr_shift: float = 0.05  # timestep shift of the actions' noise grid
    noisy_cond_prob: float = 0.5  # chance that an episode's clean latent copy is itself noised (t in [500, 1000))
    chunk_range: tuple[int, int] = (1, 4)  # chunk size (latent frames per attention block) drawn uniformly from
    window_range: tuple[int, int] = (4, 64)  # attention window in block ids (2 per chunk) drawn uniformly from
    used_action_channel_ids: tuple[int, ...] = tuple(range(7))  # action channels a dataset fills, in order
    num_train_timesteps: int = 1000  # the noise grid's size (the model's timestep scale)
    # data conventions (LeRobot's policy config): text tokens per prompt (UMT5's, zero padded and all
    # attended), and the cameras joined on width in this order (empty: the dataset's cameras)
    max_sequence_length: int = 512
    obs_cam_keys: tuple[str, ...] = ()
    # inference (LeRobot's policy config; flexpack sample and the LeRobot export): latent frames per predicted
    # chunk, the attention window in block ids, solver steps of the video and the action stream, and the
    # classifier-free guidance scale of each (<= 1: no guidance, the prompt's prediction alone)
    frame_chunk_size: int = 4
    attn_window: int = 30
    num_inference_steps: int = 20
    action_num_inference_steps: int = 50
    guidance_scale: float = 5.0
    action_guidance_scale: float = 1.0
    # flexpack options
    attn_backend: str = "auto"
    activation_checkpointing: bool = False  # inside forward, for direct users (as WanVAConfig's)

    def __post_init__(self) -> None:
        for name in ("num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "action_dim",
                     "text_dim", "freq_dim", "ffn_dim", "num_layers", "action_per_frame", "num_train_timesteps",
                     "max_sequence_length", "frame_chunk_size", "attn_window", "num_inference_steps",
                     "action_num_inference_steps"):
            if getattr(self, name) <= 0:
                raise ValueError(f"lingbot-va config: {name} must be positive, got {getattr(self, name)}")
        hd = self.attention_head_dim
        # LeRobot's RoPE gives time hd - 2*(hd//3) channels and height / width hd//3 each; its rotation
        # only fits the head when hd//3 is even, and then the split is flexpack's (rope_bands)
        if hd % 2 or (hd // 3) % 2:
            raise ValueError(f"lingbot-va config: attention_head_dim={hd} does not fit LeRobot's RoPE "
                             "(needs an even head dim with an even head_dim // 3, e.g. 24, 32, 128)")
        assert rope_bands(hd) == (hd - 2 * (hd // 3), hd // 3, hd // 3)
        if len(self.patch_size) != 3 or min(self.patch_size) <= 0 or self.patch_size[0] != 1:
            raise ValueError(f"lingbot-va config: patch_size must be (1, ph, pw) with positive ints, "
                             f"got {self.patch_size}")
        for name, lo_min in (("chunk_range", 1), ("window_range", 0)):
            lo, hi = getattr(self, name)
            if not lo_min <= lo <= hi:
                raise ValueError(f"lingbot-va config: {name} must be (lo, hi) with {lo_min} <= lo <= hi, "
                                 f"got {getattr(self, name)}")
        if not 0.0 <= self.noisy_cond_prob <= 1.0:
            raise ValueError(f"lingbot-va config: noisy_cond_prob must be in [0, 1], got {self.noisy_cond_prob}")
        if not (math.isfinite(self.guidance_scale) and math.isfinite(self.action_guidance_scale)
                and self.guidance_scale >= 0 and self.action_guidance_scale >= 0):
            raise ValueError(f"lingbot-va config: guidance_scale and action_guidance_scale must be finite and >= 0, "
                             f"got {self.guidance_scale}, {self.action_guidance_scale}")
        if not (self.snr_shift > 0 and self.action_snr_shift > 0):
            raise ValueError(f"lingbot-va config: snr_shift and action_snr_shift must be positive, got "
                             f"{self.snr_shift}, {self.action_snr_shift}")
        ids = self.used_action_channel_ids
        if not ids or len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= self.action_dim:
            raise ValueError(f"lingbot-va config: used_action_channel_ids must be distinct channels in "
                             f"0..{self.action_dim - 1}, got {list(ids)}")

    @property
    def dim(self) -> int:
        return self.num_attention_heads * self.attention_head_dim

    # the shape names generic code reads (flexpack.models.registry)
    @property
    def num_heads(self) -> int:
        return self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.attention_head_dim

    @property
    def out_dim(self) -> int:
        return self.out_channels

    @property
    def action_channels(self) -> int:
        """The width of the action stream: LeRobot's whole action space (``action_dim``)."""
        return self.action_dim

    @property
    def patch_volume(self) -> int:
        return math.prod(self.patch_size)

    def wan_shape(self) -> WanVAConfig:
        """The :class:`WanVAConfig` of the same transformer (the blocks are Wan's)."""
        return WanVAConfig(
            dim=self.dim, num_heads=self.num_attention_heads, ffn_dim=self.ffn_dim, num_layers=self.num_layers,
            patch_size=tuple(self.patch_size), in_channels=self.in_channels, out_channels=self.out_channels,
            action_channels=self.action_dim, text_dim=self.text_dim, freq_dim=self.freq_dim, eps=self.eps,
            cross_attn_norm=self.cross_attn_norm, attn_backend=self.attn_backend,
            activation_checkpointing=self.activation_checkpointing,
        )

    def lerobot_fields(self) -> dict[str, Any]:
        """The fields a LeRobot ``LingBotVAConfig`` (or ``WanTransformer3DModel``) takes under the same names."""
        out = {f: getattr(self, f) for f in LEROBOT_SHAPE + LEROBOT_TRAINING + LEROBOT_INFERENCE}
        out["patch_size"] = list(self.patch_size)
        out["used_action_channel_ids"] = list(self.used_action_channel_ids)
        out["obs_cam_keys"] = list(self.obs_cam_keys)
        return out


# the fields LeRobot's policy config and its transformer config share with LingbotConfig
LEROBOT_SHAPE = ("patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels",
                 "action_dim", "text_dim", "freq_dim", "ffn_dim", "num_layers", "cross_attn_norm", "eps",
                 "rope_max_seq_len")
# policy config.json only
LEROBOT_TRAINING = ("action_per_frame", "snr_shift", "action_snr_shift", "used_action_channel_ids",
                    "max_sequence_length", "obs_cam_keys")
# policy config.json only: how the policy samples (flexpack sample reads them too; they shape nothing trained)
LEROBOT_INFERENCE = ("frame_chunk_size", "attn_window", "num_inference_steps", "action_num_inference_steps",
                     "guidance_scale", "action_guidance_scale")
CAMERA_LAYOUT = "width_concat"  # LeRobot's camera_layout flexpack's latent cache has (cameras joined on width)
# LeRobot's camera_layout -> how flexpack composes the cameras (flexpack.data.bundle_grid): a latent cache joins them
# on width; a lingbot-bundle may compose upstream's T (wrists side by side over the main camera)
LEROBOT_LAYOUTS = {"width_concat": "width_concat", "robotwin_tshape": "tshape"}


def lerobot_layout_name(layout: str) -> str:
    """LeRobot's ``camera_layout`` of flexpack's composition ``layout`` ("width_concat" or "tshape")."""
    return {v: k for k, v in LEROBOT_LAYOUTS.items()}[layout]


def camera_layout_of(cfg: Mapping[str, Any]) -> str | None:
    """The composition a checkpoint's config records, in flexpack's names (a LeRobot policy's ``camera_layout``);
    None where it records none (an upstream ``transformer/config.json``) or one flexpack does not know
    (:func:`config_from_lerobot` refuses those)."""
    layout = cfg.get("camera_layout")
    return LEROBOT_LAYOUTS.get(layout) if isinstance(layout, str) else None


PRESETS: dict[str, LingbotConfig] = {
    # LeRobot's LingBotVAConfig defaults (the released LingBot-VA checkpoints, Wan 2.2 5B width)
    "lingbot-va-5b": LingbotConfig(),
    # CPU tests and the demo data (48-channel latents, 64-d text, 6 action columns)
    "lingbot-va-tiny": LingbotConfig(
        num_attention_heads=2, attention_head_dim=32, text_dim=64, freq_dim=32, ffn_dim=128, num_layers=2,
        used_action_channel_ids=tuple(range(6)),
    ),
}


def lingbot_config(name: str, **overrides: Any) -> LingbotConfig:
    """A preset (``"lingbot-va-5b"``, ``"lingbot-va-tiny"``) with keyword overrides."""
    if name not in PRESETS:
        raise ValueError(f"unknown lingbot-va preset {name!r}; known: {sorted(PRESETS)}")
    known = {f.name for f in fields(LingbotConfig)}
    bad = sorted(set(overrides) - known)
    if bad:
        raise ValueError(f"unknown lingbot-va config keys {bad}; known: {sorted(known)}")
    return replace(PRESETS[name], **overrides)


def config_from_lerobot(cfg: Mapping[str, Any], *, source: str = "config", **overrides: Any) -> LingbotConfig:
    """A :class:`LingbotConfig` from a LeRobot ``lingbot_va`` policy ``config.json`` or an upstream
    ``transformer/config.json`` (diffusers-style, the same shape keys); keys it lacks keep the
    5B defaults. ``source`` names the file in errors. A config of another policy type is refused."""
    kind = cfg.get("type")
    if kind is not None and kind != LEROBOT_TYPE:
        raise ValueError(f"{source}: a LeRobot policy of type {kind!r}, not {LEROBOT_TYPE!r}")
    cls_name = cfg.get("_class_name")
    if cls_name is not None and cls_name != "WanTransformer3DModel":
        raise ValueError(f"{source}: a {cls_name!r} config, not LingBot-VA's WanTransformer3DModel")
    layout = cfg.get("camera_layout", CAMERA_LAYOUT)
    if layout not in LEROBOT_LAYOUTS:  # whether the data composes it is the run's check (flexpack.run.pretrained)
        raise ValueError(f"{source}: camera_layout {layout!r}; LeRobot's lingbot_va composes cameras as one of "
                         f"{list(LEROBOT_LAYOUTS)}")
    kw: dict[str, Any] = {k: cfg[k] for k in LEROBOT_SHAPE + LEROBOT_TRAINING + LEROBOT_INFERENCE if k in cfg}
    if "patch_size" in kw:
        kw["patch_size"] = tuple(int(p) for p in kw["patch_size"])
    if "used_action_channel_ids" in kw:
        kw["used_action_channel_ids"] = tuple(int(i) for i in kw["used_action_channel_ids"])
    if "obs_cam_keys" in kw:
        kw["obs_cam_keys"] = tuple(str(k) for k in kw["obs_cam_keys"])
    kw.update(overrides)
    return LingbotConfig(**kw)
