"""Noise drawn per episode, so a micro-batch's x_t does not depend on how episodes were batched.

:func:`episode_flow_sample` draws σ, latent noise and action noise for every episode from its own
seed (given by the caller, e.g. from ``(run seed, step, episode index)``), as counter-based draws
indexed by coordinates inside the episode, on the batch's device. An episode therefore gets the same
x_t whether it is packed with others, padded in a batch or alone — which is what makes packed vs
per-episode runs comparable (``flexpack verify``) and micro-batching invisible to the objective.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np
import torch
from torch import Tensor

from flexpack.flow.objective import FlowMatchingConfig, FlowSample, make_flow_sample
from flexpack.packing.grids import latent_counter
from flexpack.packing.transfer import to_device


def episode_seed(*parts: int) -> int:
    """A well-mixed 63-bit seed from integers (e.g. run seed, step, episode index)."""
    return int(np.random.SeedSequence([int(p) & 0xFFFFFFFF for p in parts]).generate_state(2, np.uint64)[0] >> 1)


def noise_seeds(layout: Any, *parts: int) -> list[int]:
    """One seed per episode slot of ``layout``: ``episode_seed(*parts, episode, segment + 1)`` from
    the layout's host-side ``episode_index`` and ``episode_segment``. ``parts``: what else keys the
    draw, e.g. (run seed, step) in training, ``VAL_TAG`` alone for the validation loss."""
    pairs = zip(layout.episode_index.tolist(), layout.episode_segment.tolist())
    return [episode_seed(*parts, e, s + 1) for e, s in pairs]


def episode_flow_sample(batch: Any, cfg: FlowMatchingConfig, seeds: Sequence[int]) -> FlowSample:
    """``make_flow_sample`` with σ and noises drawn per episode; ``seeds[e]`` seeds episode slot ``e``.

    Every value is a counter-based draw (:func:`_uniform24` of a 32-bit hash) keyed by the episode's
    seed and the value's coordinates *inside the episode* — latent ``(frame, channel, y, x)``, action
    ``(frame, channel, step)``, σ ``(chunk)`` — so an episode gets the same x_t packed, padded or
    alone, and a cropped episode keeps the noise of the frames it keeps. All episodes are drawn in
    one pass of element-wise ops on the batch's device: no host loop over episodes, no host sync,
    no noise tensor to copy (the seeds, ``E`` integers, are the only host-to-device transfer).
    """
    lay = batch.layout
    x, a = batch.latent, batch.action
    dev = x.device
    # six 32-bit keys per episode (σ, two latent uniforms, two action uniforms, spare)
    _, k_RF6 = episode_keys(lay, seeds, 6, dev)
    valid = lay.frame_doc.to(dev) >= 0
    pos = lay.frame_pos.to(dev)
    chunk = pos // cfg.chunk_size if cfg.chunk_size is not None else torch.zeros_like(pos)
    sigma = torch.where(valid, _uniform24(_mix32(chunk ^ k_RF6[..., 0])), 0.0)

    R, C, Fr, H, W = x.shape
    ctr = latent_counter(lay, C, H, W, dev)  # (R, C, Fr, H, W) index inside the episode (its own grid)
    noise = _normal(ctr, k_RF6[..., 1].view(R, 1, Fr, 1, 1), k_RF6[..., 2].view(R, 1, Fr, 1, 1))
    action_noise = None
    if a is not None:
        _, Ca, _, A = a.shape
        ca = torch.arange(Ca, device=dev).view(1, Ca, 1, 1)
        st = torch.arange(A, device=dev).view(1, 1, 1, A)
        actr = (pos.view(R, 1, Fr, 1) * Ca + ca) * A + st
        action_noise = _normal(actr, k_RF6[..., 3].view(R, 1, Fr, 1), k_RF6[..., 4].view(R, 1, Fr, 1)).to(a.dtype)
    return make_flow_sample(batch, cfg, sigma=sigma, noise=noise.to(x.dtype), action_noise=action_noise)


def episode_keys(layout: Any, seeds: Sequence[int], n: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """``n`` 32-bit keys per episode slot from its seed, (E, n) int64, and the same keys per frame of
    the layout's grid, (R, Fr, n) (padding frames get slot 0's, or zeros without episodes)."""
    E = layout.num_episodes
    if len(seeds) != E:
        raise ValueError(f"need one seed per episode: {E} episodes, got {len(seeds)} seeds")
    keys = (np.stack([np.random.SeedSequence(int(s)).generate_state(n, np.uint32) for s in seeds]) if E
            else np.zeros((0, n)))
    keys_En = to_device(torch.from_numpy(keys.astype(np.int64)), device)  # pinned: a pageable copy may block
    doc = layout.frame_doc.to(device)  # (R, Fr), -1 = padding
    k_RFn = keys_En[doc.clamp(min=0)] if E else torch.zeros((*doc.shape, n), dtype=torch.int64, device=device)
    return keys_En, k_RFn


_M32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer hash on int64 tensors holding values in [0, 2**32) (two xorshift-multiply
    rounds; the 27-bit multiplier keeps every product below 2**63, so int64 never overflows)."""
    x = x & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


def _uniform24(h: Tensor) -> Tensor:
    """float32 in (0, 1) from the top 24 bits of a 32-bit hash (exact in float32, never 0)."""
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / 16777216.0)


def _normal(counter: Tensor, key1: Tensor, key2: Tensor) -> Tensor:
    """Standard normal float32 per counter (Box-Muller over two keyed hashes of it)."""
    u1 = _uniform24(_mix32(_mix32(counter ^ key1) + key2))
    u2 = _uniform24(_mix32(_mix32(counter ^ key2) + key1))
    return torch.sqrt(-2.0 * torch.log(u1)) * torch.cos((2.0 * math.pi) * u2)
