"""Annotated segments: the runs of one task inside an episode, and the latent frames they get.

LeRobot v3 stores a ``task_index`` for every frame. An episode annotated with several subtasks
has several *task runs*: maximal runs of consecutive frames with the same ``task_index``. A
segment is one such run, video frames ``[start, stop)``.

Latent frames of a segment (temporal stride ``s``, 4 for the Wan VAE). Latent frame 0 covers
video frame 0 alone; latent frame ``f >= 1`` covers video frames ``s(f − 1) + 1 … s·f``. A segment
gets exactly the latent frames whose covered video frames all fall inside ``[start, stop)``::

    f0 = 0                              if start == 0
         (start + s − 2) // s + 1       otherwise   (first f with s(f − 1) + 1 >= start)
    f1 = (stop − 1) // s + 1                        (one past the last f with s·f <= stop − 1)

so the item is ``latent[:, f0:f1]`` of the episode's cached latent and the episode's aligned
actions ``[:, f0:f1]`` (every step of those frames is a video frame inside the segment; see
``flexpack.data.actions``). Consequences, by design:

* a latent frame whose video frames straddle a task boundary belongs to neither segment (its
  frames show two tasks), and the trailing ``(n − 1) % s`` frames of an episode belong to none;
* a run too short to hold one whole latent frame (``f1 <= f0``) yields no segment;
* the slice is the episode's latent: frames after the first were encoded with the episode's
  earlier frames as causal context, not re-encoded from the segment alone.

Segment numbers are the run's position in the episode (0-based), so a skipped short run leaves
a gap in the numbering.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flexpack.data.lengths import latent_frames


def task_runs(task_index_T: np.ndarray) -> list[tuple[int, int, int]]:
    """Maximal runs of equal values: ``[(start, stop, task_index), …]`` covering all T frames."""
    t = np.asarray(task_index_T).reshape(-1)
    if t.size == 0:
        return []
    cuts = (np.flatnonzero(t[1:] != t[:-1]) + 1).tolist()
    bounds = [0, *cuts, int(t.size)]
    return [(a, b, int(t[a])) for a, b in zip(bounds[:-1], bounds[1:])]


def segment_latent_range(start: int, stop: int, stride: int = 4) -> tuple[int, int]:
    """Latent frames ``[f0, f1)`` whose covered video frames lie inside ``[start, stop)``.

    Empty (``f1 <= f0``) when the run holds no whole latent frame.
    """
    if not 0 <= start < stop or stride < 1:
        raise ValueError(f"need 0 <= start < stop and stride >= 1, got start={start}, stop={stop}, stride={stride}")
    f0 = 0 if start == 0 else (start + stride - 2) // stride + 1
    return f0, latent_frames(stop, stride)


@dataclass(frozen=True)
class Segment:
    """One annotated segment of an episode (see the module docstring for the frame rule)."""

    episode: int
    segment: int  # the task run's position in the episode
    task_index: int
    start: int  # video frames [start, stop)
    stop: int
    f0: int  # latent frames [f0, f1) of the episode's latent
    f1: int

    @property
    def frames(self) -> int:
        return self.f1 - self.f0


def episode_segments(episode: int, task_index_T: np.ndarray, stride: int = 4) -> list[Segment]:
    """The episode's segments that hold at least one whole latent frame, in frame order."""
    out = []
    for j, (start, stop, task) in enumerate(task_runs(task_index_T)):
        f0, f1 = segment_latent_range(start, stop, stride)
        if f1 > f0:
            out.append(Segment(episode, j, task, start, stop, f0, f1))
    return out
