"""LingBot-VA's flow-matching objective (LeRobot ``lingbot_va``) over packed episodes.

What LeRobot's ``training_loss_from_streams`` does per batch of clips, done per episode:

* **Noise grids.** Each stream has LeRobot's ``FlowMatchScheduler(shift, sigma_min=0,
  extra_one_step=True)`` grid of 1000 steps (:func:`noise_grid`): ``σ_i`` = the shifted
  ``linspace(1, 0, 1001)[i]``, timestep ``1000·σ_i``, and a training weight per step (a bell over the
  timestep, ``exp(−2((t − 500)/1000)²)``, shifted to minimum 0 and scaled to mean 1 over the grid).
  Video latents use ``snr_shift``, actions ``action_snr_shift``.
* **Noisy copy.** Every latent frame gets a step id ``⌊1000·u⌋`` (u uniform), per stream, so
  ``x_t = (1 − σ)·x + σ·ε`` and the target ``ε − x``.
* **Clean copy.** With probability ``noisy_cond_prob`` an episode's clean latent copy is itself
  noised, each frame at a step drawn from ``[500, 1000)``, and the model sees that timestep; else the
  clean copy is the latent at timestep 0. The clean action copy is always the actions at timestep 0.
* **Action channels.** Noisy input, target and clean copy of the actions are zero where the action
  mask is False (LeRobot's ``actions_mask``: the channels ``used_action_channel_ids`` fill).
* **Chunk and window** of the attention mask: drawn uniformly from ``chunk_range`` and
  ``window_range`` (LeRobot: ``randint(1, 5)`` and ``randint(4, 65)``).
* **Loss** (:func:`lingbot_loss`): per (episode, frame) the weighted squared error summed over the
  frame's latent elements divided by their count (+1e-6), and for actions over its action entries
  divided by the count of its masked-in entries (+1e-6); each part is the mean of those per-frame
  values over all valid (episode, frame) pairs of the batch; loss = latent + action. For a batch of
  clips of equal length (LeRobot's) that is LeRobot's mean over (clip, frame); for packed episodes of
  different lengths every frame counts once, whatever episode it is in.

Differences from LeRobot, on purpose: LeRobot draws one step-id vector, one noisy-condition coin and
one (chunk, window) per training step, shared by all clips of its batch; here every one of them is
drawn per episode (:func:`lingbot_draws`), as counter-based draws keyed by the episode's seed (from
:func:`flexpack.flow.noise.noise_seeds`) and coordinates inside the episode, so an episode gets
exactly the same noise, timesteps, chunk and window packed with others, padded or alone. Step ids
come from 24-bit uniforms (LeRobot: float32 ``torch.rand``); both give every id of 0..999.

Accumulation: :func:`lingbot_loss` returns a :class:`~flexpack.flow.objective.FlowLoss` whose
sums are sums of per-frame values and whose counts are valid frames (:func:`lingbot_loss_counts`), so
``FlowLoss.accumulation_loss`` over micro-batches gives the loss of one batch of all their episodes.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol, Sequence

import torch
from torch import Tensor

from flexpack.flow.noise import _mix32, _normal, _uniform24, episode_keys
from flexpack.flow.objective import BASE_PARTS, FlowLoss, _action_valid, shift_sigma
from flexpack.packing.grids import episode_video_tokens, frame_elements, latent_counter, latent_valid

COUNT_EPS = 1e-6  # LeRobot's guard in the per-frame mean: sum / (count + 1e-6)
COND_LOW = 0.5  # the clean copy's noise is drawn from steps [500, 1000)
_KEYS = 12  # 32-bit keys per episode (see lingbot_draws)


class LingbotObjectiveConfig(Protocol):
    """The fields of :class:`flexpack.families.lingbot.config.LingbotConfig` this objective reads."""

    @property
    def snr_shift(self) -> float: ...
    @property
    def action_snr_shift(self) -> float: ...
    @property
    def noisy_cond_prob(self) -> float: ...
    @property
    def chunk_range(self) -> tuple[int, int]: ...
    @property
    def window_range(self) -> tuple[int, int]: ...
    @property
    def num_train_timesteps(self) -> int: ...


@dataclass(frozen=True, eq=False)
class NoiseGrid:
    """One stream's noise grid: ``sigmas``, ``timesteps`` (= 1000·σ) and training ``weights``, each (N,) float32."""

    sigmas: Tensor
    timesteps: Tensor
    weights: Tensor


def noise_grid(shift: float, steps: int = 1000, device: torch.device | str = "cpu") -> NoiseGrid:
    """LeRobot's training grid of ``FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True)`` after
    ``set_timesteps(steps, training=True)``, in float32 as it computes it."""
    sigmas = shift_sigma(torch.linspace(1.0, 0.0, steps + 1, device=device)[:-1], shift)
    timesteps = sigmas * steps
    bell = torch.exp(-2 * ((timesteps - steps / 2) / steps) ** 2)
    bell = bell - bell.min()
    return NoiseGrid(sigmas, timesteps, bell * (steps / bell.sum()))


@dataclass(frozen=True, eq=False)
class LingbotDraws:
    """The random values of one micro-batch (``R`` rows × ``Fr`` frames, ``E`` episodes).

    Attributes:
        step, action_step: (R, Fr) int64 step ids (0..N-1) of the noisy copy's latent and action frames.
        cond_step: (R, Fr) int64 step ids of the clean latent copy, used where ``noisy_cond`` holds.
        noisy_cond: (E,) bool — the episode's clean latent copy is noised.
        noise, cond_noise: like the latent (R, C, Fr, H, W); action_noise: like the actions or None.
        chunk_size, window: (E,) int64 — the episode's attention chunk size and window.
    """

    step: Tensor
    action_step: Tensor
    cond_step: Tensor
    noisy_cond: Tensor
    noise: Tensor
    cond_noise: Tensor
    action_noise: Tensor | None
    chunk_size: Tensor
    window: Tensor


def _int_in(u: Tensor, lo: int, hi: int) -> Tensor:
    """Uniform u in (0, 1) -> an int in [lo, hi]."""
    return (lo + (u * (hi - lo + 1)).floor()).to(torch.int64).clamp(max=hi)


def _step_id(u: Tensor, steps: int, low: float = 0.0) -> Tensor:
    """LeRobot's ``_sample_timestep_id``: ``⌊steps·(low + (1 − low)·u)⌋`` clamped to the grid."""
    return ((u * (1.0 - low) + low) * steps).clamp(0, steps - 1).to(torch.int64)


def lingbot_draws(batch: Any, cfg: LingbotObjectiveConfig, seeds: Sequence[int]) -> LingbotDraws:
    """Counter-based draws per episode: ``seeds[e]`` keys episode slot ``e``; per-frame values are keyed
    by the frame's index inside its episode and per-element noise by its coordinates there, so an episode's
    draws do not depend on what else the batch holds. No host loop over episodes, no host sync."""
    lay = batch.layout
    x, a = batch.latent, batch.action
    dev = x.device
    keys_EK, k_RFK = episode_keys(lay, seeds, _KEYS, dev)
    valid = lay.frame_doc.to(dev) >= 0
    pos = lay.frame_pos.to(dev)
    N = int(cfg.num_train_timesteps)

    def per_frame(k: int, low: float = 0.0) -> Tensor:
        return torch.where(valid, _step_id(_uniform24(_mix32(pos ^ k_RFK[..., k])), N, low), 0)

    R, C, Fr, H, W = x.shape
    ctr = latent_counter(lay, C, H, W, dev)  # index inside the episode (over its own grid)

    def latent_noise(k: int) -> Tensor:
        return _normal(ctr, k_RFK[..., k].view(R, 1, Fr, 1, 1), k_RFK[..., k + 1].view(R, 1, Fr, 1, 1)).to(x.dtype)

    action_noise = None
    if a is not None:
        _, Ca, _, A = a.shape
        actr = (pos.view(R, 1, Fr, 1) * Ca + torch.arange(Ca, device=dev).view(1, Ca, 1, 1)) * A + torch.arange(
            A, device=dev).view(1, 1, 1, A)
        action_noise = _normal(actr, k_RFK[..., 6].view(R, 1, Fr, 1), k_RFK[..., 7].view(R, 1, Fr, 1)).to(a.dtype)
    chunk, window = _chunk_window(keys_EK, cfg)
    return LingbotDraws(
        step=per_frame(0), action_step=per_frame(1), cond_step=per_frame(3, COND_LOW),
        noisy_cond=_per_episode(keys_EK, 2, 0) < cfg.noisy_cond_prob,
        noise=latent_noise(4), cond_noise=latent_noise(8), action_noise=action_noise,
        chunk_size=chunk, window=window,
    )


def _chunk_window(keys_EK: Tensor, cfg: LingbotObjectiveConfig) -> tuple[Tensor, Tensor]:
    """Each episode's attention chunk size and window from its keys (key 10, counters 0 and 1)."""
    (c_lo, c_hi), (w_lo, w_hi) = cfg.chunk_range, cfg.window_range
    return _int_in(_per_episode(keys_EK, 10, 0), c_lo, c_hi), _int_in(_per_episode(keys_EK, 10, 1), w_lo, w_hi)


def _per_episode(keys_EK: Tensor, k: int, counter: int) -> Tensor:
    """One uniform in (0, 1) per episode from its key ``k`` and ``counter``."""
    return _uniform24(_mix32(keys_EK[:, k] ^ counter))


def drawn_chunk_window(layout: Any, cfg: LingbotObjectiveConfig, seeds: Sequence[int]) -> tuple[list[int], list[int]]:
    """The chunk sizes and windows :func:`lingbot_draws` draws for the episodes of ``layout`` with ``seeds``,
    computed on the host from the layout's host copy (no GPU work, no wait): what the step's mask kept."""
    keys_EK, _ = episode_keys(layout.on_host(), seeds, _KEYS, torch.device("cpu"))
    chunk, window = _chunk_window(keys_EK, cfg)
    return chunk.tolist(), window.tolist()


@dataclass(frozen=True, eq=False)
class LingbotSample:
    """Model inputs and loss targets of one micro-batch.

    Attributes:
        inputs: the batch with ``latent`` (2, R, C, Fr, H, W) = (noisy, clean) and ``action``
            (2, R, Ca, Fr, A) likewise (or None); pass it to the model.
        timestep, action_timestep: (2, R, Fr) model timesteps (noisy copy, clean copy); 0 on padding.
        target_latent: (R, C, Fr, H, W) ``ε − x``; target_action: (R, Ca, Fr, A) ``(ε − a)·mask`` or None.
        latent_weight, action_weight: (R, Fr) training weights of the noisy copy's steps; 0 on padding.
        action_valid: (R, Ca, Fr, A) bool — action entries that count (mask and valid frame), or None.
        chunk_size, window: (E,) int64 for the model's mask.
    """

    inputs: Any
    timestep: Tensor
    action_timestep: Tensor
    target_latent: Tensor
    target_action: Tensor | None
    latent_weight: Tensor
    action_weight: Tensor
    action_valid: Tensor | None
    chunk_size: Tensor
    window: Tensor

    def model_kwargs(self) -> dict[str, Tensor]:
        return {"timestep": self.timestep, "action_timestep": self.action_timestep,
                "chunk_size": self.chunk_size, "window": self.window}


def lingbot_pairs(frames: int, video_tokens: int, action_tokens: int, chunk_size: int, window: int) -> int:
    """(query, key) pairs :func:`flexpack.attention.masks.lingbot_mask` keeps inside one episode of ``frames``
    latent frames with ``video_tokens`` and ``action_tokens`` per frame and copy, both copies: what its
    self-attention does (useful FLOPs). Linear in the block ids (prefix sums over the tokens per id), so the
    train loop can count every step."""
    if frames <= 0:
        return 0
    block = torch.arange(frames) // chunk_size * 2
    fid = torch.cat([block, block + 1])
    size = torch.cat([torch.full((frames,), video_tokens), torch.full((frames,), action_tokens)])
    n = torch.zeros(int(fid.max()) + 1, dtype=torch.int64).index_add_(0, fid, size)  # tokens of one copy per id
    before = torch.cat([torch.zeros(1, dtype=torch.int64), n.cumsum(0)])  # before[i]: tokens of ids < i
    q = torch.arange(n.numel())
    lowest = before[(q - window).clamp(min=0)]  # tokens of ids below the window
    at_most = before[q + 1] - lowest  # key ids in [q - window, q]: clean -> clean
    below = before[q] - lowest  # key ids in [q - window, q): noisy -> clean
    return int((n * (at_most + below + n)).sum())  # + n: noisy -> noisy, the same id


def lingbot_sample(batch: Any, cfg: LingbotObjectiveConfig, draws: LingbotDraws) -> LingbotSample:
    """Noise ``batch`` with ``draws`` (from :func:`lingbot_draws`, or injected) as LeRobot's ``_add_noise_stream``."""
    lay, x, a = batch.layout, batch.latent, batch.action
    dev = x.device
    valid = lay.frame_valid.to(dev)
    N = int(cfg.num_train_timesteps)
    grid, a_grid = noise_grid(cfg.snr_shift, N, dev), noise_grid(cfg.action_snr_shift, N, dev)
    zero = torch.zeros((), device=dev)

    def frames5(t_RF: Tensor) -> Tensor:  # (R, Fr) -> broadcastable over (R, C, Fr, H, W)
        return t_RF[:, None, :, None, None]

    inside = latent_valid(lay, dev)  # spatial padding: real elements only (None: every element of a valid frame)
    real = frames5(valid) if inside is None else inside
    s, s_c = grid.sigmas[draws.step].to(x.dtype), grid.sigmas[draws.cond_step].to(x.dtype)
    x_t = torch.where(real, (1 - frames5(s)) * x + frames5(s) * draws.noise, 0.0)
    cond = draws.noisy_cond[lay.frame_doc.to(dev).clamp(min=0)] & valid if lay.num_episodes else valid & False
    clean = torch.where(frames5(cond), (1 - frames5(s_c)) * x + frames5(s_c) * draws.cond_noise, x)
    t_noisy_a = torch.where(valid, a_grid.timesteps[draws.action_step], zero)
    t_video = torch.stack([torch.where(valid, grid.timesteps[draws.step], zero),
                           torch.where(cond, grid.timesteps[draws.cond_step], zero)])
    t_action = torch.stack([t_noisy_a, torch.zeros_like(t_noisy_a)])
    action_in = target_action = None
    a_valid = _action_valid(batch)
    if a_valid is not None:
        sa = a_grid.sigmas[draws.action_step][:, None, :, None].to(a.dtype)
        a_t = torch.where(a_valid, (1 - sa) * a + sa * draws.action_noise, 0.0)
        target_action = torch.where(a_valid, draws.action_noise - a, 0.0)
        action_in = torch.stack([a_t, torch.where(a_valid, a, 0.0)])
    inputs = replace(batch, latent=torch.stack([x_t, torch.where(real, clean, 0.0)]), action=action_in)
    return LingbotSample(
        inputs=inputs, timestep=t_video, action_timestep=t_action, target_latent=draws.noise - x,
        target_action=target_action,
        latent_weight=torch.where(valid, grid.weights[draws.step], zero),
        action_weight=torch.where(valid, a_grid.weights[draws.action_step], zero),
        action_valid=a_valid, chunk_size=draws.chunk_size, window=draws.window,
    )


def lingbot_loss_counts(batch: Any) -> tuple[Tensor, Tensor]:
    """(frames, frames) that count in :func:`lingbot_loss` of ``batch`` — its valid (episode, frame)
    pairs, for latent and action parts alike; sum them over micro-batches for ``accumulation_loss``."""
    n = batch.layout.frame_valid.sum().float()
    return n, n.clone()


def lingbot_loss(pred: Any, sample: LingbotSample, batch: Any, *, latent_weight: float = 1.0,
                 action_weight: float = 1.0) -> FlowLoss:
    """LeRobot's ``_flow_matching_loss`` over valid frames of ``pred`` (``video`` (R, C, Fr, H, W),
    ``action`` (R, Ca, Fr, A) or None); see the module docstring for the normalization. ``latent_weight``
    / ``action_weight`` weight the two parts (LeRobot: 1 and 1)."""
    if pred.video.shape != sample.target_latent.shape:
        raise ValueError(f"pred.video shape {tuple(pred.video.shape)} != target {tuple(sample.target_latent.shape)}")
    valid = batch.layout.frame_valid.to(pred.video.device)
    C, _, H, W = pred.video.shape[1:]
    err = (pred.video.float() - sample.target_latent.float()).square() * sample.latent_weight[:, None, :, None, None]
    inside = latent_valid(batch.layout, valid.device)  # spatial padding counts nowhere (None: none here)
    if inside is not None:
        err = torch.where(inside, err, 0.0)
    per_frame = err.sum(dim=(1, 3, 4)) / (frame_elements(batch.layout, C, H, W) + COUNT_EPS)  # (R, Fr)
    # where() rather than a product: a NaN/inf prediction on a pad frame must not reach the sum
    lat_sum = torch.where(valid, per_frame, 0.0).sum()
    count, _ = lingbot_loss_counts(batch)
    act_sum = torch.zeros((), device=lat_sum.device)
    if sample.target_action is not None:
        if pred.action is None or pred.action.shape != sample.target_action.shape:
            got = None if pred.action is None else tuple(pred.action.shape)
            raise ValueError(f"pred.action shape {got} != target {tuple(sample.target_action.shape)}")
        keep = sample.action_valid
        a_err = (pred.action.float() - sample.target_action.float()).square() * sample.action_weight[:, None, :, None]
        a_frame = torch.where(keep, a_err, 0.0).sum(dim=(1, 3)) / (keep.sum(dim=(1, 3)) + COUNT_EPS)
        act_sum = torch.where(valid, a_frame, 0.0).sum()
    denom = count.to(lat_sum.device).clamp(min=1)
    lat_loss, act_loss = lat_sum / denom, act_sum / denom
    # per episode slot, without a host sync: pad frames go to an extra slot E that is dropped
    E = batch.layout.episode_frames.shape[0]
    slot = torch.where(valid, batch.layout.frame_doc.to(valid.device), E).reshape(-1)
    per = torch.stack([torch.where(valid, per_frame, 0.0).reshape(-1),
                       torch.where(valid, a_frame, 0.0).reshape(-1) if sample.target_action is not None
                       else torch.zeros_like(slot, dtype=per_frame.dtype)], dim=1)
    episode_sums = torch.zeros(E + 1, 2, device=per.device, dtype=per.dtype).index_add_(0, slot, per)[:E]
    return FlowLoss(latent_weight * lat_loss + action_weight * act_loss, lat_loss, act_loss, lat_sum, act_sum, count,
                    count.clone(), latent_weight, action_weight, episode_sums)


@dataclass(frozen=True)
class LingbotObjective:
    """This objective as the step, validation and verify call it (:mod:`flexpack.flow.objectives`): its
    fields from the family's config, the two loss parts weighted by ``objective.latent_weight`` /
    ``action_weight`` (LeRobot: 1 and 1)."""

    cfg: LingbotObjectiveConfig
    latent_weight: float = 1.0
    action_weight: float = 1.0

    @classmethod
    def from_config(cls, objective: Any, model: LingbotObjectiveConfig) -> "LingbotObjective":
        return cls(model, objective.latent_weight, objective.action_weight)

    def sample(self, batch: Any, seeds: Sequence[int]) -> LingbotSample:
        return lingbot_sample(batch, self.cfg, lingbot_draws(batch, self.cfg, seeds))

    def loss(self, pred: Any, sample: LingbotSample, batch: Any) -> FlowLoss:
        return lingbot_loss(pred, sample, batch, latent_weight=self.latent_weight, action_weight=self.action_weight)

    def counts(self, batch: Any) -> dict[str, Tensor]:
        return dict(zip(BASE_PARTS, lingbot_loss_counts(batch)))

    def attention_pairs(self, layout: Any, geometry: Any, seeds: Sequence[int]) -> list[int]:
        """Pairs of the lingbot mask per episode with the chunk size and window ``seeds`` draw, both copies."""
        chunk, window = drawn_chunk_window(layout, self.cfg, seeds)
        nv = episode_video_tokens(layout, geometry.video_tokens)  # each episode's own grid (no spatial padding)
        return [lingbot_pairs(f, v, geometry.action_tokens, c, w)
                for f, v, c, w in zip(layout.episode_frames.tolist(), nv, chunk, window)]


def lingbot_training_loss(
    model: Any, batch: Any, cfg: LingbotObjectiveConfig, seeds: Sequence[int], **model_kwargs: Any
) -> FlowLoss:
    """Draw per episode, noise, run ``model(inputs, timestep=..., action_timestep=..., chunk_size=..., window=...)``
    and return the loss (``model_kwargs``: e.g. ``text_slots``)."""
    sample = lingbot_sample(batch, cfg, lingbot_draws(batch, cfg, seeds))
    pred = model(sample.inputs, **sample.model_kwargs(), **model_kwargs)
    return lingbot_loss(pred, sample, batch)
