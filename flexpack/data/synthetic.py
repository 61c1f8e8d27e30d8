"""``flexpack make-dataset``: a small synthetic LeRobot dataset, written with lerobot's own API.

Each episode shows a coloured blob moving over a gradient (per camera a different palette),
has smooth sinusoidal actions and states, and one of a few tasks. With ``index_actions`` the
action columns encode their own position instead: column 0 = frame index, column 1 = episode
index, column k >= 2 = frame index + 1000·k (for alignment tests).

With ``scene="orbit"`` the data is learnable: every episode shows one bright blob circling the
frame centre at a fixed angular speed (``ORBIT_OMEGA`` radians per video frame, one turn in 24
frames, the same way round in every episode) from an episode-specific start angle, and its
actions are a deterministic function of what the camera sees: column k = cos(θ_t + 2πk/D) for the
blob's angle θ_t (column 0 ∝ its x offset; column D/4, when 4 divides D, ∝ minus its y offset). The
blob is broad (σ = 12 % of the frame) so the 16×16 average pooling of the ``pool`` encoder keeps
its position: the four cells of a 32×32 camera's 2×2 latent weigh how much of the blob lies in
each quadrant. Knowing θ at the end of the history (one frame shows it), a model can forecast
the next frames exactly; repeating the last action or the mean action cannot
(half a turn in 12 video frames).

With ``scene="orbit-speed"`` the blob moves as in ``orbit`` but at a speed and direction drawn per
episode (``ORBIT_SPEEDS`` times ``ORBIT_OMEGA``, either way round): no single frame tells where the
blob goes next, the history does (two latent frames show the direction, more the speed). A model
that forecasts it well must read its own episode's history; given another episode's history it
cannot (the learning test's control).

With ``subtasks=K`` (2 or 3) every episode is annotated with K consecutive subtasks instead of
one task: lerobot's per-frame ``"task"`` in ``add_frame`` gives each frame its subtask, so the
parquet's ``task_index`` column holds K runs (cut at random frames; an episode shorter than K
frames gets one run per frame) and ``meta/tasks.parquet`` lists every subtask.

Frame size: ``size`` must be a multiple of 16 (the encoders' spatial stride, so no pixel is
dropped) and at least 32. lerobot's default video codec, SVT-AV1, kills the process with a
floating-point exception (SIGFPE, exit 136) on frames narrower than 25 pixels, so a smaller
size is refused before anything is written.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import numpy as np

TASKS = ["pick up the red cube", "open the drawer", "push the button twice", "stack the blue block on the green one"]
SUBTASKS = ["reach for the red cube", "grasp the red cube", "lift the red cube", "put the cube in the bin"]
MIN_SIZE, SPATIAL_STRIDE = 32, 16
SCENES = ("wander", "orbit", "orbit-speed")
ORBIT_TASK = "follow the bright ball"
ORBIT_OMEGA = 2 * np.pi / 24  # radians per video frame
ORBIT_RADIUS, ORBIT_SIGMA = 0.3, 0.12  # in frame widths
ORBIT_SPEEDS = (0.5, 1.5)  # the orbit-speed scene: per-episode speed range, in ORBIT_OMEGA


def check_size(size: int) -> None:
    """Refuse frame sizes the encoders or lerobot's AV1 video encoder cannot handle."""
    if size < MIN_SIZE or size % SPATIAL_STRIDE:
        raise ValueError(
            f"size={size}: the frame size must be a multiple of {SPATIAL_STRIDE} (the encoders' spatial stride) "
            f"and >= {MIN_SIZE} (lerobot's SVT-AV1 video encoder crashes with SIGFPE on frames narrower than 25 px)"
        )


def subtask_runs(n: int, k: int, rng: np.random.Generator) -> list[tuple[int, int]]:
    """Cut ``n`` frames into ``min(k, n)`` non-empty runs [start, stop) at random frames."""
    k = min(k, n)
    cuts = np.sort(rng.choice(np.arange(1, n), size=k - 1, replace=False)) if k > 1 else np.array([], dtype=int)
    bounds = [0, *cuts.tolist(), n]
    return list(zip(bounds[:-1], bounds[1:]))


def _frame(t: int, episode: int, camera: int, size: int) -> np.ndarray:
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / max(size - 1, 1)
    phase = 0.15 * t + 1.3 * episode + 2.1 * camera
    cx, cy = 0.5 + 0.35 * np.cos(phase), 0.5 + 0.35 * np.sin(1.7 * phase)
    blob = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / 0.02)
    rgb = np.stack([0.6 * xx + 0.4 * blob, 0.6 * yy + 0.4 * blob * (camera == 0), 0.3 + 0.5 * blob * (camera == 1)], -1)
    return (np.clip(rgb, 0, 1) * 255).astype(np.uint8)


def orbit_angles(n: int, rng: np.random.Generator) -> np.ndarray:
    """The blob's angle at each of ``n`` frames: a random start angle, then a fixed speed.

    One direction for all episodes: latent frame 0 shows a single video frame, from which the
    direction could not be told, so a forecast from it would be a coin toss."""
    return rng.uniform(0, 2 * np.pi) + ORBIT_OMEGA * np.arange(n)


def orbit_speed_angles(n: int, rng: np.random.Generator) -> tuple[np.ndarray, float]:
    """The orbit-speed scene's angles at ``n`` frames and its speed (radians per video frame, signed):
    a random start angle, speed and direction per episode."""
    speed = float(rng.uniform(*ORBIT_SPEEDS) * ORBIT_OMEGA * rng.choice([-1.0, 1.0]))
    return rng.uniform(0, 2 * np.pi) + speed * np.arange(n), speed


def orbit_frame(theta: float, camera: int, size: int) -> np.ndarray:
    """A dark frame with one bright blob at angle ``theta`` on the orbit (camera 1 sees it mirrored)."""
    yy, xx = np.mgrid[0:size, 0:size].astype(np.float32) / max(size - 1, 1)
    cx = 0.5 + ORBIT_RADIUS * np.cos(theta) * (1 if camera == 0 else -1)
    cy = 0.5 + ORBIT_RADIUS * np.sin(theta)
    blob = np.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / (2 * ORBIT_SIGMA**2))
    rgb = 0.05 + 0.9 * blob[..., None] * np.array([1.0, 0.9, 0.7] if camera == 0 else [0.7, 0.9, 1.0], np.float32)
    return (np.clip(rgb, 0, 1) * 255).astype(np.uint8)


def orbit_actions(theta_T: np.ndarray, action_dim: int) -> np.ndarray:
    """(T, D) float32: column k = cos(θ + 2πk/D)."""
    return np.cos(theta_T[:, None] + 2 * np.pi * np.arange(action_dim) / action_dim).astype(np.float32)


def make_synthetic_dataset(
    root: str | os.PathLike,
    *,
    episodes: int = 4,
    min_frames: int = 9,
    max_frames: int = 33,
    lengths: list[int] | None = None,
    cameras: int = 1,
    size: int = 32,
    fps: int = 10,
    action_dim: int = 6,
    index_actions: bool = False,
    subtasks: int = 0,
    scene: str = "wander",
    seed: int = 0,
    progress: bool = False,
) -> Path:
    """Write the dataset to ``root`` (must not exist) and return it. ``lengths`` overrides the draw.

    ``subtasks``: 0 = one task per episode; 2 or 3 = that many annotated subtasks per episode.
    ``scene``: ``"wander"`` (a blob over a gradient, actions independent of it), ``"orbit"``
    (actions a function of the blob's position) or ``"orbit-speed"`` (the same with a speed and
    direction drawn per episode); see the module docstring.
    The dataset is written into a temporary folder next to ``root`` and renamed when complete,
    so a failed or interrupted run leaves no partial dataset behind (which a rerun would refuse).
    """
    from lerobot.datasets.lerobot_dataset import LeRobotDataset
    from tqdm import tqdm

    root = Path(root)
    if root.exists():
        raise FileExistsError(f"{root}: already exists; make-dataset writes a new dataset")
    if lengths is None and episodes < 1:
        raise ValueError(f"episodes must be >= 1, got {episodes}")
    if action_dim < 1:
        raise ValueError(f"action_dim must be >= 1, got {action_dim}")
    if cameras not in (1, 2):
        raise ValueError(f"cameras must be 1 or 2, got {cameras}")
    if not 1 <= min_frames <= max_frames:
        raise ValueError(f"need 1 <= min_frames <= max_frames, got {min_frames}, {max_frames}")
    if subtasks not in (0, 2, 3):
        raise ValueError(f"subtasks must be 0 (one task per episode), 2 or 3, got {subtasks}")
    if scene not in SCENES:
        raise ValueError(f"scene must be one of {SCENES}, got {scene!r}")
    if scene != "wander" and (index_actions or subtasks):
        raise ValueError(f"scene={scene!r} sets its own actions and task: it cannot be combined with "
                         f"index_actions={index_actions} or subtasks={subtasks}")
    check_size(size)
    if lengths is not None and (not lengths or min(lengths) < 1):
        raise ValueError(f"lengths must be >= 1 video frames each, got {lengths}")
    rng = np.random.default_rng(seed)
    sub_rng = np.random.default_rng([seed, 1])  # own stream: subtasks leave the rest of the data unchanged
    orbit_rng = np.random.default_rng([seed, 2])
    if lengths is None:
        lengths = rng.integers(min_frames, max_frames + 1, size=episodes).tolist()
    cams = [f"observation.images.cam{c}" for c in range(cameras)]
    names = [f"a{j}" for j in range(action_dim)]
    features = {cam: {"dtype": "video", "shape": (size, size, 3), "names": ["height", "width", "channels"]}
                for cam in cams}
    features["action"] = {"dtype": "float32", "shape": (action_dim,), "names": names}
    features["observation.state"] = {"dtype": "float32", "shape": (action_dim,), "names": names}
    root.parent.mkdir(parents=True, exist_ok=True)
    from flexpack.atomic import remove_dead_temporaries

    remove_dead_temporaries(root.parent, f".{root.name}.tmp-*")  # left by a killed make-dataset
    tmp = root.with_name(f".{root.name}.tmp-{os.getpid()}")
    ds = None
    try:
        ds = LeRobotDataset.create(
            f"local/{root.name}", fps=fps, features=features, root=tmp, use_videos=True, video_backend="pyav"
        )
        for ep, n in enumerate(tqdm(lengths, desc="make-dataset", unit="ep", disable=not progress)):
            freq = rng.uniform(0.05, 0.2, size=action_dim)
            offset = rng.uniform(0, 2 * np.pi, size=action_dim)
            task = TASKS[int(rng.integers(len(TASKS)))]
            frame_tasks = [task] * int(n)
            if subtasks:
                first = int(sub_rng.integers(len(SUBTASKS) - subtasks + 1))
                for j, (start, stop) in enumerate(subtask_runs(int(n), subtasks, sub_rng)):
                    frame_tasks[start:stop] = [SUBTASKS[first + j]] * (stop - start)
            if scene != "wander":
                theta = (orbit_angles(int(n), orbit_rng) if scene == "orbit"
                         else orbit_speed_angles(int(n), orbit_rng)[0])
                actions = orbit_actions(theta, action_dim)
                for t in range(int(n)):
                    frame = {cam: orbit_frame(theta[t], c, size) for c, cam in enumerate(cams)}
                    frame.update({"action": actions[t], "observation.state": actions[t], "task": ORBIT_TASK})
                    ds.add_frame(frame)
                ds.save_episode(parallel_encoding=False)
                continue
            for t in range(int(n)):
                if index_actions:
                    action = np.array([t, ep] + [t + 1000 * k for k in range(2, action_dim)],
                                      dtype=np.float32)[:action_dim]
                else:
                    action = np.sin(freq * t + offset).astype(np.float32)
                frame = {cam: _frame(t, ep, c, size) for c, cam in enumerate(cams)}
                frame.update({"action": action, "observation.state": np.cos(freq * t + offset).astype(np.float32),
                              "task": frame_tasks[t]})
                ds.add_frame(frame)
            ds.save_episode(parallel_encoding=False)  # no fork from a threaded process
        ds.finalize()
        os.rename(tmp, root)
    finally:
        if ds is not None:  # close lerobot's writers now: collected later, they would write into tmp again
            with contextlib.suppress(Exception):
                ds.finalize()
        shutil.rmtree(tmp, ignore_errors=True)
    return root
