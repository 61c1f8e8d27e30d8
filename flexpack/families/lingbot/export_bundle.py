"""What ``flexpack export`` reads of a lingbot-bundle run's bundle (``data.format = "lingbot-bundle"``).

Statistics. The checkpoint carries the bundle's q01 / q99 over the model's ``action_dim``-wide action space (its
normalizer: pooled over every segment of the whole bundle, or ``data.norm_stat``), so every dataset of a bundle
shares them. LeRobot's processors hold them in the *source columns*: the model-space values taken at
``used_action_channel_ids`` (:func:`bundle_normalization`). ``normalization.json`` keeps the model-space values
(what ``flexpack sample`` checks against the bundle) beside the columns' (``column_low`` / ``column_high``).

Cameras (:func:`bundle_cameras`). The run's order (``data.cameras``, else ``obs_cam_keys``, else the first
dataset's video features), composed as the run composed them (``data.camera_layout``; ``auto`` decided by the
latent grids exactly as training decides it), each camera's frames as a dataset's ``meta/info.json`` video feature
gives them (``[C, H, W]`` or ``[H, W, C]``, told apart by ``names``) and its latent grid read from the header of
one segment's latent file. Where the datasets' cameras differ (frame sizes, grids, layout, ``frame_ids`` stride),
``--dataset NAME`` picks the dataset an export describes; without it the export is refused naming them.

LeRobot's ``lingbot_va`` policy (:func:`lerobot_layout`): ``camera_layout`` ``"robotwin_tshape"`` for a T
(exactly three cameras, each wrist half the main camera's latent grid on both axes) else ``"width_concat"``
(every camera one grid); ``height`` / ``width`` the main camera's latent grid times the VAE's 16 pixels (upstream
resizes frames to that size before encoding, whatever the videos' size); ``action_per_frame`` must be 4 x the
``frame_ids`` stride (LeRobot encodes a keyframe every ``action_per_frame // 4`` actions).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flexpack.run.resolve import config_family, model_config_of

if TYPE_CHECKING:
    from flexpack.data.normalization import ActionStats
    from flexpack.data.v21 import Dataset21
    from flexpack.run.config import TrainConfig

VAE_STRIDE, VAE_PIXELS = 4, 16  # the Wan2.2 VAE: video frames per latent frame, pixels per latent cell
CHANNEL_NAMES = ("c", "channel", "channels", "rgb")
FORMULA = "2 (x - low) / (high - low + 1e-6) - 1, clipped to [-1.5, 1.5], in the model's action space"


@dataclass(frozen=True)
class BundleCameras:
    """One dataset's cameras as a run on the bundle composes them (see the module docstring)."""

    dataset: str  # the dataset's folder, relative to the bundle root
    info_file: Path
    frames: dict[str, tuple[int, int, int]]  # camera -> (C, H, W) of its video feature, in the run's order
    grids: tuple[tuple[int, int], ...]  # latent (h, w) per camera, in the same order
    layout: str  # "width_concat" or "tshape" (flexpack.data.bundle_grid)
    stride: int  # the frame_ids stride of the encoding
    columns: int  # the dataset's action columns

    def signature(self) -> tuple[Any, ...]:
        return tuple(self.frames.items()), self.grids, self.layout, self.stride, self.columns

    def shown(self) -> str:
        cams = ", ".join(f"{c} {f[1]}x{f[2]} (latent {g[0]}x{g[1]})"
                         for (c, f), g in zip(self.frames.items(), self.grids))
        return f"{self.dataset}: {cams}, {self.layout}, frame_ids stride {self.stride}, {self.columns} action columns"


def frame_shape(feature: Any, key: str, where: Path) -> tuple[int, int, int]:
    """A v2.1 video feature's ``shape`` as (C, H, W): ``names`` say which axis holds the channels; without names a
    3- or 1-sized first axis is the channels, else a 3- or 1-sized last one; anything else is one line."""
    shape = feature.get("shape") if isinstance(feature, dict) else None
    if not isinstance(shape, (list, tuple)) or len(shape) != 3 or not all(isinstance(x, int) and x > 0 for x in shape):
        raise ValueError(f"{where}: features[{key!r}].shape = {shape!r}; a video feature is [C, H, W] or [H, W, C]")
    names = feature.get("names")
    names = [str(n).lower() for n in names] if isinstance(names, list) and len(names) == 3 else None
    if names is not None and (names[0] in CHANNEL_NAMES) != (names[2] in CHANNEL_NAMES):
        first = names[0] in CHANNEL_NAMES
    elif names is None and (shape[0] in (1, 3)) != (shape[2] in (1, 3)):
        first = shape[0] in (1, 3)
    else:
        raise ValueError(f"{where}: features[{key!r}] shape {shape} with names {feature.get('names')!r} does not say "
                         "which axis holds the channels (names ['channels', 'height', 'width'] or ['height', "
                         "'width', 'channels'])")
    c, h, w = shape if first else (shape[2], shape[0], shape[1])
    return c, h, w


def run_cameras(cfg: TrainConfig, first: Dataset21) -> list[str]:
    """The cameras in the order the run composed them (as :func:`flexpack.run.build.open_bundle` picks them)."""
    conv = config_family(cfg).conventions(model_config_of(cfg))
    if cfg.data.cameras:
        return list(cfg.data.cameras)
    if conv.cameras:
        return list(conv.cameras)
    return [k for k, f in first.info.get("features", {}).items() if isinstance(f, dict) and f.get("dtype") == "video"]


def _dataset_cameras(cfg: TrainConfig, name: str, ds: Dataset21, cameras: list[str]) -> BundleCameras:
    from flexpack.data import bundle_files as files
    from flexpack.data.bundle_actions import parse_frame_ids
    from flexpack.data.bundle_grid import resolve_layout

    info = ds.root / "meta" / "info.json"
    feats = ds.info.get("features", {})
    absent = [c for c in cameras if c not in feats]
    if absent:
        raise ValueError(f"{info}: no video feature {absent[0]!r} (the run's cameras {cameras})")
    frames = {c: frame_shape(feats[c], c, info) for c in cameras}
    why = "it has no segment"
    for ep in ds.episodes:
        for seg in ds.segments(ep):
            try:
                heads = [files.read_header(files.latent_file(ds.root, ds.chunk_of(ep), c, ep, seg.start, seg.end))
                         for c in cameras]
            except ValueError as exc:  # a segment the run skipped (data.missing = "skip"): try the next one
                why = str(exc)
                continue
            grids = tuple((h.height, h.width) for h in heads)
            layout = resolve_layout(cfg.data.camera_layout, list(grids), cameras, f"{name}: episode {ep}")
            stride = parse_frame_ids(heads[0].frame_ids, str(heads[0].path)).stride
            return BundleCameras(name, info, frames, grids, layout, stride, ds.feature_width("action"))
    raise ValueError(f"{ds.root}: no segment whose latent files read for the cameras {cameras} ({why})")


def bundle_cameras(cfg: TrainConfig, dataset: str | None = None) -> BundleCameras:
    """The cameras of the bundle's dataset ``dataset`` (``--dataset``), or of every dataset where they agree;
    one line naming the datasets where they differ, or for a name that is not one of the bundle's datasets."""
    from flexpack.data.bundle_files import find_datasets
    from flexpack.data.v21 import Dataset21

    root = Path(cfg.data.root)
    folders = find_datasets(root)
    if not folders:
        raise ValueError(f"{root}: no LeRobot dataset (meta/info.json) under the bundle root (data.root)")
    names = [str(f.relative_to(root)) if f != root else f.name for f in folders]
    if dataset is not None and dataset not in names:
        raise ValueError(f"--dataset {dataset!r}: not a dataset of the bundle {root} (its datasets: "
                         f"{names[:8]}{' ...' if len(names) > 8 else ''})")
    first = Dataset21.open(folders[0])
    cameras = run_cameras(cfg, first)
    if dataset is not None:
        k = names.index(dataset)
        return _dataset_cameras(cfg, dataset, first if k == 0 else Dataset21.open(folders[k]), cameras)
    found = [_dataset_cameras(cfg, n, first if k == 0 else Dataset21.open(f), cameras)
             for k, (n, f) in enumerate(zip(names, folders))]
    kinds: dict[tuple[Any, ...], BundleCameras] = {}
    for cams in found:
        kinds.setdefault(cams.signature(), cams)
    if len(kinds) > 1:
        a, b = list(kinds.values())[:2]
        raise ValueError(f"{root}: the bundle's datasets differ in their cameras ({a.shown()}; {b.shown()}); "
                         f"pick the dataset the export describes with --dataset NAME (one of {names[:8]}"
                         f"{' ...' if len(names) > 8 else ''})")
    return found[0]


def bundle_normalization(cfg: TrainConfig, state: dict[str, Any], where: str) -> tuple[ActionStats, dict[str, Any]]:
    """(the statistics in the source columns, ``normalization.json``'s record) of a bundle run: the checkpoint's
    model-space q01 / q99 (or the bundle's, for a checkpoint that carries none) taken at ``used_action_channel_ids``
    (see the module docstring)."""
    from flexpack.data.normalization import ActionStats
    from flexpack.run.state.resume import saved_stats

    model_cfg = model_config_of(cfg)
    conv = config_family(cfg).conventions(model_cfg)
    used = list(conv.action_channels) if conv.action_channels is not None else list(range(conv.action_dim))
    model = saved_stats(state, where, width=conv.action_dim)
    if model is None and cfg.data.normalize:  # a checkpoint without statistics: the bundle's own
        from flexpack.run.build import open_bundle

        model = ActionStats.of(open_bundle(cfg, conv, text_dropout=False).normalizer)
    if model is None:
        model = ActionStats(mode="none", low=(0.0,) * conv.action_dim, high=(1.0,) * conv.action_dim)
    cols = ActionStats(mode=model.mode, low=tuple(model.low[c] for c in used), high=tuple(model.high[c] for c in used))
    record = {"action_key": "action", **model.to_json(), "space": "model", "action_dim": conv.action_dim,
              "columns": len(used), "channels": used, "column_low": list(cols.low), "column_high": list(cols.high),
              "action_steps": cfg.data.action_steps, "dataset": str(cfg.data.root), "format": "lingbot-bundle",
              "formula": FORMULA if model.mode == "quantile" else "x"}
    return cols, record


def check_steps(cfg: TrainConfig, dataset: str | None = None) -> None:
    """``action_per_frame`` LeRobot's policy can run on the bundle's encoding (before any weight is read): a multiple
    of the VAE's 4 frames, 4 x the latents' ``frame_ids`` stride."""
    apf = model_config_of(cfg).action_per_frame
    if apf % VAE_STRIDE:
        raise ValueError(f"--format lerobot: action_per_frame = {apf}, but LeRobot's lingbot_va policy encodes "
                         f"{VAE_STRIDE} keyframes per latent frame, one every action_per_frame // {VAE_STRIDE} "
                         f"actions: action_per_frame must be a multiple of {VAE_STRIDE}")
    _check_stride(bundle_cameras(cfg, dataset), apf)


def _check_stride(cams: BundleCameras, apf: int) -> None:
    if VAE_STRIDE * cams.stride != apf:
        raise ValueError(f"--format lerobot: {cams.dataset}'s latents encode video frames {cams.stride} apart "
                         f"(frame_ids stride {cams.stride}: {VAE_STRIDE * cams.stride} action steps a latent frame), "
                         f"but action_per_frame = {apf}: LeRobot's lingbot_va policy encodes a keyframe every "
                         f"action_per_frame // {VAE_STRIDE} = {max(1, apf // VAE_STRIDE)} actions")


def lerobot_layout(cfg: TrainConfig, stats: ActionStats, dataset: str | None = None) -> dict[str, Any]:
    """The dataset-side fields of a LeRobot ``lingbot_va`` policy of a bundle run: ``obs_cam_keys``,
    ``camera_layout`` (flexpack's name of the composition: the family's export writes LeRobot's), ``height``,
    ``width``, the input and output features; one line for what the policy cannot represent (the module
    docstring)."""
    from lerobot.configs.types import FeatureType, PolicyFeature

    model_cfg = model_config_of(cfg)
    if stats.mode != "quantile":
        raise ValueError(f"--format lerobot: the run normalized its actions with {stats.mode!r} statistics, but "
                         "LeRobot's lingbot_va postprocessor maps actions with q01 / q99 (QUANTILES)")
    cams = bundle_cameras(cfg, dataset)
    names, grids = list(cams.frames), cams.grids
    used = list(model_cfg.used_action_channel_ids)
    if cams.columns != len(used):
        raise ValueError(f"{cams.info_file}: 'action' has {cams.columns} columns, but used_action_channel_ids = {used} "
                         f"places {len(used)}: the actions do not map onto the policy's output")
    _check_stride(cams, model_cfg.action_per_frame)
    (h0, w0), shown = grids[0], ", ".join(f"{c} {h}x{w}" for c, (h, w) in zip(names, grids))
    if cams.layout == "tshape":
        if len(names) != 3 or h0 % 2 or w0 % 2 or any(g != (h0 // 2, w0 // 2) for g in grids[1:]):
            raise ValueError(f"{cams.info_file}: the run composed the latent grids {shown} as a T, but LeRobot's "
                             "robotwin_tshape layout takes one main camera and two wrist cameras of half its grid "
                             "on both axes")
    elif len(set(grids)) != 1:
        raise ValueError(f"{cams.info_file}: the run joined the latent grids {shown} on width, but LeRobot's "
                         "width_concat layout resizes every camera to one height x width")
    h, w = h0 * VAE_PIXELS, w0 * VAE_PIXELS
    main = cams.frames[names[0]]
    if main[1:] != (h, w):
        print(f"export: {names[0]}'s frames are {main[1]}x{main[2]} ({cams.info_file}); the policy resizes them to "
              f"{h}x{w}, the size its latents were encoded at", file=sys.stderr)
    inputs = {c: PolicyFeature(type=FeatureType.VISUAL, shape=cams.frames[c]) for c in names}
    outputs = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(cams.columns,))}
    return {"obs_cam_keys": names, "camera_layout": cams.layout, "height": h, "width": w,
            "input_features": inputs, "output_features": outputs}
