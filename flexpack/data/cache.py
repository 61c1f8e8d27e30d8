"""The latent cache on disk: one safetensors file per episode and camera set, one per task text.

Layout (``latents_dir`` defaults to ``ROOT/latents``)::

    latents_dir/video/<camera tag>/episode_000007.safetensors   tensor "latent" (C, F, H, W) bf16
    latents_dir/text/task_000002.safetensors                    tensor "text" (L, Dt) bf16

The camera tag joins the cameras' short names (``observation.images.wrist`` -> ``wrist``) with
``+`` in the order they are combined along width, so several camera sets can be cached side by
side. Every file carries its description in the safetensors header metadata (strings only):
video files record ``episode_index, frames, channels, height, width, fps, encoder, cameras``
(JSON list of feature keys), ``video_frames`` (the episode's video frame count) and ``stride``;
text files record ``encoder, task, task_index, text_len``. Writes are atomic (temporary name in
the same folder, then ``os.replace``), so a crash never leaves a half-written file under the
final name.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from flexpack.atomic import atomic_path

LATENT_FORMAT = "flexpack-latent-v1"
TEXT_FORMAT = "flexpack-text-v1"
IMAGE_PREFIX = "observation.images."


def default_latents_dir(root: str | os.PathLike) -> Path:
    return Path(root) / "latents"


def camera_short_name(key: str) -> str:
    return key[len(IMAGE_PREFIX) :] if key.startswith(IMAGE_PREFIX) else key


def camera_tag(cameras: list[str]) -> str:
    if not cameras:
        raise ValueError("at least one camera is needed for the latent cache")
    from flexpack.safenames import safe_component  # a key like "observation.images.." must not climb out

    return safe_component("+".join(camera_short_name(c).replace("/", "_") for c in cameras))


def latent_path(latents_dir: str | os.PathLike, cameras: list[str], episode: int) -> Path:
    return Path(latents_dir) / "video" / camera_tag(cameras) / f"episode_{episode:06d}.safetensors"


def text_path(latents_dir: str | os.PathLike, task_index: int) -> Path:
    return Path(latents_dir) / "text" / f"task_{task_index:06d}.safetensors"


def write_safetensors_atomic(path: Path, tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> None:
    """Write ``tensors`` to ``path`` through a temporary file in the same folder and a rename."""
    from safetensors.torch import save_file

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as tmp:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=metadata)


@dataclass(frozen=True)
class LatentHeader:
    """What a latent file's header says (no tensor data read)."""

    episode_index: int
    frames: int
    channels: int
    height: int
    width: int
    fps: float
    encoder: str
    cameras: list[str]
    video_frames: int
    stride: int
    shape: tuple[int, ...]  # the stored tensor's actual shape

    def to_metadata(self) -> dict[str, str]:
        return {
            "format": LATENT_FORMAT,
            "episode_index": str(self.episode_index),
            "frames": str(self.frames),
            "channels": str(self.channels),
            "height": str(self.height),
            "width": str(self.width),
            "fps": str(self.fps),
            "encoder": self.encoder,
            "cameras": json.dumps(self.cameras),
            "video_frames": str(self.video_frames),
            "stride": str(self.stride),
        }


def write_latent(
    path: Path,
    latent_CFHW: torch.Tensor,
    *,
    episode_index: int,
    fps: float,
    encoder: str,
    cameras: list[str],
    video_frames: int,
    stride: int,
) -> LatentHeader:
    if latent_CFHW.ndim != 4:
        raise ValueError(f"{path}: latent must be (C, F, H, W), got shape {tuple(latent_CFHW.shape)}")
    c, f, h, w = latent_CFHW.shape
    header = LatentHeader(episode_index, f, c, h, w, float(fps), encoder, list(cameras), video_frames, stride,
                          (c, f, h, w))
    write_safetensors_atomic(path, {"latent": latent_CFHW.to(torch.bfloat16)}, header.to_metadata())
    return header


def _read_header(path: Path, tensor: str, fmt: str) -> tuple[dict[str, str], tuple[int, ...]]:
    """Header metadata and the shape of ``tensor`` (no data read); ValueError unless a ``fmt`` file."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if tensor not in f.keys():
                raise ValueError(f"has no tensor {tensor!r} (tensors: {sorted(f.keys())})")
            shape = tuple(f.get_slice(tensor).get_shape())
    except ValueError:
        raise
    except Exception as exc:  # safetensors raises its own error types for corrupt headers
        raise ValueError(f"cannot be read as safetensors: {exc}") from exc
    if meta.get("format") != fmt:
        raise ValueError(f"header format is {meta.get('format')!r}, expected {fmt!r}")
    return meta, shape


def read_latent_header(path: Path) -> LatentHeader:
    """Parse a latent file's header. Raises ValueError (naming the file) if it is not one."""
    meta, shape = _read_header(path, "latent", LATENT_FORMAT)
    try:
        return LatentHeader(
            episode_index=int(meta["episode_index"]),
            frames=int(meta["frames"]),
            channels=int(meta["channels"]),
            height=int(meta["height"]),
            width=int(meta["width"]),
            fps=float(meta["fps"]),
            encoder=meta["encoder"],
            cameras=list(json.loads(meta["cameras"])),
            video_frames=int(meta["video_frames"]),
            stride=int(meta["stride"]),
            shape=shape,
        )
    except (KeyError, ValueError, TypeError) as exc:
        raise ValueError(f"header metadata is incomplete or malformed ({exc!r})") from exc


def read_tensor(path: Path, name: str) -> torch.Tensor:
    """Load one tensor as float32. Raises ValueError naming the file on truncated data."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            tensor = f.get_tensor(name)
    except Exception as exc:
        raise ValueError(f"tensor {name!r} cannot be read: {exc}") from exc
    if not tensor.is_floating_point():  # an int8 cache would train on integers, silently
        raise ValueError(f"tensor {name!r} has dtype {str(tensor.dtype).removeprefix('torch.')}; the cache holds "
                         "floating-point values (re-encode it with flexpack encode)")
    return tensor.to(torch.float32)


@dataclass(frozen=True)
class TextHeader:
    encoder: str
    task: str
    task_index: int
    text_len: int
    shape: tuple[int, ...]


def write_text(path: Path, text_LD: torch.Tensor, *, encoder: str, task: str, task_index: int, text_len: int) -> None:
    if text_LD.ndim != 2:
        raise ValueError(f"{path}: text embedding must be (L, Dt), got shape {tuple(text_LD.shape)}")
    meta = {
        "format": TEXT_FORMAT,
        "encoder": encoder,
        "task": task,
        "task_index": str(task_index),
        "text_len": str(text_len),
    }
    write_safetensors_atomic(path, {"text": text_LD.to(torch.bfloat16)}, meta)


def read_text_header(path: Path) -> TextHeader:
    meta, shape = _read_header(path, "text", TEXT_FORMAT)
    try:
        return TextHeader(meta["encoder"], meta["task"], int(meta["task_index"]), int(meta["text_len"]), shape)
    except (KeyError, ValueError) as exc:
        raise ValueError(f"header metadata is incomplete or malformed ({exc!r})") from exc
