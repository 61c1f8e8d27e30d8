"""A post-training bundle segment's actions as upstream LingBot-VA training shows them to the model.

Given the episode's parquet rows ``[start, end)`` of one ``action_config`` segment and the ``frame_ids`` its
latent file records (the video frames the VAE saw, episode-local, every ``s`` frames)::

    shift  = frame_ids[0] − start          rows before the first encoded frame are dropped
    s      = frame_ids[1] − frame_ids[0]   the video stride of the encoding
    F      = (len(frame_ids) − 1) // 4 + 1 latent frames (the VAE's temporal stride is 4)
    A      = 4·s                           action steps per latent frame (one per video frame)

the rows ``shift:`` get ``A`` zero rows in front (latent frame 0, which covers one video frame, gets zeros)
and are cut to ``F·A`` rows, so latent frame ``f >= 1`` carries the actions of video frames
``frame_ids[0] + A(f−1) … frame_ids[0] + A·f − 1``: the ones that lead to its frames. Every one of the
``F·A`` steps is marked present, frame 0's zeros included, as upstream's loader marks them.

Channels: source column ``i`` goes to model channel ``used_action_channel_ids[i]`` of the ``action_dim``-wide
space; the mask is True there and False on every other channel. Normalization, in the model's space, with
the q01/q99 statistics upstream configs give (``norm_stat``)::

    x' = clip(2·(x − q01) / (q99 − q01 + 1e−6) − 1, −1.5, 1.5) · mask

Optional transform (``relative_pose:C0,C1,...``): each 7-column slice ``[C, C+7)`` holds ``x y z qx qy qz qw``
(scalar-last quaternions) and is made relative to the segment's first kept row: translation minus the first
translation, rotation ``q0⁻¹ ⊗ q`` (both normalized), as upstream's loader does for its RoboTwin data.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

VAE_STRIDE = 4  # the Wan VAE's temporal stride: latent frame f >= 1 covers 4 encoded frames
NORM_EPS = 1e-6
CLIP = 1.5


@dataclass(frozen=True)
class FrameIds:
    """What a segment's ``frame_ids`` say: the first encoded frame, the stride, the latent frames."""

    first: int
    stride: int
    latent_frames: int

    @property
    def steps(self) -> int:  # action steps per latent frame
        return VAE_STRIDE * self.stride


def parse_frame_ids(frame_ids: object, where: str) -> FrameIds:
    """``frame_ids`` checked: at least two, integers, one constant positive stride; ValueError naming ``where``."""
    ids = np.asarray(frame_ids.tolist() if hasattr(frame_ids, "tolist") else frame_ids).reshape(-1)
    if ids.size < 2 or not np.issubdtype(ids.dtype, np.number) or not np.all(ids == np.round(ids)):
        raise ValueError(f"{where}: frame_ids must be at least two integer frame indices, got {ids.tolist()[:8]}")
    ids = ids.astype(np.int64)
    steps = np.diff(ids)
    if steps[0] <= 0 or not np.all(steps == steps[0]):
        raise ValueError(f"{where}: frame_ids must rise by one constant stride, "
                         f"got steps {sorted(set(steps.tolist()))}")
    return FrameIds(int(ids[0]), int(steps[0]), (ids.size - 1) // VAE_STRIDE + 1)


def inverse_channels(used: list[int] | tuple[int, ...], action_dim: int, columns: int, where: str) -> np.ndarray:
    """Per model channel, the source column it reads (``columns`` = none: a zero column, masked)."""
    used = [int(c) for c in used]
    if len(used) != columns:
        raise ValueError(f"{where}: the dataset has {columns} action columns but used_action_channel_ids places "
                         f"{len(used)} ({used}); give one channel per column")
    if len(set(used)) != len(used) or any(not 0 <= c < action_dim for c in used):
        raise ValueError(f"{where}: used_action_channel_ids {used} must be distinct channels in 0..{action_dim - 1}")
    inv = np.full(action_dim, columns, dtype=np.int64)
    inv[used] = np.arange(columns)
    return inv


def parse_transform(spec: str) -> tuple[int, ...]:
    """``"relative_pose:0,8"`` -> (0, 8); ``""`` -> (); ValueError naming ``data.action_transform`` otherwise."""
    if not spec:
        return ()
    name, _, cols = spec.partition(":")
    try:
        starts = tuple(int(c) for c in cols.split(",")) if cols else ()
    except ValueError:
        starts = ()
    if name != "relative_pose" or not starts or any(c < 0 for c in starts):
        raise ValueError(f"data.action_transform = {spec!r}: expected 'relative_pose:C0,C1,...' (each C the first "
                         "column of an x y z qx qy qz qw slice), or '' for none")
    return starts


def _quat_mul(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Hamilton products of scalar-last quaternions, row by row."""
    ax, ay, az, aw = np.moveaxis(a, -1, 0)
    bx, by, bz, bw = np.moveaxis(b, -1, 0)
    return np.stack([aw * bx + ax * bw + ay * bz - az * by,
                     aw * by - ax * bz + ay * bw + az * bx,
                     aw * bz + ax * by - ay * bx + az * bw,
                     aw * bw - ax * bx - ay * by - az * bz], axis=-1)


def relative_pose(x_TD: np.ndarray, starts: tuple[int, ...], where: str) -> np.ndarray:
    """``x_TD`` with each ``[C, C+7)`` pose slice relative to its first row (see the module docstring)."""
    out = np.array(x_TD, dtype=np.float64, copy=True)
    for c in starts:
        if c + 7 > out.shape[1]:
            raise ValueError(f"{where}: data.action_transform's pose slice [{c}, {c + 7}) exceeds the "
                             f"{out.shape[1]} action columns")
        pose = out[:, c:c + 7]
        q = pose[:, 3:7] / np.linalg.norm(pose[:, 3:7], axis=1, keepdims=True)
        q0_inv = q[:1] * np.array([-1.0, -1.0, -1.0, 1.0])
        out[:, c:c + 3] = pose[:, :3] - pose[:1, :3]
        out[:, c + 3:c + 7] = _quat_mul(np.broadcast_to(q0_inv, q.shape), q)
    return out


def kept_rows(rows_TD: np.ndarray, start: int, ids: FrameIds, transform: tuple[int, ...], where: str) -> np.ndarray:
    """The segment's rows from the first encoded frame on (transformed), before padding and cutting."""
    shift = ids.first - start
    if not 0 <= shift < rows_TD.shape[0]:
        raise ValueError(f"{where}: frame_ids start at frame {ids.first}, outside the segment's parquet rows "
                         f"[{start}, {start + rows_TD.shape[0]})")
    kept = rows_TD[shift:]
    return relative_pose(kept, transform, where) if transform else np.asarray(kept, dtype=np.float64)


def align(rows_TD: np.ndarray, start: int, ids: FrameIds, inverse: np.ndarray, q01: np.ndarray | None,
          q99: np.ndarray | None, transform: tuple[int, ...], where: str) -> tuple[np.ndarray, np.ndarray]:
    """Normalized actions and mask ``(action_dim, F, A)`` of one segment (see the module docstring); ``q01``
    None: the actions as they are (masked), not normalized."""
    kept = kept_rows(rows_TD, start, ids, transform, where)
    need = ids.latent_frames * ids.steps
    if kept.shape[0] + ids.steps < need:
        raise ValueError(f"{where}: frame_ids {ids.first}.. (stride {ids.stride}, {ids.latent_frames} latent frames) "
                         f"need {need - ids.steps} parquet rows from frame {ids.first}, the segment has "
                         f"{kept.shape[0]}")
    padded = np.concatenate([np.zeros((ids.steps, kept.shape[1])), kept])[:need]
    with_zero = np.concatenate([padded, np.zeros((need, 1))], axis=1)  # column `columns`: the empty channel
    present = np.concatenate([np.ones_like(padded, dtype=bool), np.zeros((need, 1), dtype=bool)], axis=1)
    x = with_zero[:, inverse]
    mask = present[:, inverse]
    if q01 is not None and q99 is not None:
        x = np.clip((x - q01) / (q99 - q01 + NORM_EPS) * 2.0 - 1.0, -CLIP, CLIP)
    x = x * mask
    shape = (ids.latent_frames, ids.steps, inverse.shape[0])
    return (x.reshape(shape).transpose(2, 0, 1).astype(np.float32),
            mask.reshape(shape).transpose(2, 0, 1).copy())


def scatter_stats(q01_cols: np.ndarray, q99_cols: np.ndarray, inverse: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Source-column statistics placed in the model's channels; channels no column fills get 0 and 0."""
    pad = lambda v: np.concatenate([np.asarray(v, dtype=np.float64).reshape(-1), [0.0]])  # noqa: E731
    return pad(q01_cols)[inverse], pad(q99_cols)[inverse]
