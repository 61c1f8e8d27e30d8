"""LingBot-VA sampling as LeRobot's ``LingBotVAPolicy._infer`` does it, over packed (episode, cut) pairs.

LeRobot (lerobot 0.6.1, ``policies/lingbot_va/modeling_lingbot_va.py``) predicts ``frame_chunk_size`` (C)
latent frames at a time, chunks aligned at multiples of C: first the video stream (``num_inference_steps``
Euler steps on the ``snr_shift`` grid), then the action stream (``action_num_inference_steps`` steps on the
``action_snr_shift`` grid), each step one call of the transformer on that stream's tokens of the chunk, which
attend to themselves and to a KV cache. The cache holds the earlier chunks (their observed latents and
executed actions, fed back at timestep 0) and, for the action stream, the chunk's own latents as the video
stream's last call (timestep 0) left them. Its first chunk knows frame 0 (the observation), held at
timestep 0 among the noisy latents, with frame 0's actions held at zero.

:class:`LingbotSampler` gives every token exactly that context with the training mask instead of a cache.
A stage generates, for every unfinished pair, the rest of the chunk (block) its next target frame is in; the
pair's sequence is its frames ``[0, end of that block)`` in the model's two copies, masked by ``lingbot`` with
chunk size C and window ``attn_window``:

- the noisy video tokens of block b see the noisy video tokens of block b and the clean copy (video and
  actions) of earlier blocks: LeRobot's chunk latents and its cache;
- the noisy action tokens of block b see the noisy actions of block b and the clean copy up to block b's
  video, which holds the video the first stream generated: LeRobot's actions, its cache and the chunk's latents;
- the clean copy (timestep 0) holds the known frames: the truth (forecast) or what earlier stages generated;
  known frames of the current block (a cut inside a block, as LeRobot's first chunk) also sit in the noisy
  copy at timestep 0, held (LeRobot's ``latent_cond`` / ``action_cond``).

Each stream's grid is LeRobot's ``FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True)`` after
``set_timesteps(N)``, in float32 as it computes it, then σ = 0 (its padded last timestep); the model sees
``1000·σ``; one Euler step ``x ← x + (σ_{i+1} − σ_i)·v`` per σ (``--solver heun`` is flexpack's addition).
Classifier-free guidance ``v = u + g·(c − u)``: ``c`` the model on the episode's prompt, ``u`` on the negative
prompt (LeRobot's: the empty prompt, through the text encoder the latent cache was encoded with: its text files
name it), the clean copy included, as LeRobot's cache keeps a row per prompt; ``g`` is ``guidance_scale``
(video) or ``action_guidance_scale``; with ``g <= 1`` no negative pass runs, ``v = c``. Unused action
channels stay 0, as LeRobot zeroes them in every input and in its result.

Where it differs from LeRobot: an episode's last block holds only its remaining frames (LeRobot always
denoises C); LeRobot's cache keeps ``attn_window // 2`` chunks and then evicts its oldest entries, while the
mask keeps block ids within ``attn_window``: the same context up to ``attn_window // 2`` chunks (60 latent
frames at the defaults).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

import torch
from torch import Tensor, nn

from flexpack.attention.masks import mask_kind
from flexpack.flow.objective import shift_sigma
from flexpack.run.root import Run, full_text
from flexpack.sampling.pairs import Pair, pair_noise
from flexpack.sampling.schedule import solve
from flexpack.sampling.solver import PackedSampler, SampleOptions, episode_grids

# (layout, pairs, latent shape, action shape, device) -> (latent noise, action noise) of a packed batch
NoiseFn = Callable[[Any, Sequence[Pair], Sequence[int], Sequence[int], torch.device], tuple[Tensor, Tensor]]


def stream_grid(steps: int, shift: float) -> Tensor:
    """(steps + 1,) float32 σ: LeRobot's ``FlowMatchScheduler(shift, sigma_min=0, extra_one_step=True)``
    after ``set_timesteps(steps)``, then 0."""
    return torch.cat([shift_sigma(torch.linspace(1.0, 0.0, steps + 1)[:-1], shift), torch.zeros(1)])


@dataclass(frozen=True)
class Stream:
    """One stream's solver: its σ grid and guidance scale."""

    grid: Tensor
    guidance: float

    @property
    def guided(self) -> bool:
        return self.guidance > 1


def negative_prompt(dataset: Any) -> tuple[Tensor, int]:
    """LeRobot's negative prompt (the empty one) through the text encoder ``dataset``'s latent cache was
    encoded with (its text files record it): ((L, Dt) float32, valid tokens)."""
    from flexpack.data import cache
    from flexpack.data.text import text_encoder_named

    empty = getattr(dataset, "empty_text", None)  # a bundle's empty_emb.pt: upstream's negative prompt itself
    if empty is not None:
        return empty, int(empty.shape[0])
    task = next(iter(dataset.source.tasks()))
    file = cache.text_path(dataset.latents_dir, task)
    name = cache.read_text_header(file).encoder
    try:
        encoder = text_encoder_named(name)
    except (OSError, ValueError, ImportError) as exc:
        raise ValueError(f"{file}: classifier-free guidance needs the negative prompt through its text encoder "
                         f"{name!r}, which cannot be loaded ({exc}); or sample without guidance: --set "
                         "model.overrides.guidance_scale=1 --set model.overrides.action_guidance_scale=1") from None
    return encoder.encode("")


class LingbotSampler(PackedSampler):
    """LeRobot's ``_infer`` over packed pairs (see the module docstring); :class:`PackedSampler`'s stages, packs,
    ranks and bookkeeping. ``negative_text``: the negative prompt's ((L, Dt), valid tokens) (default: from
    ``dataset``, where a stream is guided); ``noise``: the starting noise of a pack (default
    :func:`~flexpack.sampling.pairs.pair_noise`, per pair and coordinates inside its episode)."""

    def __init__(self, model: nn.Module, run: Run, options: SampleOptions = SampleOptions(), *,
                 max_tokens: int | None = None, text_slots: int | None = None, stage: int | None = None,
                 negative_text: tuple[Tensor, int] | None = None, noise: NoiseFn | None = None) -> None:
        super().__init__(model, run, options, max_tokens=max_tokens, text_slots=text_slots, stage=stage)
        model_cfg = self.family_config = run.model_config
        dataset = self.dataset
        self.C, self.window = int(model_cfg.frame_chunk_size), int(model_cfg.attn_window)
        self.video = Stream(stream_grid(model_cfg.num_inference_steps, model_cfg.snr_shift), model_cfg.guidance_scale)
        self.action = Stream(stream_grid(model_cfg.action_num_inference_steps, model_cfg.action_snr_shift),
                             model_cfg.action_guidance_scale)
        self.negative = None
        if self.video.guided or self.action.guided:
            if negative_text is None:
                if dataset is None:
                    raise ValueError("classifier-free guidance needs the negative prompt: pass negative_text or the "
                                     "dataset whose text encoder encodes it")
                negative_text = negative_prompt(dataset)
            text, n = negative_text
            self.negative = full_text({"text": text, "text_len": n}, model_cfg.max_sequence_length)["text"]
        self.noise = noise or (lambda lay, pairs, ls, acs, dev: pair_noise(lay, [p.seed for p in pairs], ls, acs, dev))

    @staticmethod
    def context_chunk(run: Run) -> int:
        """Cut points sit on chunk boundaries: ``frame_chunk_size`` (LeRobot's chunks)."""
        return int(run.model_config.frame_chunk_size)

    @staticmethod
    def config_steps(run: Run) -> int:
        """The video stream's solver steps (the action stream's are ``action_num_inference_steps``)."""
        return int(run.model_config.num_inference_steps)

    def stage_count(self, p: Pair) -> int:
        """The rest of the block the pair's next target frame is in (LeRobot's chunks are aligned at 0)."""
        k = p.cut + p.done
        return min(self.C - k % self.C, p.horizon - p.done)

    def _solve_items(self, pairs: Sequence[Pair], items: list[dict], known: Sequence[int], collate: Any
                     ) -> tuple[list[Tensor], list[Tensor] | None]:
        model_cfg, dev, C = self.family_config, self.device, self.C
        # LeRobot's padded prompt
        batch = collate([full_text(it, model_cfg.max_sequence_length) for it in items]).to(dev)
        lay = batch.layout
        doc, pos = lay.frame_doc, lay.frame_pos
        k = torch.as_tensor(list(known), dtype=torch.int64, device=dev)[doc.clamp(min=0)]  # (R, Fr)
        target = (doc >= 0) & (pos >= k)
        x, a, amask = batch.latent.float(), batch.action.float(), batch.action_mask
        noise, anoise = self.noise(lay, pairs, x.shape, a.shape, dev)
        t5, a_live = target[:, None, :, None, None], target[:, None, :, None] & amask
        forward = replace(self.sample_run.forward, text_slots=self.text_slots)
        n_valid = int(lay.episode_frames.sum()) * self.tpf
        zero_t = torch.zeros(target.shape, device=dev)
        # one chunk size and window per episode, as training passes them (the same mask build, compiled once):
        # the per-episode options the configured mask takes (the mask table says which)
        per_episode = {"chunk_size": C, "window": self.window}
        mask_opts = {k: torch.full((lay.num_episodes,), per_episode[k], dtype=torch.int64, device=dev)
                     for k in mask_kind(self.cfg.model.mask).options if k in per_episode}
        texts = (batch.text, None if self.negative is None else
                 self.negative.to(dev, batch.text.dtype).expand(batch.text.shape[0], -1, -1))

        def call(noisy: Tensor, clean: Tensor, noisy_a: Tensor, t_v: Tensor, t_a: Tensor, text: Tensor) -> Any:
            inputs = replace(batch, latent=torch.stack([noisy, clean]).to(batch.latent.dtype),
                             action=torch.stack([noisy_a, a]), text=text)
            with self.opt.autocast(self.sample_run):
                out = forward.call(self.model, inputs, timestep=torch.stack([t_v, zero_t]),
                                   action_timestep=torch.stack([t_a, zero_t]), **mask_opts)
            self.forwards += 1
            self.tokens += 2 * n_valid
            return out

        def guided(stream: Stream, run: Callable[[Tensor], Tensor]) -> Tensor:
            cond = run(texts[0]).float()
            if not stream.guided:
                return cond
            uncond = run(texts[1]).float()
            return uncond + stream.guidance * (cond - uncond)

        def at(stream: Stream, i: int) -> Tensor:  # the noisy copy's timesteps at σ_i: 0 on known frames
            return torch.where(target, stream.grid.to(dev)[i] * model_cfg.num_train_timesteps, 0.0)

        def per_frame(stream: Stream, ndim: int) -> Tensor:  # σ per frame: the grid on targets, 0 elsewhere
            g = stream.grid.to(dev)[:, None, None] * target[None].float()  # (N + 1, R, Fr)
            return g[:, :, None, :, None, None] if ndim == 5 else g[:, :, None, :, None]

        # 1. the video stream: known frames at timestep 0 (the clean copy; the noisy one where in the block)
        a0 = torch.where(a_live, anoise, a)
        (video,) = solve(lambda xs, i: (guided(self.video, lambda txt: call(xs[0], x, a0, at(self.video, i), zero_t,
                                                                             txt).video),),
                         (torch.where(t5, noise, x),), (per_frame(self.video, 5),), self.opt.solver, keep=(~t5,))
        # 2. the action stream, seeing the generated video in the clean copy of its block
        clean = torch.where(t5, video, x)
        (action,) = solve(lambda xs, i: (guided(self.action, lambda txt: call(clean, clean, xs[0], zero_t,
                                                                               at(self.action, i), txt).action),),
                          (a0,), (per_frame(self.action, 4),), self.opt.solver, keep=(~a_live,))
        rows, starts, frames = lay.episode_row.tolist(), lay.episode_start.tolist(), lay.episode_frames.tolist()
        grids = episode_grids(lay, x.shape[-2:])  # each pair's own latent grid (spatial padding cut off)
        return ([video[r, :, s:s + f, :g[0], :g[1]] for r, s, f, g in zip(rows, starts, frames, grids)],
                [action[r, :, s:s + f] for r, s, f in zip(rows, starts, frames)])
