"""Every problem of a dataset and its latent cache, as records and as exceptions.

``check-dataset`` collects :class:`Problem` records for all episodes; ``LatentEpisodeDataset``
runs the same inspections on the item it loads and raises ``problem.error()``. Kinds:

=========== ============================================ =========================
kind        meaning                                      exception
=========== ============================================ =========================
missing     latent or text file does not exist           ``MissingFileError`` (FileNotFoundError)
unreadable  not safetensors / truncated / bad header /   ``UnreadableFileError`` (ValueError)
            holds another episode or task
frames      latent frames != latent_frames(metadata len) ``FramesMismatchError`` (ValueError)
shape       latent vs actions (video frames, F), latent  ``ShapeMismatchError`` (ValueError)
            vs its header, or (C, H, W) across episodes
nonfinite   NaN/Inf in a latent, text or action          ``NonFiniteError`` (ValueError)
camera      a camera asked for is not in the dataset or  ``CameraMissingError`` (ValueError)
            not in the latent file
stats       statistics that cannot be right (NaN,        ``StatsError`` (ValueError)
            swapped quantiles, a width below the floor:
            :mod:`flexpack.data.stats_check`)
=========== ============================================ =========================
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from flexpack.data import cache
from flexpack.data.lengths import latent_frames


class DatasetProblemError(Exception):
    """Base of every dataset/cache error; ``.problem`` holds the record (file, episode, kind)."""

    problem: "Problem"


class MissingFileError(DatasetProblemError, FileNotFoundError):
    pass


class UnreadableFileError(DatasetProblemError, ValueError):
    pass


class FramesMismatchError(DatasetProblemError, ValueError):
    pass


class ShapeMismatchError(DatasetProblemError, ValueError):
    pass


class NonFiniteError(DatasetProblemError, ValueError):
    pass


class CameraMissingError(DatasetProblemError, ValueError):
    pass


class StatsError(DatasetProblemError, ValueError):
    pass


ERRORS: dict[str, type[DatasetProblemError]] = {
    "missing": MissingFileError,
    "unreadable": UnreadableFileError,
    "frames": FramesMismatchError,
    "shape": ShapeMismatchError,
    "nonfinite": NonFiniteError,
    "camera": CameraMissingError,
    "stats": StatsError,
}


@dataclass(frozen=True)
class Problem:
    kind: str
    episode: int | None
    file: Path | None
    message: str

    def __str__(self) -> str:
        where = "dataset" if self.episode is None else f"episode {self.episode}"
        return f"[{self.kind}] {where}: {self.file if self.file is not None else '-'}: {self.message}"

    def error(self) -> DatasetProblemError:
        err = ERRORS[self.kind](str(self))
        err.problem = self
        return err


def raise_first(problems: list[Problem]) -> None:
    if problems:
        raise problems[0].error()


def resolve_cameras(video_keys: list[str], cameras: list[str] | None, info_file: Path) -> list[str]:
    """Full feature keys of ``cameras`` (full keys or short names); all video keys when None."""
    if not video_keys:
        raise Problem("camera", None, info_file, "the dataset has no video features").error()
    if not cameras:
        return list(video_keys)
    by_short = {cache.camera_short_name(k): k for k in video_keys}
    out = []
    for cam in cameras:
        key = cam if cam in video_keys else by_short.get(cam)
        if key is None:
            msg = f"camera {cam!r} is not in the dataset; its cameras are {list(video_keys)}"
            raise Problem("camera", None, info_file, msg).error()
        out.append(key)
    return out


def _missing_latent(path: Path, cameras: list[str]) -> str:
    """Why an episode's latent file is missing, naming the cameras: where the cache holds no latents of these
    cameras at all, the camera sets it does hold and the cameras none of them has."""
    run = f"run `flexpack encode --dataset DATASET --cameras {' '.join(cameras)}`"
    folder, video = path.parent, path.parent.parent
    held = sorted(p.name for p in video.iterdir() if p.is_dir()) if video.is_dir() else []
    if folder.is_dir() or not held:
        return f"latent file does not exist ({run}; cameras {cameras})"
    encoded = {name for tag in held for name in tag.split("+")}
    never = [c for c in cameras if cache.camera_short_name(c).replace("/", "_") not in encoded]
    which = f"camera(s) {never} never encoded" if never else "not joined in this order"
    return (f"latent file does not exist: the cache holds latents of camera set(s) {held} ({video}), none of {cameras} "
            f"joined on width in this order ({which}); {run}")


def inspect_latent(
    path: Path,
    *,
    episode: int,
    video_frames: int,
    cameras: list[str],
    stride: int,
    action_rows: int | None = None,
    load: bool = True,
) -> tuple[list[Problem], torch.Tensor | None, cache.LatentHeader | None]:
    """Check one episode's latent file against the dataset's metadata (and its action rows).

    Returns (problems, latent (C, F, H, W) float32 or None, header or None). Stops at the first
    problem that makes later checks meaningless (missing, unreadable).
    """

    def p(kind: str, msg: str) -> Problem:
        return Problem(kind, episode, path, msg)

    if not path.is_file():
        return [p("missing", _missing_latent(path, cameras))], None, None
    try:
        head = cache.read_latent_header(path)
    except ValueError as exc:
        return [p("unreadable", str(exc))], None, None
    problems: list[Problem] = []
    if head.episode_index != episode:
        problems.append(p("unreadable", f"file holds episode {head.episode_index}, expected {episode}"))
    missing = [c for c in cameras if c not in head.cameras]
    if missing or head.cameras != cameras:
        problems.append(p("camera", f"camera(s) {missing or cameras} missing: file holds cameras {head.cameras}, "
                                    f"expected {cameras}"))
    stated = (head.channels, head.frames, head.height, head.width)
    if len(head.shape) != 4 or tuple(head.shape) != stated:
        problems.append(p("shape", f"latent tensor has shape {head.shape}, its header says (C, F, H, W) = {stated}"))
    want_f = latent_frames(video_frames, stride)
    got_f = head.shape[1] if len(head.shape) == 4 else head.frames
    if got_f != want_f:
        encoded = f"; the file was encoded with stride {head.stride}" if head.stride != stride else ""
        problems.append(p("frames", f"latent has {got_f} frames; metadata length {video_frames} video frames "
                                    f"implies {want_f} (stride {stride}){encoded}"))
    if action_rows is not None:
        if head.video_frames != action_rows or latent_frames(max(action_rows, 1), stride) != got_f:
            problems.append(p("shape", f"latent encodes {head.video_frames} video frames ({got_f} latent frames) "
                                       f"but the episode has {action_rows} action rows "
                                       f"({latent_frames(max(action_rows, 1), stride)} latent frames)"))
    if problems or not load:
        return problems, None, head
    try:
        latent = cache.read_tensor(path, "latent")
    except ValueError as exc:
        return [p("unreadable", str(exc))], None, head
    bad = int((~torch.isfinite(latent)).sum())
    if bad:
        problems.append(p("nonfinite", f"latent has {bad} NaN/Inf values"))
    return problems, latent, head


def inspect_text(
    path: Path, *, episode: int | None, task: str, task_index: int, load: bool = True
) -> tuple[list[Problem], torch.Tensor | None, cache.TextHeader | None]:
    """Check a task's cached text embedding; returns (problems, text (L, Dt) float32, header)."""

    def p(kind: str, msg: str) -> Problem:
        return Problem(kind, episode, path, msg)

    if not path.is_file():
        msg = f"text embedding of task {task_index} ({task!r}) does not exist (run `flexpack encode`)"
        return [p("missing", msg)], None, None
    try:
        head = cache.read_text_header(path)
    except ValueError as exc:
        return [p("unreadable", str(exc))], None, None
    if head.task != task or head.task_index != task_index:
        msg = f"file holds task {head.task_index} {head.task!r}, expected {task_index} {task!r} (stale cache?)"
        return [p("unreadable", msg)], None, head
    if len(head.shape) != 2 or not 0 <= head.text_len <= head.shape[0]:
        msg = f"text tensor has shape {head.shape} and text_len {head.text_len}; expected (L, Dt), text_len <= L"
        return [p("shape", msg)], None, head
    if not load:
        return [], None, head
    try:
        text = cache.read_tensor(path, "text")
    except ValueError as exc:
        return [p("unreadable", str(exc))], None, head
    bad = int((~torch.isfinite(text)).sum())
    if bad:
        return [p("nonfinite", f"text embedding has {bad} NaN/Inf values")], None, head
    return [], text, head
