"""``flexpack check-dataset``: list every problem of a LeRobot dataset and its latent cache.

Runs the inspections of ``flexpack.data.problems`` on every episode and task (the same ones
``LatentEpisodeDataset`` raises on at load time) plus the checks only a whole pass can make
(latent (C, H, W) equal across episodes, action rows present, statistics that can be right).
Prints one line per problem, naming kind, episode and file; exits 1 if there is any, else 0 with
a summary line. When the latent headers record another temporal stride than ``--stride``, a first
line says which.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from flexpack.data import cache
from flexpack.data.episodes import EpisodeSource
from flexpack.data.problems import DatasetProblemError, Problem, inspect_latent, inspect_text, resolve_cameras
from flexpack.errors import one_line


def _cameras(source: EpisodeSource, cameras: list[str] | None) -> tuple[list[str], list[Problem]]:
    """Feature keys of the camera set, or (no keys) a problem for each camera the dataset lacks:
    a cache for a camera set that cannot exist is not checked file by file."""
    keys, problems = [], []
    for group in [cameras] if not cameras else [[c] for c in cameras]:
        try:
            keys += resolve_cameras(source.video_keys, group, source.info_file)
        except DatasetProblemError as exc:
            problems.append(exc.problem)
    return ([] if problems else keys), problems


def check_dataset(
    root: str | os.PathLike,
    *,
    latents_dir: str | os.PathLike | None = None,
    cameras: list[str] | None = None,
    stride: int = 4,
    action_key: str = "action",
    action_stats: str = "pooled",
    progress: bool = False,
) -> tuple[list[Problem], EpisodeSource]:
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    source = EpisodeSource(root)
    out_dir = Path(latents_dir) if latents_dir is not None else cache.default_latents_dir(source.root)
    cams, problems = _cameras(source, cameras)
    if not cams:
        return problems, source
    if action_key not in source.meta.features:
        problems.append(Problem("shape", None, source.info_file, f"no feature {action_key!r} in the dataset"))
        return problems, source
    # with data.action_stats = "lerobot" train normalizes actions with LeRobot's statistics; the pooled
    # default computes its own (LATENTS/stats.json, or on the spot), so meta/stats.json is optional then
    if action_stats == "lerobot" and not (source.meta.stats or {}).get(action_key):
        problems.append(Problem("missing", None, source.root / "meta" / "stats.json",
                                f"no {action_key!r} statistics: train with data.action_stats = 'lerobot' and "
                                "data.normalize = true needs them; restore meta/stats.json, or train with "
                                "data.action_stats = 'pooled' or data.normalize = false"))

    users: dict[int, list[int]] = {}  # task index -> episodes annotated with it (every subtask counts)
    for ep in source.episodes:
        for _, task_index in source.episode_tasks(ep):
            users.setdefault(task_index, []).append(ep)
    for task_index, task in source.tasks().items():
        if task_index not in users:
            continue
        found, _, _ = inspect_text(cache.text_path(out_dir, task_index), episode=users[task_index][0], task=task,
                                   task_index=task_index)
        for p in found:
            problems.append(Problem(p.kind, p.episode, p.file,
                                    f"{p.message} (task used by episodes {users[task_index]})"))

    rows = source.row_counts()
    reference: tuple[int, tuple[int, int, int]] | None = None  # (episode, (C, H, W)) of the first good latent
    frames_of = dict(zip(source.episodes, source.video_frames))
    encoded: dict[int, list[int]] = {}  # stride recorded in the latent headers -> episodes
    for ep in tqdm(source.episodes, desc="check", unit="ep", disable=not progress):
        path = cache.latent_path(out_dir, cams, ep)
        n_rows = rows.get(ep, 0)
        if n_rows == 0:
            problems.append(Problem("shape", ep, source.data_file(ep),
                                    f"episode has no {action_key!r} rows in the data"))
        found, latent, head = inspect_latent(
            path, episode=ep, video_frames=frames_of[ep], cameras=cams, stride=stride,
            action_rows=n_rows or None,
        )
        problems += found
        if head is not None:
            encoded.setdefault(head.stride, []).append(ep)
        if latent is not None and not found:
            chw = (head.channels, head.height, head.width)
            if reference is None:
                reference = (ep, chw)
            elif chw != reference[1]:
                problems.append(Problem("shape", ep, path, f"latent (C, H, W) = {chw} differs from episode "
                                                         f"{reference[0]}'s {reference[1]}; items cannot be batched"))
        if n_rows:
            actions = source.column(ep, action_key).astype(np.float64)
            bad = int((~np.isfinite(actions)).sum())
            if bad:
                problems.append(Problem("nonfinite", ep, source.data_file(ep),
                                        f"{action_key!r} has {bad} NaN/Inf values"))
    if not any(p.kind == "nonfinite" for p in problems):  # statistics over NaN are refused as such already
        problems += stats_problems(source, out_dir)
    other = {s: eps for s, eps in encoded.items() if s != stride}
    if other:  # one line saying why every episode's frame count is off, before the per-episode lines
        said = ", ".join(f"stride {s} ({len(eps)} episode(s), e.g. {eps[0]})" for s, eps in sorted(other.items()))
        common = max(other, key=lambda s: len(other[s]))
        problems.insert(0, Problem("frames", None, out_dir, f"the cache was encoded with {said}, checked with "
                                                            f"stride {stride}; pass --stride {common} "
                                                            "or re-encode the cache"))
    return problems, source


def stats_problems(source: EpisodeSource, latents: Path) -> list[Problem]:
    """Statistics that cannot be right (:mod:`flexpack.data.stats_check`): the pooled ones training uses by
    default (``LATENTS/stats.json``, or computed where it is missing or stale) and LeRobot's
    (``meta/stats.json``, used with ``data.action_stats = "lerobot"`` and by ``sample``'s mean baseline)."""
    from flexpack.data import action_stats

    out = []
    for file, read in ((action_stats.stats_path(latents), lambda: action_stats.pooled(source, latents)),
                       (source.root / "meta" / "stats.json", lambda: action_stats.lerobot_stats(source))):
        try:
            read()
        except ValueError as exc:
            text = one_line(exc)
            out.append(Problem("stats", None, file, text.split(": ", 1)[1] if text.startswith(str(file)) else text))
    return out
