"""``flexpack encode``: decode a LeRobot dataset's videos through lerobot, encode, fill the cache.

Resumable: an episode whose latent file exists, passes the same inspection as
``check-dataset`` (readable, right episode/cameras/frames, finite) and was written by the same
encoder is skipped; anything else is (re)written atomically. Task texts likewise.

Several processes: under ``torchrun --nproc_per_node N -m flexpack.cli encode ...`` rank ``r``
encodes the episodes at positions ``r, r+N, ...`` of the list (each file is written by exactly one
rank, with the same encoder and inputs as one process would: the cache is the same), on
``cuda:LOCAL_RANK`` where ``--device cuda``. Rank 0 encodes the task texts and writes the pooled
action statistics (:mod:`flexpack.data.action_stats`, ``LATENTS/stats.json``). A rerun with any
number of ranks resumes where the last one stopped.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from tqdm import tqdm

from flexpack.data import action_stats, cache
from flexpack.data.encoders import VideoEncoder, encode_cameras, make_video_encoder
from flexpack.data.episodes import EpisodeSource
from flexpack.data.lengths import used_video_frames
from flexpack.data.problems import inspect_latent, inspect_text, resolve_cameras
from flexpack.data.text import TextEncoder, encode_texts, make_text_encoder


@dataclass
class EncodeReport:
    encoded: list[int] = field(default_factory=list)
    skipped: list[int] = field(default_factory=list)
    texts_written: list[int] = field(default_factory=list)
    latents_dir: Path | None = None
    cameras: list[str] = field(default_factory=list)
    stats_file: Path | None = None
    frames: int = 0  # video frames decoded and encoded


def _encode_texts(source: EpisodeSource, txt: TextEncoder, out_dir: Path, report: EncodeReport, *,
                  batch_size: int, progress: bool) -> None:
    todo_texts = []
    for task_index, task in source.tasks().items():
        path = cache.text_path(out_dir, task_index)
        problems, _, head = inspect_text(path, episode=None, task=task, task_index=task_index)
        if problems or head.encoder != txt.name:
            todo_texts.append((task_index, task))
    bs = max(1, batch_size)
    for i in tqdm(range(0, len(todo_texts), bs), desc=f"text {txt.name}", unit="batch",
                  disable=not progress or not todo_texts):
        chunk = todo_texts[i : i + bs]
        for (task_index, task), (emb, n) in zip(chunk, encode_texts(txt, [t for _, t in chunk], bs)):
            cache.write_text(cache.text_path(out_dir, task_index), emb, encoder=txt.name, task=task,
                             task_index=task_index, text_len=n)
            report.texts_written.append(task_index)


def encode_dataset(
    root: str | os.PathLike,
    *,
    encoder: str | VideoEncoder = "pool",
    text_encoder: str | TextEncoder = "hash",
    cameras: list[str] | None = None,
    latents_dir: str | os.PathLike | None = None,
    episodes: list[int] | None = None,
    video_backend: str = "pyav",
    device: str = "cpu",
    progress: bool = True,
    text_device: str = "cpu",
    text_batch_size: int = 16,
    text_max_len: int = 512,
    dtype: str = "float32",
    tiling: bool = False,
    slicing: bool = False,
    tile_size: int = 256,
    rank: int = 0,
    world_size: int = 1,
) -> EncodeReport:
    """Fill the latent cache of ``root`` (see the module docstring); ``rank`` of ``world_size``
    processes encodes every ``world_size``-th episode."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
    source = EpisodeSource(root, video_backend=video_backend)
    enc = (make_video_encoder(encoder, device=device, dtype=dtype, tiling=tiling, slicing=slicing, tile_size=tile_size)
           if isinstance(encoder, str) else encoder)
    cams = resolve_cameras(source.video_keys, cameras, source.info_file)
    out_dir = Path(latents_dir) if latents_dir is not None else cache.default_latents_dir(source.root)
    report = EncodeReport(latents_dir=out_dir, cameras=cams)
    from flexpack.atomic import remove_dead_temporaries  # half-written files of a killed encode

    for folder in (out_dir / "text", cache.latent_path(out_dir, cams, 0).parent):
        remove_dead_temporaries(folder, ".*.tmp-*")

    if rank == 0:  # task texts are rank 0's: the other ranks never load the (large) text encoder
        txt = (make_text_encoder(text_encoder, device=text_device, max_len=text_max_len)
               if isinstance(text_encoder, str) else text_encoder)
        _encode_texts(source, txt, out_dir, report, batch_size=text_batch_size, progress=progress)

    frames_of = dict(zip(source.episodes, source.video_frames))
    todo = (list(source.episodes) if episodes is None else list(episodes))[rank::world_size]
    desc = f"encode {enc.name} {cache.camera_tag(cams)}" + (f" rank {rank}/{world_size}" if world_size > 1 else "")
    bar = tqdm(todo, desc=desc, unit="ep", disable=not progress)
    for episode in bar:
        n = frames_of[episode]
        path = cache.latent_path(out_dir, cams, episode)
        problems, _, head = inspect_latent(path, episode=episode, video_frames=n, cameras=cams, stride=enc.stride)
        if not problems and head is not None and head.encoder == enc.name:
            report.skipped.append(episode)
            continue
        used = used_video_frames(n, enc.stride)
        videos = [source.decode(episode, cam, used) for cam in cams]
        try:
            latent = encode_cameras(enc, videos, cams)
        except ValueError as exc:
            raise ValueError(f"{source.root}: episode {episode}, cameras {cams}: {exc}") from exc
        cache.write_latent(
            path, latent, episode_index=episode, fps=source.meta.fps, encoder=enc.name,
            cameras=cams, video_frames=n, stride=enc.stride,
        )
        report.encoded.append(episode)
        report.frames += used * len(cams)
    if rank == 0:  # from the parquet data alone: no need to wait for the other ranks' latents
        try:
            stats = action_stats.compute(source)
            action_stats.check(stats, source, f"the statistics computed from {source.root}")
            report.stats_file = action_stats.write(out_dir, stats)
        except ValueError as exc:  # NaN/Inf actions, a width below the floor: the latents stay; check-dataset says
            print(f"warning: no pooled statistics written: {exc}", file=sys.stderr)
    return report
