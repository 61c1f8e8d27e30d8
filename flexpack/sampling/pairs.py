"""(episode, cut point) pairs: what is known, what is generated, and the noise each starts from.

A pair ``(e, c)`` is the first ``c + horizon`` latent frames of episode ``e``: frames ``[0, c)``
are the context (ground truth, or in a rollout the first chunk), frames ``[c, c + horizon)`` the
target the sampler generates. :class:`Pair` holds the truth of those frames and a buffer
``pred_*`` that starts as the context followed by zeros and is filled stage by stage.

Noise. The starting noise of every target value is a counter-based draw keyed by the pair's seed
``episode_seed(SAMPLE_TAG, noise_seed, episode, segment, cut)`` and the value's coordinates *inside the
episode* (frame, channel, y, x) — the same hash as training's per-episode noise
(:mod:`flexpack.flow.noise`). A pair therefore starts from the same ε whether it is packed
with others or alone, at any step of a run and after a resume. Sample ``k > 0`` of a pair (several
forecasts of one (episode, cut), ``--samples K``) adds ``k`` to the key: other noise, while sample 0
keeps the noise of a single-sample run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from flexpack.flow.noise import _normal, episode_seed
from flexpack.packing.grids import latent_counter

SAMPLE_TAG = 0x73616D70  # "samp": keeps sampling noise apart from training and validation draws


@dataclass(eq=False)
class Pair:
    """One (episode, cut point) pair; tensors are CPU float32, frames cover ``[0, cut + horizon)``."""

    episode: int
    segment: int
    cut: int
    horizon: int
    latent: Tensor  # (C, L, H, W) truth
    action: Tensor | None  # (Ca, L, A) truth (normalized), zero where action_mask is False
    action_mask: Tensor | None  # (Ca, L, A) bool
    text: Tensor | None
    text_len: int
    pred_latent: Tensor = field(init=False)
    pred_action: Tensor | None = field(init=False)
    done: int = 0  # target frames generated so far
    noise_seed: int = 0  # another value draws other noise for the same pair (another run's samples)
    sample: int = 0  # which of the K samples of this (episode, cut) it is: each draws its own noise

    def __post_init__(self) -> None:
        self.pred_latent = self.latent.clone()
        self.pred_latent[:, self.cut:] = 0  # never let the truth of a target frame reach the model
        self.pred_action = None
        if self.action is not None:
            self.pred_action = self.action.clone()
            self.pred_action[:, self.cut:] = 0

    @property
    def frames(self) -> int:
        return self.cut + self.horizon

    @property
    def seed(self) -> int:
        parts = (SAMPLE_TAG, self.noise_seed, self.episode, self.segment + 1, self.cut)
        return episode_seed(*parts, self.sample) if self.sample else episode_seed(*parts)

    def item(self, upto: int) -> dict[str, Any]:
        """The pair's first ``upto`` frames as a dataset item for the collates: known frames from the buffer."""
        it: dict[str, Any] = {"latent": self.pred_latent[:, :upto], "episode_index": self.episode}
        if self.pred_action is not None:
            it["action"] = self.pred_action[:, :upto]
            it["action_mask"] = self.action_mask[:, :upto]
        if self.text is not None:
            it["text"], it["text_len"] = self.text, self.text_len
        return it


def first_cut(chunk: int, min_context: int = 0) -> int:
    """The first cut point allowed: the first multiple of ``chunk`` (at least one) with ``min_context``
    latent frames of context."""
    return max(chunk, -(-min_context // chunk) * chunk)


def cut_points(frames: int, n: int, horizon: int, chunk: int, min_context: int = 0) -> list[int]:
    """Up to ``n`` evenly spaced cut points of an episode of ``frames`` latent frames: multiples of
    ``chunk`` with at least one chunk and ``min_context`` frames of context that leave a full
    ``horizon``; [] if none fits."""
    first = first_cut(chunk, min_context)
    last = (frames - horizon) // chunk * chunk
    if last < first or n < 1:
        return []
    picks = np.linspace(first, last, n) if n > 1 else np.array([first])
    return sorted({int(p) // chunk * chunk for p in picks})


def check_cut(episode: int, frames: int, cut: int, horizon: int, chunk: int) -> None:
    """A user-chosen cut point must leave a full horizon and sit on a chunk boundary."""
    if cut < chunk or cut % chunk:
        raise ValueError(f"cut point {cut} of episode {episode}: must be a positive multiple of the context chunk "
                         f"({chunk} latent frames)")
    if cut + horizon > frames:
        raise ValueError(f"cut point {cut} + horizon {horizon} is beyond episode {episode} ({frames} latent frames)")


def make_pair(item: dict[str, Any], cut: int, horizon: int, *, actions: bool = True, noise_seed: int = 0,
              sample: int = 0) -> Pair:
    """A pair from a dataset item (``LatentEpisodeDataset[i]``); ``sample``: which of K samples it is."""
    L = cut + horizon
    lat = item["latent"]
    if L > lat.shape[1]:
        raise ValueError(f"cut point {cut} + horizon {horizon} is beyond episode {item.get('episode_index')} "
                         f"({lat.shape[1]} latent frames)")
    act = mask = None
    if actions and item.get("action") is not None:
        mask = item.get("action_mask")
        mask = torch.ones_like(item["action"], dtype=torch.bool) if mask is None else mask[:, :L].bool()
        act = torch.where(mask, item["action"][:, :L].float(), 0.0)
    text = item.get("text")
    return Pair(episode=int(item.get("episode_index", -1)), segment=int(item.get("segment", -1)), cut=cut,
                horizon=horizon, latent=lat[:, :L].float().clone(), action=act, action_mask=mask, text=text,
                text_len=int(item.get("text_len", 0 if text is None else text.shape[0])), noise_seed=noise_seed,
                sample=sample)


def borrow_history(pair: Pair, item: dict[str, Any]) -> None:
    """Give ``pair`` the first ``cut`` latent frames and actions of another episode's dataset ``item`` as
    the history its forecast starts from (a control: a model that reads its history must then do
    worse); its truth, action mask, text and noise stay its own."""
    c = pair.cut
    if item["latent"].shape[1] < c:
        raise ValueError(f"episode {item.get('episode_index')} has {item['latent'].shape[1]} latent frames, too few "
                         f"for the history of episode {pair.episode} at cut {c}")
    pair.pred_latent[:, :c] = item["latent"][:, :c].float()
    if pair.pred_action is not None and item.get("action") is not None:
        pair.pred_action[:, :c] = torch.where(pair.action_mask[:, :c], item["action"][:, :c].float(), 0.0)


def pair_noise(layout: Any, seeds: Sequence[int], latent_shape: Sequence[int], action_shape: Sequence[int] | None,
               device: torch.device) -> tuple[Tensor, Tensor | None]:
    """Latent (R, C, Fr, H, W) and action (R, Ca, Fr, A) noise of a packed batch, per episode slot
    from ``seeds`` and coordinates inside the episode (see the module docstring)."""
    keys = np.stack([np.random.SeedSequence(int(s)).generate_state(4, np.uint32) for s in seeds])
    k_E4 = torch.from_numpy(keys.astype(np.int64)).to(device)
    doc, pos = layout.frame_doc.to(device), layout.frame_pos.to(device)
    k = k_E4[doc.clamp(min=0)]  # (R, Fr, 4)
    R, C, Fr, H, W = latent_shape
    ctr = latent_counter(layout, C, H, W, device)  # (R, C, Fr, H, W) inside the episode, over its own grid
    noise = _normal(ctr, k[..., 0].view(R, 1, Fr, 1, 1), k[..., 1].view(R, 1, Fr, 1, 1))
    if action_shape is None:
        return noise, None
    _, Ca, _, A = action_shape
    ca = torch.arange(Ca, device=device).view(1, Ca, 1, 1)
    st = torch.arange(A, device=device).view(1, 1, 1, A)
    actr = (pos.view(R, 1, Fr, 1) * Ca + ca) * A + st
    return noise, _normal(actr, k[..., 2].view(R, 1, Fr, 1), k[..., 3].view(R, 1, Fr, 1))
