"""Noise drawn per episode, so a micro-batch's x_t does not depend on how episodes were batched.

:func:`episode_flow_sample` draws σ, latent noise and action noise for every episode from its own
generator (seeded by the caller, e.g. from ``(run seed, step, episode index)``) and places them into
the micro-batch's (R, Fr) grid at the episode's row and offset. An episode therefore gets the same
x_t whether it is packed with others, padded in a batch or alone — which is what makes packed vs
per-episode runs comparable (``flexpack verify``) and micro-batching invisible to the objective.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from flexpack.packing.layout import SequenceLayout
from flexpack.training.objective import FlowMatchingConfig, FlowSample, make_flow_sample, sample_sigma


def episode_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (e.g. run seed, step, episode index)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(2, np.uint64)[0] >> 1)


def episode_flow_sample(batch: Any, cfg: FlowMatchingConfig, seeds: Sequence[int]) -> FlowSample:
    """``make_flow_sample`` with σ and noises drawn per episode; ``seeds[e]`` seeds episode slot ``e``.

    Per episode ``e`` (``F`` valid frames) its generator draws, in this order: σ as
    :func:`~flexpack.training.objective.sample_sigma` would for the episode alone, latent noise (C, F, H, W)
    float32, then action noise (Ca, F, A) float32 when the batch has actions.
    """
    lay = batch.layout
    E = lay.num_episodes
    if len(seeds) != E:
        raise ValueError(f"need one seed per episode: {E} episodes, got {len(seeds)} seeds")
    x, a = batch.latent, batch.action
    sigma = torch.zeros(lay.frame_doc.shape, dtype=torch.float32)
    noise = torch.zeros(x.shape, dtype=torch.float32)
    action_noise = None if a is None else torch.zeros(a.shape, dtype=torch.float32)
    rows, starts, frames = (t.tolist() for t in (lay.episode_row, lay.episode_start, lay.episode_frames))
    for e in range(E):
        r, s, n = rows[e], starts[e], frames[e]
        g = torch.Generator().manual_seed(int(seeds[e]))
        sigma[r, s : s + n] = sample_sigma(SequenceLayout.from_rows([[n]], n), cfg, g)[0]
        noise[r, :, s : s + n] = torch.randn((x.shape[1], n, *x.shape[3:]), generator=g)
        if action_noise is not None:
            action_noise[r, :, s : s + n] = torch.randn((a.shape[1], n, a.shape[3]), generator=g)
    dev = x.device
    return make_flow_sample(
        batch, cfg, sigma=sigma.to(dev), noise=noise.to(dev, x.dtype),
        action_noise=None if action_noise is None else action_noise.to(dev, a.dtype),
    )
