"""``flexpack check-dataset`` on an upstream LingBot-VA post-training bundle: every segment loaded as training loads
it, problems listed per dataset (missing or unreadable files are skipped and counted, as ``data.missing = "skip"``
would), a table per dataset; ``--dump-item DATASET:EPISODE:SEGMENT OUT.safetensors`` writes one item as the
collate gets it."""

from __future__ import annotations

import argparse
import sys
from collections import Counter, defaultdict
from pathlib import Path

from flexpack.errors import UserError, one_line


def add_arguments(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("lingbot-bundle (data.format, data.camera_layout, ... of a training config)")
    g.add_argument("--format", choices=("auto", "lerobot", "lingbot-bundle"), default="auto",
                   help="what ROOT is (default: a bundle where it holds empty_emb.pt or v2.1 datasets with .pth "
                        "latents)")
    g.add_argument("--camera-layout", choices=("auto", "width_concat", "tshape"), default="auto")
    g.add_argument("--action-dim", type=int, default=30, help="the model's action space (default 30)")
    g.add_argument("--action-channels", type=int, nargs="+", default=None,
                   help="used_action_channel_ids: the channel of each action column (default 0..D-1)")
    g.add_argument("--action-steps", type=int, default=None,
                   help="action steps a latent frame the model takes (checked against every segment's frame_ids)")
    g.add_argument("--norm-stat", default="", help="a JSON file with q01/q99 in the action space (data.norm_stat)")
    g.add_argument("--action-transform", default="", help="data.action_transform, e.g. relative_pose:0,8")
    g.add_argument("--dump-item", nargs=2, metavar=("DATASET:EPISODE:SEGMENT", "OUT.safetensors"), default=None,
                   help="write that item (latent, action, action_mask, text, frame_ids) as the collate gets it")


def open_bundle(args: argparse.Namespace, *, missing: str) -> object:
    from flexpack.data.bundle import BundleDataset
    from flexpack.data.formats import read_norm_stat

    return BundleDataset(args.root, cameras=args.cameras, camera_layout=args.camera_layout,
                         action_dim=args.action_dim, action_channels=args.action_channels,
                         action_steps=args.action_steps, norm_stat=read_norm_stat(args.norm_stat),
                         action_transform=args.action_transform, cfg_prob=0.0, missing=missing,
                         progress=sys.stderr.isatty())


def dump_item(args: argparse.Namespace) -> int:
    """Write one item to a safetensors file (atomically); its description in the header."""
    import json

    import torch

    from flexpack.data.cache import write_safetensors_atomic

    key, out = args.dump_item
    parts = key.rsplit(":", 2)
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        raise UserError(f"--dump-item {key!r}: expected DATASET:EPISODE:SEGMENT, e.g. tasks/a:3:0")
    ds = open_bundle(args, missing="error")
    try:
        item = ds[ds.find(parts[0], int(parts[1]), int(parts[2]))]
    except ValueError as exc:
        raise UserError(one_line(exc)) from exc
    tensors = {k: item[k] for k in ("latent", "action", "action_mask", "text")}
    tensors["frame_ids"] = torch.tensor(item["frame_ids"], dtype=torch.int64)
    meta = {k: json.dumps(item[k]) for k in ("dataset", "episode_index", "segment", "task", "frame_range", "length")}
    meta["layout"] = ds.items[ds.find(parts[0], int(parts[1]), int(parts[2]))].layout
    write_safetensors_atomic(Path(out), tensors, meta)
    shapes = ", ".join(f"{k} {tuple(v.shape)}" for k, v in tensors.items())
    print(f"wrote {out}: {shapes}")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.dump_item:
        return dump_item(args)
    try:
        ds = open_bundle(args, missing="skip")
    except ValueError as exc:
        raise UserError(one_line(exc)) from exc
    problems = list(ds.skipped)
    items = range(len(ds))
    if sys.stderr.isatty():
        from tqdm import tqdm

        items = tqdm(items, desc="loading segments", unit="seg", file=sys.stderr, leave=False)
    for i in items:
        try:
            ds[i]
        except ValueError as exc:
            problems.append((ds.where(ds.items[i]), one_line(exc)))
    for where, why in problems:
        print(f"[problem] {where}: {why}" if not why.startswith(where) else f"[problem] {why}")
    per = defaultdict(list)
    for it in ds.items:
        per[ds.names[it.dataset]].append(it)
    bad = Counter(where.split(":")[0] for where, _ in problems)
    print(f"{'dataset':<32} {'episodes':>8} {'segments':>8} {'frames':>9} {'grid':>7} {'layout':>12} {'problems':>8}")
    for name in ds.names:
        its = per.get(name, [])
        frames = f"{min(i.frames for i in its)}-{max(i.frames for i in its)}" if its else "-"
        grid = "x".join(map(str, ds.grid(its[0]))) if its else "-"
        layout = its[0].layout if its else "-"
        print(f"{name:<32} {len({i.episode for i in its}):>8} {len(its):>8} {frames:>9} {grid:>7} {layout:>12} "
              f"{bad.get(name, 0):>8}")
    if problems:
        print(f"{len(problems)} problem(s) in {len(bad)} dataset(s) of {len(ds.names)}")
        return 1
    print(f"ok: {len(ds.names)} datasets, {len(ds)} segments, cameras {ds.cameras}")
    return 0
