"""Write a synthetic upstream LingBot-VA post-training bundle: LeRobot v2.1 metadata and parquet, per-camera
``.pth`` latents per ``action_config`` segment and ``empty_emb.pt`` — the layout ``flexpack.data.bundle`` reads.

For tests and benchmarks: shapes are what the caller asks (RoboTwin-like: three cameras whose latents are 16×20
and two 8×10, 16 action steps a latent frame, 512 × 4096 text), values random from ``seed``.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from flexpack.data.bundle_actions import VAE_STRIDE
from flexpack.data.bundle_files import EMPTY_EMB, latent_file


@dataclass(frozen=True, kw_only=True)
class SyntheticDataset:
    """One v2.1 dataset of a synthetic bundle."""

    name: str
    episodes: list[list[tuple[int, int]]]  # per episode, its action_config segments [start, end) in video frames
    cameras: dict[str, tuple[int, int]] = field(default_factory=lambda: {"observation.images.cam_high": (4, 4)})
    action_columns: int = 16
    stride: int = 1  # video frames between encoded frames (frame_ids' step)
    offset: int = 0  # frame_ids[0] - start of each segment
    tail: int = 8  # parquet rows after the last segment's end


def segment_latent_frames(start: int, end: int, stride: int, offset: int = 0) -> int:
    """Latent frames the VAE makes of video frames start+offset, +stride, ... < end."""
    encoded = len(range(start + offset, end, stride))
    return (encoded - 1) // VAE_STRIDE + 1


def write_dataset(root: Path, spec: SyntheticDataset, *, channels: int, text: tuple[int, int], seed: int) -> Path:
    """Write one dataset under ``root / spec.name``; returns its folder."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    folder = root / spec.name
    (folder / "meta").mkdir(parents=True, exist_ok=True)
    lengths = [max(e for _, e in segs) + spec.tail for segs in spec.episodes]
    features = {"action": {"dtype": "float32", "shape": [spec.action_columns], "names": None}}
    for cam in spec.cameras:
        features[cam] = {"dtype": "video", "shape": [3, 16 * spec.cameras[cam][0], 16 * spec.cameras[cam][1]],
                         "names": ["channels", "height", "width"]}
    for key in ("timestamp", "frame_index", "episode_index", "index", "task_index"):
        features[key] = {"dtype": "int64" if key != "timestamp" else "float32", "shape": [1], "names": None}
    info = {"codebase_version": "v2.1", "robot_type": "synthetic", "total_episodes": len(spec.episodes),
            "total_frames": int(sum(lengths)), "chunks_size": 1000, "fps": 30,
            "data_path": "data/chunk-{episode_chunk:03d}/episode_{episode_index:06d}.parquet",
            "video_path": "videos/chunk-{episode_chunk:03d}/{video_key}/episode_{episode_index:06d}.mp4",
            "features": features}
    (folder / "meta" / "info.json").write_text(json.dumps(info, indent=2))
    rows, index = [], 0
    for ep, (segs, n) in enumerate(zip(spec.episodes, lengths)):
        action = rng.normal(size=(n, spec.action_columns)).astype(np.float32)
        table = pa.table({
            "action": pa.array(list(action), type=pa.list_(pa.float32())),
            "timestamp": pa.array(np.arange(n, dtype=np.float32) / 30),
            "frame_index": pa.array(np.arange(n)), "episode_index": pa.array(np.full(n, ep)),
            "index": pa.array(np.arange(index, index + n)), "task_index": pa.array(np.zeros(n, dtype=np.int64)),
        })
        index += n
        data = folder / "data" / f"chunk-{ep // 1000:03d}" / f"episode_{ep:06d}.parquet"
        data.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(table, data)
        configs = [{"start_frame": s, "end_frame": e, "action_text": f"task {ep} part {j}"}
                   for j, (s, e) in enumerate(segs)]
        rows.append({"episode_index": ep, "tasks": [f"task {ep}"], "length": n, "action_config": configs})
        for s, e in segs:
            emb = torch.from_numpy(rng.normal(size=text).astype(np.float32)).to(torch.bfloat16)
            ids = list(range(s + spec.offset, e, spec.stride))
            f = (len(ids) - 1) // VAE_STRIDE + 1
            for cam, (h, w) in spec.cameras.items():
                lat = torch.from_numpy(rng.normal(size=(f * h * w, channels)).astype(np.float32)).to(torch.bfloat16)
                path = latent_file(folder, ep // 1000, cam, ep, s, e)
                path.parent.mkdir(parents=True, exist_ok=True)
                torch.save({"latent": lat, "latent_num_frames": f, "latent_height": h, "latent_width": w,
                            "frame_ids": ids, "text_emb": emb}, path)
    (folder / "meta" / "episodes.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "meta" / "tasks.jsonl").write_text(json.dumps({"task_index": 0, "task": "synthetic"}) + "\n")
    return folder


def write_bundle(root: str | os.PathLike, datasets: list[SyntheticDataset], *, channels: int = 48,
                 text: tuple[int, int] = (16, 32), seed: int = 0) -> Path:
    """A bundle at ``root``: ``empty_emb.pt`` and every dataset of ``datasets``."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for k, spec in enumerate(datasets):
        write_dataset(root, spec, channels=channels, text=text, seed=seed * 1000 + k)
    empty = torch.from_numpy(np.random.default_rng(seed + 7).normal(size=text).astype(np.float32))
    torch.save(empty.to(torch.bfloat16), root / EMPTY_EMB)
    return root
