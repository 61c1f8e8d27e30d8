"""Flow-matching objective with masked latent and action losses.

Forward process per latent frame: ``x_t = (1 − σ)·x + σ·ε``, velocity target ``ε − x``; the model
sees timestep ``1000·σ``. ``σ`` is drawn uniformly per group of frames (a frame, a chunk of
frames, or a whole episode) and shifted, ``σ' = shift·σ / (1 + (shift − 1)·σ)``, with a separate
shift for actions (the same uniform draw, so video and action noise levels stay coupled).

Masking. Padding frames (``frame_doc == −1``) and action entries whose ``action_mask`` is False
are zeroed in the model inputs and excluded from the loss, so their values reach neither the
loss nor the gradients.

Normalization (what "mean" means, and how to accumulate). Each part is a mean over the valid
*elements* of the micro-batch: latent over valid frames × C × H × W, actions over True entries of
``action_mask`` on valid frames, each element optionally weighted by its frame's timestep
weight. Because it is ``sum / count``, :class:`FlowLoss` also returns the sums and counts: with
gradient accumulation over micro-batches ``i``, back-propagate
``FlowLoss.accumulation_loss(totals)`` with ``totals = sum_i loss_counts(batch_i)`` (known before
any forward, from the batches alone). The accumulated loss and gradients then equal those of one
batch holding all the episodes — e.g. four micro-batches of one episode equal one batch of four.
Averaging per-micro-batch means instead (``loss_i / n``) weights short episodes more; that is a
different objective, not a rounding difference.

Parts by name. What the step, validation and the metrics log of a loss are its named parts
(:meth:`FlowLoss.parts`: ``latent_loss``, ``action_loss`` and any ``extra`` an objective adds), each a
:class:`LossPart` (sum, count, weight in the loss or None: logged only); the objective's ``counts`` gives
the same names' counts before any forward. A new loss term is one more part, in the objective alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Mapping

import torch
from torch import Tensor

from flexpack.packing.grids import latent_elements, latent_valid

WEIGHTINGS = ("none", "bell")


@dataclass(frozen=True, kw_only=True)
class FlowMatchingConfig:
    """Objective options; each field's doc is the comment on its line (read by ``flexpack config show``)."""

    shift: float = 5.0  # timestep shift of the video latents' σ (1 = no shift)
    action_shift: float = 1.0  # timestep shift of the actions' σ (same uniform draw; 1 = no shift)
    latent_weight: float = 1.0  # weight of the latent (video) loss
    action_weight: float = 1.0  # weight of the action loss
    weighting: str = "none"  # "none", or "bell": per-frame exp(−2(σ − ½)²) normalized to mean 1 (mid noise levels)
    chunk_size: int | None = 1  # frames sharing one σ (frame // chunk_size); 1 = per frame, unset = one σ per episode
    teacher_forcing: bool = False  # add a clean copy (t = 0) of every frame as model input
    num_train_timesteps: float = 1000.0  # the model's timestep scale (timestep = σ · this); an integer >= 1

    def __post_init__(self) -> None:
        # messages name the keys as a training config writes them ([objective] section)
        if not (self.shift > 0 and self.action_shift > 0):  # `not >`: NaN fails too
            raise ValueError(f"objective.shift and objective.action_shift must be positive, got "
                             f"{self.shift}, {self.action_shift}")
        if self.weighting not in WEIGHTINGS:
            raise ValueError(f"objective.weighting must be one of {WEIGHTINGS}, got {self.weighting!r}")
        if self.chunk_size is not None and self.chunk_size <= 0:
            raise ValueError(f"objective.chunk_size must be unset or positive, got {self.chunk_size}")
        if not (self.latent_weight >= 0 and self.action_weight >= 0):
            raise ValueError(f"objective.latent_weight and objective.action_weight must be >= 0, got "
                             f"{self.latent_weight}, {self.action_weight}")
        if self.latent_weight == 0 and self.action_weight == 0:  # a zero loss trains nothing, silently
            raise ValueError("objective.latent_weight and objective.action_weight are both 0: the loss would be 0; "
                             "set at least one > 0")
        # 0 or less maps every timestep to 0 (or flips it), 1e-9 squeezes them together: a count of steps, as Wan's
        # scheduler has (a float field: configs and checkpoints write 1000.0)
        t = self.num_train_timesteps
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not (t >= 1 and float(t).is_integer()):
            raise ValueError(f"objective.num_train_timesteps must be an integer >= 1 (the model's timestep scale, 1000 "
                             f"for Wan), got {t!r}")


def shift_sigma(sigma: Tensor, shift: float) -> Tensor:
    """``shift·σ / (1 + (shift − 1)·σ)``: moves mass towards high noise for shift > 1."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def timestep_weight(sigma: Tensor, weighting: str) -> Tensor:
    """Per-frame loss weight for noise level ``sigma`` (same shape)."""
    if weighting == "none":
        return torch.ones_like(sigma)
    if weighting == "bell":
        # ∫₀¹ exp(−2(σ−½)²) dσ = √(π/2)·erf(1/√2): dividing by it gives mean 1 over uniform σ
        norm = math.sqrt(math.pi / 2) * math.erf(1 / math.sqrt(2))
        return torch.exp(-2 * (sigma - 0.5) ** 2) / norm
    raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")


def sample_sigma(layout: Any, cfg: FlowMatchingConfig, generator: torch.Generator | None = None) -> Tensor:
    """Uniform σ ∈ [0, 1) per group of frames (see ``chunk_size``), (R, Fr) float32; 0 on padding.

    Draws are indexed by (episode slot, chunk), so the values depend on the episodes, not on how
    they are laid out in rows.
    """
    doc = layout.frame_doc
    E = int(layout.episode_frames.shape[0])
    if E == 0:
        return torch.zeros(doc.shape, device=doc.device)
    chunk = layout.frame_pos // cfg.chunk_size if cfg.chunk_size is not None else torch.zeros_like(doc)
    n_chunks = int(chunk.max()) + 1
    u_EC = torch.rand((E, n_chunks), generator=generator, device=generator.device if generator else "cpu")
    u = u_EC.to(doc.device)[doc.clamp(min=0), chunk]
    return torch.where(doc >= 0, u, 0.0)


@dataclass(frozen=True, eq=False)
class FlowSample:
    """Model inputs and targets of one micro-batch.

    Attributes:
        inputs: the batch with noisy ``latent``/``action`` (a leading copy dim of 2 = (noisy, clean)
            with teacher forcing); pass it to the model.
        timestep / action_timestep: (R, Fr) or (2, R, Fr) model timesteps.
        sigma / action_sigma: (R, Fr) shifted noise levels of the noisy copy.
        target_latent: (R, C, Fr, H, W) ``ε − x``; target_action: (R, Ca, Fr, A) or None.
        chunk_size / window: the mask's per-call chunk size and window (None here: the run's forward
            options decide; an objective that draws them per episode sets them).
    """

    inputs: Any
    timestep: Tensor
    action_timestep: Tensor
    sigma: Tensor
    action_sigma: Tensor
    target_latent: Tensor
    target_action: Tensor | None
    chunk_size: Tensor | None = None
    window: Tensor | None = None

    def model_kwargs(self) -> dict[str, Tensor]:
        return {"timestep": self.timestep, "action_timestep": self.action_timestep}


def _action_valid(batch: Any) -> Tensor | None:
    """(R, Ca, Fr, A) bool: real action values on valid frames, or None without actions."""
    if getattr(batch, "action", None) is None:
        return None
    valid = batch.layout.frame_valid[:, None, :, None]
    mask = batch.action_mask if batch.action_mask is not None else torch.ones_like(batch.action, dtype=torch.bool)
    if mask.shape != batch.action.shape:
        raise ValueError(f"action_mask shape {tuple(mask.shape)} != action shape {tuple(batch.action.shape)}")
    return mask & valid


def make_flow_sample(
    batch: Any,
    cfg: FlowMatchingConfig,
    generator: torch.Generator | None = None,
    *,
    sigma: Tensor | None = None,
    noise: Tensor | None = None,
    action_noise: Tensor | None = None,
) -> FlowSample:
    """Noise a batch: σ (R, Fr) and noises are drawn from ``generator`` unless given."""
    layout, x = batch.layout, batch.latent
    valid_RF = layout.frame_valid
    u = sample_sigma(layout, cfg, generator) if sigma is None else sigma
    if u.shape != valid_RF.shape:
        raise ValueError(f"sigma must be (R, Fr)={tuple(valid_RF.shape)}, got {tuple(u.shape)}")
    gen_dev = generator.device if generator is not None else "cpu"
    if noise is None:
        noise = torch.randn(x.shape, generator=generator, device=gen_dev, dtype=torch.float32).to(x.device, x.dtype)
    s_v = torch.where(valid_RF, shift_sigma(u.float(), cfg.shift), 0.0)
    s_a = torch.where(valid_RF, shift_sigma(u.float(), cfg.action_shift), 0.0)
    inside = latent_valid(layout, x.device)  # spatial padding: real elements only (None: every element)
    v5 = valid_RF[:, None, :, None, None] if inside is None else inside
    sv5 = s_v[:, None, :, None, None].to(x.dtype)
    x_t = torch.where(v5, (1 - sv5) * x + sv5 * noise, 0.0)
    target_latent = noise - x
    latent_in = torch.stack([x_t, torch.where(v5, x, 0.0)]) if cfg.teacher_forcing else x_t
    action_in = target_action = None
    a_valid = _action_valid(batch)
    if a_valid is not None:
        a = batch.action
        if action_noise is None:
            action_noise = (torch.randn(a.shape, generator=generator, device=gen_dev, dtype=torch.float32)
                            .to(a.device, a.dtype))
        sa4 = s_a[:, None, :, None].to(a.dtype)
        a_t = torch.where(a_valid, (1 - sa4) * a + sa4 * action_noise, 0.0)
        target_action = action_noise - a
        action_in = torch.stack([a_t, torch.where(a_valid, a, 0.0)]) if cfg.teacher_forcing else a_t
    scale = cfg.num_train_timesteps
    t_v, t_a = s_v * scale, s_a * scale
    if cfg.teacher_forcing:  # the clean copy is at t = 0
        t_v, t_a = torch.stack([t_v, torch.zeros_like(t_v)]), torch.stack([t_a, torch.zeros_like(t_a)])
    inputs = replace(batch, latent=latent_in, action=action_in)
    return FlowSample(inputs, t_v, t_a, s_v, s_a, target_latent, target_action)


@dataclass(frozen=True, eq=False)
class LossPart:
    """One named part of a loss over a micro-batch: ``sum`` over the elements that count, their ``count``
    (the part is ``sum / count``, 0 where nothing counts) and its ``weight`` in the loss (None: logged only)."""

    sum: Tensor
    count: Tensor
    weight: float | None = None


BASE_PARTS = ("latent_loss", "action_loss")  # every FlowLoss's parts, in this order


@dataclass(frozen=True, eq=False)
class FlowLoss:
    """Loss of one micro-batch and its parts (for logging and accumulation).

    ``loss = latent_weight·latent_loss + action_weight·action_loss``; ``*_loss = *_sum / *_count``
    (0 where the count is 0). Counts are float tensors of valid elements.
    """

    loss: Tensor
    latent_loss: Tensor
    action_loss: Tensor
    latent_sum: Tensor
    action_sum: Tensor
    latent_count: Tensor
    action_count: Tensor
    latent_weight: float
    action_weight: float
    # (E, 2): each episode slot's latent and action sums (the parts' numerators), where the objective gives them:
    # per-source loss parts of a mixture are sums of these
    episode_sums: Tensor | None = None
    # parts an objective adds, by name (weight None: logged, not trained on); counted by its ``counts`` too
    extra: Mapping[str, LossPart] = field(default_factory=dict)

    def parts(self) -> dict[str, LossPart]:
        """Every part by name: ``latent_loss``, ``action_loss``, then ``extra`` (what the metrics log)."""
        if clash := set(self.extra) & {"loss", *BASE_PARTS}:
            raise ValueError(f"extra loss parts {sorted(clash)} shadow the built-in names loss, "
                             f"{', '.join(BASE_PARTS)}")
        return {"latent_loss": LossPart(self.latent_sum, self.latent_count, self.latent_weight),
                "action_loss": LossPart(self.action_sum, self.action_count, self.action_weight), **self.extra}

    def with_parts(self, **extra: LossPart) -> "FlowLoss":
        """This loss with more named parts; weighted ones add ``weight · sum / count`` to :attr:`loss`."""
        loss = self.loss
        for p in extra.values():
            if p.weight is not None:
                loss = loss + p.weight * p.sum / p.count.clamp(min=1)
        return replace(self, loss=loss, extra={**self.extra, **extra})

    def accumulation_loss(self, totals: tuple[Tensor | float, Tensor | float] | Mapping[str, Tensor | float]) -> Tensor:
        """This micro-batch's share of the accumulated loss; ``totals`` = Σ of the objective's counts over the
        accumulation window (by part name, or :func:`loss_counts`' (latent, action) pair). Summing the shares
        gives the loss of one batch of all episodes."""
        if not isinstance(totals, Mapping):
            totals = dict(zip(BASE_PARTS, totals))
        out: Tensor | None = None
        for name, part in self.parts().items():
            if part.weight is not None:
                if name not in totals:
                    raise ValueError(f"loss part {name!r} has no count: the objective's counts give {sorted(totals)}")
                term = part.weight * part.sum / max(float(totals[name]), 1.0)
                out = term if out is None else out + term
        return out if out is not None else self.latent_sum * 0.0

    def log_dict(self) -> dict[str, float]:
        return {k: float(getattr(self, k).detach()) for k in ("loss", "latent_loss", "action_loss")}


def loss_counts(batch: Any) -> tuple[Tensor, Tensor]:
    """(latent elements, action elements) that count in the loss of ``batch`` — no forward needed."""
    valid = batch.layout.frame_valid
    C, _, H, W = batch.latent.shape[-4:]
    lat = latent_elements(batch.layout, C, H, W)
    a_valid = _action_valid(batch)
    act = a_valid.sum().float() if a_valid is not None else torch.zeros((), device=valid.device)
    return lat, act


def flow_loss(pred: Any, sample: FlowSample, batch: Any, cfg: FlowMatchingConfig) -> FlowLoss:
    """Masked flow-matching loss of ``pred`` (``video`` (R,C,Fr,H,W), ``action`` (R,Ca,Fr,A) or None)."""
    if pred.video.shape != sample.target_latent.shape:
        raise ValueError(f"pred.video shape {tuple(pred.video.shape)} != target {tuple(sample.target_latent.shape)}")
    valid_RF = batch.layout.frame_valid
    w_v = timestep_weight(sample.sigma, cfg.weighting) * valid_RF  # (R, Fr); 0 on padding
    err = (pred.video.float() - sample.target_latent.float()).square()
    # where() rather than a multiply: a NaN/inf prediction on a pad frame must not leak into the sum
    inside = latent_valid(batch.layout, err.device)  # spatial padding counts nowhere (None: none here)
    v5 = valid_RF[:, None, :, None, None] if inside is None else inside
    lat_sum = torch.where(v5, err * w_v[:, None, :, None, None], 0.0).sum()
    lat_count, act_count = loss_counts(batch)
    act_sum = torch.zeros((), device=lat_sum.device)
    a_valid = _action_valid(batch)
    if a_valid is not None and sample.target_action is not None:
        if pred.action is None or pred.action.shape != sample.target_action.shape:
            got = None if pred.action is None else tuple(pred.action.shape)
            raise ValueError(f"pred.action shape {got} != target {tuple(sample.target_action.shape)}")
        w_a = timestep_weight(sample.action_sigma, cfg.weighting)[:, None, :, None]
        a_err = (pred.action.float() - sample.target_action.float()).square()
        act_sum = torch.where(a_valid, a_err * w_a, 0.0).sum()
    lat_loss = lat_sum / lat_count.clamp(min=1)
    act_loss = act_sum / act_count.clamp(min=1)
    loss = cfg.latent_weight * lat_loss + cfg.action_weight * act_loss
    return FlowLoss(loss, lat_loss, act_loss, lat_sum, act_sum, lat_count, act_count, cfg.latent_weight,
                    cfg.action_weight)


def training_loss(
    model: Any, batch: Any, cfg: FlowMatchingConfig, generator: torch.Generator | None = None, **model_kwargs: Any
) -> FlowLoss:
    """Noise ``batch``, run ``model(inputs, timestep=..., action_timestep=..., **model_kwargs)``, return the loss.

    With ``cfg.teacher_forcing`` pass ``mask="teacher_forcing"`` and a ``chunk_size`` in ``model_kwargs``.
    """
    sample = make_flow_sample(batch, cfg, generator)
    pred = model(sample.inputs, **sample.model_kwargs(), **model_kwargs)
    return flow_loss(pred, sample, batch, cfg)
