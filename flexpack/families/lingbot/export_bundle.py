"""What ``flexpack export`` reads of a lingbot-bundle run's bundle (``data.format = "lingbot-bundle"``), or of the
one ``[[data.datasets]]`` entry of a mixture it describes (:func:`export_source`).

Statistics. The checkpoint carries the bundle's q01 / q99 over the model's ``action_dim``-wide action space (its
normalizer: pooled over every segment of the whole bundle, or ``data.norm_stat``), so every dataset of a bundle
shares them. A mixture's entries each have their own (pooled within the entry, its ``norm_stat``, or pooled over
the entries naming one ``embodiment``): the checkpoint records them per entry (``extra.entry_normalizers``;
a checkpoint written before that record holds the entries' shared statistics, or none where they differ, and
then the entry's are computed from its data as training computed them). LeRobot's processors hold them in the
*source columns*: the model-space values taken at the described source's action channels (the entry's
``action_channels``, else ``used_action_channel_ids``; :func:`bundle_normalization`), which the policy's
``used_action_channel_ids`` then names. ``normalization.json`` keeps the model-space values (what
``flexpack sample`` checks against the bundle) beside the columns' (``column_low`` / ``column_high``).

``--dataset NAME`` on a mixture run: an entry's name (``name``, else its folder's), or ``ENTRY/DATASET`` for one
dataset of an entry's bundle (as the metrics name it). Without it a run whose entries differ in statistics, action
channels or cameras is refused in one line naming the entries; an unknown name is one line naming the choices.

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
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flexpack.data.normalization import ActionStats
    from flexpack.data.v21 import Dataset21
    from flexpack.run.root import Run

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


@dataclass(frozen=True)
class ExportSource:
    """What an export of a bundle run describes: the run's ``data.root`` bundle, or one ``[[data.datasets]]``
    entry of a mixture, with the options the run read it with."""

    root: Path  # the bundle root (or v2.1 dataset) read
    cameras: tuple[str, ...]  # the composition order given; () = the first dataset's video features
    layout: str  # its camera_layout option
    channels: tuple[int, ...]  # the model channel of each action column (used_action_channel_ids)
    entry: int | None = None  # the mixture entry (None: data.root)
    name: str = ""  # the entry's name ("" for data.root)
    dataset: str | None = None  # one dataset under ``root`` (None: every one, where their cameras agree)

    def label(self, dataset: str) -> str:
        """A dataset of ``root`` as messages and ``--dataset`` name it."""
        return f"{self.name}/{dataset}" if self.name else dataset


def sources(run: Run) -> list[ExportSource]:
    """Every source of the run: its mixture's entries (options as :func:`flexpack.run.build.open_mixture` reads
    them: the entry's, else the family's), else ``data.root`` (cameras: ``data.cameras``, else ``obs_cam_keys``)."""
    from flexpack.data.mixture import entry_name

    conv = run.family.conventions(run.model_config)
    family = tuple(conv.action_channels) if conv.action_channels is not None else tuple(range(conv.action_dim))
    if not run.config.data.datasets:
        cams = tuple(run.config.data.cameras or conv.cameras or ())
        return [ExportSource(Path(run.config.data.root), cams, run.config.data.camera_layout, family)]
    return [ExportSource(Path(e.root), tuple(e.cameras or conv.cameras or ()), e.camera_layout,
                         tuple(e.action_channels) if e.action_channels is not None else family, k, entry_name(e))
            for k, e in enumerate(run.config.data.datasets)]


def _shown(names: list[str]) -> str:
    return f"{names[:8]}{' ...' if len(names) > 8 else ''}"


def export_source(run: Run, dataset: str | None = None) -> ExportSource:
    """The source an export describes (``--dataset``: the module docstring); one line for a name that is not one
    of the run's, or for a mixture whose entries differ where none is named."""
    found = sources(run)
    if not run.config.data.datasets:
        return replace(found[0], dataset=dataset)  # the bundle's dataset names are checked as its cameras are read
    names = [s.name for s in found]
    if dataset is None:
        why = _entries_differ(run, found) if len(found) > 1 else None
        if why:
            raise ValueError(f"the run's data.datasets entries differ in {why}; pick the one the export describes "
                             f"with --dataset NAME (one of {_shown(names)})")
        return found[0]
    hits = [replace(s, dataset=None) for s in found if s.name == dataset]
    hits = hits or [replace(s, dataset=dataset[len(s.name) + 1:]) for s in found
                    if dataset.startswith(s.name + "/") and len(dataset) > len(s.name) + 1]
    if len(hits) > 1:
        raise ValueError(f"--dataset {dataset!r}: {len(hits)} data.datasets entries are named {hits[0].name!r}; tell "
                         "them apart with a name = ... of their own (export --set data.datasets=... may add it)")
    if not hits:
        from flexpack.data.bundle_files import find_datasets

        inner = [s.label(str(f.relative_to(s.root)) if f != s.root else f.name)
                 for s in found for f in find_datasets(s.root)]
        raise ValueError(f"--dataset {dataset!r}: not a dataset of the run's mixture (its data.datasets entries "
                         f"{_shown(names)}, or ENTRY/DATASET: {_shown(inner)})")
    return hits[0]


def _entries_differ(run: Run, found: list[ExportSource]) -> str | None:
    """What a mixture's entries differ in (action channels, statistics, cameras), or None where they agree."""
    if len({s.channels for s in found}) > 1:
        return "their action channels (" + "; ".join(f"{s.name}: {list(s.channels)}" for s in found) + ")"
    entries = run.config.data.datasets
    stats = {(e.norm_stat, e.embodiment if not e.norm_stat else "") for e in entries}
    if run.config.data.normalize and (len(stats) > 1 or not any(next(iter(stats)))):
        return ("their action statistics (each entry pools its own unless they name one embodiment or one "
                "norm_stat)")
    kinds: dict[tuple[Any, ...], BundleCameras] = {}
    for s in found:
        try:
            cams = _source_cameras(s)
        except ValueError as exc:  # an entry whose own datasets' cameras differ
            return f"their cameras ({exc})"
        kinds.setdefault(cams.signature(), cams)
    if len(kinds) > 1:
        a, b = list(kinds.values())[:2]
        return f"their cameras ({a.shown()}; {b.shown()})"
    return None


def _dataset_cameras(src: ExportSource, name: str, ds: Dataset21, cameras: list[str]) -> BundleCameras:
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
            layout = resolve_layout(src.layout, list(grids), cameras, f"{name}: episode {ep}")
            stride = parse_frame_ids(heads[0].frame_ids, str(heads[0].path)).stride
            return BundleCameras(name, info, frames, grids, layout, stride, ds.feature_width("action"))
    raise ValueError(f"{ds.root}: no segment whose latent files read for the cameras {cameras} ({why})")


def bundle_cameras(run: Run, dataset: str | None = None) -> BundleCameras:
    """The cameras of the dataset ``dataset`` (``--dataset``: the module docstring), or of every dataset of the
    source described where they agree; one line naming the datasets where they differ, or for a name that is not
    one of the run's datasets."""
    return _source_cameras(export_source(run, dataset))


def _source_cameras(src: ExportSource) -> BundleCameras:
    from flexpack.data.bundle_files import find_datasets
    from flexpack.data.v21 import Dataset21

    root = src.root
    folders = find_datasets(root)
    if not folders:
        where = f"data.datasets[{src.entry}].root" if src.entry is not None else "data.root"
        raise ValueError(f"{root}: no LeRobot dataset (meta/info.json) under the bundle root ({where})")
    names = [str(f.relative_to(root)) if f != root else f.name for f in folders]
    labels = [src.label(n) for n in names]
    if src.dataset is not None and src.dataset not in names:
        raise ValueError(f"--dataset {src.label(src.dataset)!r}: not a dataset of the bundle {root} (its datasets: "
                         f"{_shown(labels)})")
    first = Dataset21.open(folders[0])
    cameras = list(src.cameras) or [k for k, f in first.info.get("features", {}).items()
                                    if isinstance(f, dict) and f.get("dtype") == "video"]
    if src.dataset is not None:
        k = names.index(src.dataset)
        return _dataset_cameras(src, labels[k], first if k == 0 else Dataset21.open(folders[k]), cameras)
    found = [_dataset_cameras(src, n, first if k == 0 else Dataset21.open(f), cameras)
             for k, (n, f) in enumerate(zip(labels, folders))]
    kinds: dict[tuple[Any, ...], BundleCameras] = {}
    for cams in found:
        kinds.setdefault(cams.signature(), cams)
    if len(kinds) > 1:
        a, b = list(kinds.values())[:2]
        raise ValueError(f"{root}: the bundle's datasets differ in their cameras ({a.shown()}; {b.shown()}); "
                         f"pick the dataset the export describes with --dataset NAME (one of {_shown(labels)})")
    return found[0]


def bundle_normalization(run: Run, state: dict[str, Any], where: str,
                         dataset: str | None = None) -> tuple[ActionStats, dict[str, Any]]:
    """(the statistics in the source columns, ``normalization.json``'s record) of a bundle run, for the source
    ``dataset`` names (:func:`export_source`): the model-space q01 / q99 it trained with (:func:`trained_stats`)
    taken at its action channels (see the module docstring)."""
    from flexpack.data.normalization import ActionStats

    conv = run.family.conventions(run.model_config)
    src = export_source(run, dataset)
    used = list(src.channels)
    model = trained_stats(run, state, where, src)
    if model is None:
        model = ActionStats(mode="none", low=(0.0,) * conv.action_dim, high=(1.0,) * conv.action_dim)
    cols = ActionStats(mode=model.mode, low=tuple(model.low[c] for c in used), high=tuple(model.high[c] for c in used))
    record = {"action_key": "action", **model.to_json(), "space": "model", "action_dim": conv.action_dim,
              "columns": len(used), "channels": used, "column_low": list(cols.low), "column_high": list(cols.high),
              "action_steps": run.config.data.action_steps, "dataset": str(src.root), "format": "lingbot-bundle",
              "formula": FORMULA if model.mode == "quantile" else "x"}
    if src.entry is not None:
        record["entry"] = src.name  # the [[data.datasets]] entry these statistics and channels are of
    return cols, record


def trained_stats(run: Run, state: dict[str, Any], where: str, src: ExportSource) -> ActionStats | None:
    """The model-space statistics ``src`` trained with: the checkpoint's (a mixture entry's own record, else the
    statistics its entries shared), else (a checkpoint that records none) computed from the data as training
    computed them; None for a run without normalization."""
    from flexpack.data.normalization import ActionStats
    from flexpack.run.state.resume import saved_entry_stats, saved_stats

    conv = run.family.conventions(run.model_config)
    if src.entry is None:
        model = saved_stats(state, where, width=conv.action_dim)
        if model is None and run.config.data.normalize:  # a checkpoint without statistics: the bundle's own
            from flexpack.run.build import open_bundle

            model = ActionStats.of(open_bundle(run.config, conv, text_dropout=False).normalizer)
        return model
    per = saved_entry_stats(state, where, entries=len(run.config.data.datasets), width=conv.action_dim)
    if per is not None:
        if per[src.entry] is None and run.config.data.normalize:
            raise ValueError(f"{where}: data.datasets entry {src.name!r} had no item in the training split (the run "
                             "never trained on it); export another entry")
        return per[src.entry]
    model = saved_stats(state, where, width=conv.action_dim)  # written before per-entry records: shared ones
    if model is None and run.config.data.normalize:
        from flexpack.run.build import open_mixture

        print(f"export: {where} records no per-entry statistics (an older checkpoint); computing {src.name!r}'s "
              "from its data as training did", file=sys.stderr)
        model = ActionStats.of(open_mixture(run.config, conv, text_dropout=False).entry_normalizers[src.entry])
    return model


def check_steps(run: Run, dataset: str | None = None) -> None:
    """``action_per_frame`` LeRobot's policy can run on the bundle's encoding (before any weight is read): a multiple
    of the VAE's 4 frames, 4 x the latents' ``frame_ids`` stride."""
    apf = run.model_config.action_per_frame
    if apf % VAE_STRIDE:
        raise ValueError(f"--format lerobot: action_per_frame = {apf}, but LeRobot's lingbot_va policy encodes "
                         f"{VAE_STRIDE} keyframes per latent frame, one every action_per_frame // {VAE_STRIDE} "
                         f"actions: action_per_frame must be a multiple of {VAE_STRIDE}")
    _check_stride(bundle_cameras(run, dataset), apf)


def _check_stride(cams: BundleCameras, apf: int) -> None:
    if VAE_STRIDE * cams.stride != apf:
        raise ValueError(f"--format lerobot: {cams.dataset}'s latents encode video frames {cams.stride} apart "
                         f"(frame_ids stride {cams.stride}: {VAE_STRIDE * cams.stride} action steps a latent frame), "
                         f"but action_per_frame = {apf}: LeRobot's lingbot_va policy encodes a keyframe every "
                         f"action_per_frame // {VAE_STRIDE} = {max(1, apf // VAE_STRIDE)} actions")


def lerobot_layout(run: Run, stats: ActionStats, dataset: str | None = None) -> dict[str, Any]:
    """The dataset-side fields of a LeRobot ``lingbot_va`` policy of a bundle run: ``obs_cam_keys``,
    ``camera_layout`` (flexpack's name of the composition: the family's export writes LeRobot's), ``height``,
    ``width``, the input and output features; one line for what the policy cannot represent (the module
    docstring)."""
    from lerobot.configs.types import FeatureType, PolicyFeature

    model_cfg = run.model_config
    if stats.mode != "quantile":
        raise ValueError(f"--format lerobot: the run normalized its actions with {stats.mode!r} statistics, but "
                         "LeRobot's lingbot_va postprocessor maps actions with q01 / q99 (QUANTILES)")
    src = export_source(run, dataset)
    cams = _source_cameras(src)
    names, grids = list(cams.frames), cams.grids
    used = list(src.channels)
    if cams.columns != len(used):
        own = src.entry is not None and run.config.data.datasets[src.entry].action_channels is not None
        field = f"data.datasets[{src.entry}].action_channels" if own else "used_action_channel_ids"
        raise ValueError(f"{cams.info_file}: 'action' has {cams.columns} columns, but {field} = {used} places "
                         f"{len(used)}: the actions do not map onto the policy's output")
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
            "used_action_channel_ids": used, "input_features": inputs, "output_features": outputs}
