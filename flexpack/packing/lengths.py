"""Latent frames from video frames, and frames files of video frame counts.

The Wan VAE is causal in time with stride 4: the first latent frame encodes video frame 0
alone, every later latent frame encodes the next ``stride`` video frames. An episode of ``n``
video frames therefore has ``F = (n - 1) // stride + 1`` latent frames; the trailing
``(n - 1) % stride`` video frames do not fill a latent frame and are dropped.

A frames file lists video frame counts, one per line; ``#`` starts a comment, blank lines are
skipped.
"""

from __future__ import annotations

import os
from pathlib import Path


def latent_frames(n: int, stride: int = 4) -> int:
    """Latent frames of an episode of ``n >= 1`` video frames (``(n - 1) // stride + 1``)."""
    if n < 1:
        raise ValueError(f"an episode needs at least 1 video frame, got n={n}")
    if stride < 1:
        raise ValueError(f"stride must be >= 1, got {stride}")
    return (n - 1) // stride + 1


def used_video_frames(n: int, stride: int = 4) -> int:
    """Video frames the encoder consumes: ``stride * (F - 1) + 1`` (the rest are dropped)."""
    return stride * (latent_frames(n, stride) - 1) + 1


def read_frames_file(path: str | os.PathLike[str], stride: int = 4) -> list[int]:
    """Latent frames per episode from a file of video frame counts (see module docstring).

    Raises ``ValueError`` naming the file (and line) when it is unreadable, holds a line that is
    not a positive integer, or holds no episode at all."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{path}: cannot read frames file: {e}") from None
    out = []
    for no, line in enumerate(text.splitlines(), 1):
        body = line.split("#", 1)[0].strip()
        if not body:
            continue
        try:
            n = int(body)
        except ValueError:
            raise ValueError(f"{path}:{no}: expected a video frame count (integer), got {body!r}") from None
        if n < 1:
            raise ValueError(f"{path}:{no}: video frame count must be >= 1, got {n}")
        out.append(latent_frames(n, stride))
    if not out:
        raise ValueError(f"{path}: no episode lengths found")
    return out
