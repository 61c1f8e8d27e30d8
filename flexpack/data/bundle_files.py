"""The files of an upstream LingBot-VA post-training bundle, read in place and without running code.

A bundle is a root folder with ``empty_emb.pt`` and one or many LeRobot v2.1 datasets (any depth; each found by
its ``meta/info.json``). Each dataset holds, beside its metadata and parquet files, pre-extracted Wan2.2 latents
per camera and ``action_config`` segment::

    DATASET/latents/chunk-XXX/<camera key>/episode_XXXXXX_<start>_<end>.pth

a ``torch.save``d dict: ``latent`` ``(f·h·w, c)``, ``latent_num_frames`` f, ``latent_height`` h,
``latent_width`` w, ``frame_ids`` (the video frames the VAE saw) and ``text_emb`` (the segment's umT5
embedding, ``(L, Dt)``). Every ``.pth`` is loaded with ``torch.load(weights_only=True)`` (memory-mapped where
only its small fields are read); a file that needs code to load is refused naming it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

EMPTY_EMB = "empty_emb.pt"
LATENT_KEYS = ("latent", "latent_num_frames", "latent_height", "latent_width", "frame_ids")


class RefusedFileError(ValueError):
    """A file that would run code to load: refused even where missing files are skipped."""


def find_datasets(root: str | os.PathLike) -> list[Path]:
    """Every dataset folder under ``root`` (``root`` itself included), sorted; never inside a found one."""
    root = Path(root)
    found: list[Path] = []
    for dirpath, dirnames, _ in os.walk(root):
        here = Path(dirpath)
        if (here / "meta" / "info.json").is_file():
            found.append(here)
            dirnames[:] = []  # datasets do not nest; latents/ and data/ hold no other dataset
            continue
        dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
    return sorted(found)


def latent_file(dataset: Path, chunk: int, camera: str, episode: int, start: int, end: int) -> Path:
    return dataset / "latents" / f"chunk-{chunk:03d}" / camera / f"episode_{episode:06d}_{start}_{end}.pth"


def load_pth(path: Path, *, mmap: bool = False) -> Any:
    """``torch.load(path, weights_only=True)``; one line naming the file when it is missing, truncated or needs
    code to load."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except FileNotFoundError:
        raise ValueError(f"{path}: no such file") from None
    except Exception as exc:  # UnpicklingError (code, or a bad pickle), RuntimeError (zip), EOFError, ...
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if "weights_only" in str(exc) or "Unsupported global" in str(exc):
            raise RefusedFileError(f"{path}: refused: loading it would run code ({first[:160]}); bundle files hold "
                             "tensors, numbers and lists only") from None
        raise ValueError(f"{path}: cannot be read as a torch file ({type(exc).__name__}: {first[:160]})") from None


def _int(value: Any, key: str, path: Path) -> int:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != int(value) or value < 1:
        raise ValueError(f"{path}: {key} must be a positive integer, got {value!r}")
    return int(value)


@dataclass(frozen=True)
class SegmentLatent:
    """One camera's latent file of a segment: its grid and frame ids (the latent itself loaded on demand)."""

    path: Path
    frames: int
    height: int
    width: int
    channels: int
    frame_ids: list[int]


def read_header(path: Path, *, payload: dict | None = None) -> SegmentLatent:
    """A latent file's fields, checked (the latent tensor only memory-mapped, never read, unless given)."""
    d = load_pth(path, mmap=True) if payload is None else payload
    if not isinstance(d, dict):
        raise ValueError(f"{path}: expected a dict with {list(LATENT_KEYS)}, got {type(d).__name__}")
    missing = [k for k in LATENT_KEYS if k not in d]
    if missing:
        raise ValueError(f"{path}: lacks {missing} (a bundle latent file has {list(LATENT_KEYS)} and text_emb)")
    f, h, w = (_int(d[k], k, path) for k in ("latent_num_frames", "latent_height", "latent_width"))
    lat = d["latent"]
    if not isinstance(lat, torch.Tensor) or lat.ndim != 2:
        raise ValueError(f"{path}: latent must be a 2-d tensor (f*h*w, c), got "
                         f"{tuple(lat.shape) if isinstance(lat, torch.Tensor) else type(lat).__name__}")
    if lat.shape[0] != f * h * w:
        raise ValueError(f"{path}: latent has {lat.shape[0]} rows but latent_num_frames x latent_height x "
                         f"latent_width = {f} x {h} x {w} = {f * h * w}")
    ids = d["frame_ids"]
    ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids) if isinstance(ids, (list, tuple)) else ids
    if not isinstance(ids, list):
        raise ValueError(f"{path}: frame_ids must be a list or tensor of frame indices, got {type(ids).__name__}")
    return SegmentLatent(path, f, h, w, int(lat.shape[1]), ids)


def latent_fhwc(path: Path) -> tuple[torch.Tensor, dict]:
    """A latent file's latent as float32 ``(F, H, W, C)`` and its payload (for its text embedding)."""
    d = load_pth(path)
    head = read_header(path, payload=d)
    lat = d["latent"].float().reshape(head.frames, head.height, head.width, head.channels)
    return lat, d


def text_of(payload: dict, path: Path) -> torch.Tensor:
    """A payload's ``text_emb`` as float32 ``(L, Dt)`` (a leading batch dimension of 1 is dropped)."""
    t = payload.get("text_emb")
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{path}: no text_emb tensor (the segment's text embedding)")
    return _as_text(t, path)


def _as_text(t: torch.Tensor, path: Path) -> torch.Tensor:
    if t.ndim == 3 and t.shape[0] == 1:
        t = t[0]
    if t.ndim != 2 or t.shape[0] < 1:
        raise ValueError(f"{path}: a text embedding must be (L, Dt) or (1, L, Dt), got {tuple(t.shape)}")
    if not torch.isfinite(t).all():
        raise ValueError(f"{path}: the text embedding has NaN/Inf values")
    return t.float()


def empty_embedding(root: Path, path: str | os.PathLike | None = None) -> torch.Tensor:
    """The unconditional text embedding (``ROOT/empty_emb.pt`` unless ``path``), ``(L, Dt)`` float32."""
    file = Path(path) if path else root / EMPTY_EMB
    if not file.is_file():
        raise ValueError(f"{file}: no such file (a bundle's unconditional text embedding, empty_emb.pt)")
    t = load_pth(file)
    if isinstance(t, dict):  # some writers wrap it
        t = t.get("text_emb", t.get("emb"))
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{file}: expected a tensor (L, Dt), got {type(t).__name__}")
    return _as_text(t, file)
