"""LingBot-VA's objective: LeRobot's noise grids, ``_add_noise_stream``, ``_flow_matching_loss`` and
``training_loss_from_streams`` given the same draws; per-episode draws that make a packed episode's
noise and loss contribution its own."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flexpack.attention.flex import FlexAttnFunc
from flexpack.families.lingbot.config import lingbot_config
from flexpack.families.lingbot.convert import build_from_lerobot
from flexpack.families.lingbot.objective import (
    LingbotDraws,
    lingbot_draws,
    lingbot_loss,
    lingbot_loss_counts,
    lingbot_sample,
    lingbot_training_loss,
    noise_grid,
)
from flexpack.packing.collate import Batch
from flexpack.packing.layout import SequenceLayout
from lingbot_ref import TEXT_TOKENS, eager_flex, grid_to_outputs, reference_model

CFG = lingbot_config("lingbot-va-tiny")
B, F, H, W = 2, 5, 4, 2


@pytest.fixture(scope="module")
def policy():
    """LeRobot's tiny LingBotVAPolicy (bf16 transformer, as it ships; nothing downloaded)."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.lingbot_va.configuration_lingbot_va import LingBotVAConfig
    from lerobot.policies.lingbot_va.modeling_lingbot_va import LingBotVAPolicy

    feats = {"observation.images.image": PolicyFeature(type=FeatureType.VISUAL, shape=(3, 32, 32))}
    torch.manual_seed(0)
    pol = LingBotVAPolicy(LingBotVAConfig(**CFG.lerobot_fields(), attn_mode="flex", device="cpu",
                                          input_features=feats))
    with torch.no_grad():  # move norms and tables off their init, as reference_model does
        pol.transformer.load_state_dict(reference_model(CFG).to(torch.bfloat16).state_dict())
    pol._ensure_train_schedulers()
    return pol


def clip_data(seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    lat = torch.randn(B, CFG.in_channels, F, H, W, generator=g)
    mask = torch.zeros(CFG.action_dim)
    mask[list(CFG.used_action_channel_ids)] = 1
    mask = mask.view(1, -1, 1, 1, 1).expand(B, -1, F, CFG.action_per_frame, 1)
    act = torch.randn(mask.shape, generator=g) * mask
    text = torch.randn(B, TEXT_TOKENS, CFG.text_dim, generator=g)
    batch = Batch(latent=lat, action=act[..., 0], action_mask=mask[..., 0].bool(), text=text,
                  layout=SequenceLayout.from_rows([[F]] * B, F, mode="pad", text_len=[TEXT_TOKENS] * B))
    return lat, act, mask, text, batch


def replay(seed: int, lat: torch.Tensor, act: torch.Tensor) -> LingbotDraws:
    """The values ``training_loss_from_streams`` draws from the global RNG after ``manual_seed(seed)``,
    in its order (latent stream, action stream, chunk, window), as draws for B clips in pad rows."""
    torch.manual_seed(seed)
    ids = lambda low=0.0: ((torch.rand(F) * (1 - low) + low) * 1000).clamp(0, 999).long()  # noqa: E731
    step, noise = ids(), torch.zeros_like(lat).normal_()
    cond = torch.rand(1).item() < CFG.noisy_cond_prob
    cond_step, cond_noise = (ids(0.5), torch.zeros_like(lat).normal_()) if cond else (torch.zeros(F).long(), lat * 0)
    action_step, action_noise = ids(), torch.zeros_like(act).normal_()
    torch.rand(1)  # the action stream's coin (probability 0)
    chunk, window = torch.randint(1, 5, (1,)), torch.randint(4, 65, (1,))
    rows = lambda v: v[None].expand(B, F)  # noqa: E731  LeRobot shares the frame draws across its clips
    return LingbotDraws(step=rows(step), action_step=rows(action_step), cond_step=rows(cond_step),
                        noisy_cond=torch.full((B,), cond), noise=noise, cond_noise=cond_noise,
                        action_noise=action_noise[..., 0], chunk_size=chunk.expand(B), window=window.expand(B))


def test_noise_grids_are_lerobots(policy) -> None:
    """Sigmas, timesteps and training weights of both streams, bit for bit; the weight LeRobot looks up
    by nearest timestep is the weight of the step id (the grid has no two equal timesteps)."""
    streams = ((policy._train_sched_latent, CFG.snr_shift), (policy._train_sched_action, CFG.action_snr_shift))
    for sched, shift in streams:
        grid = noise_grid(shift)
        assert grid.sigmas.equal(sched.sigmas) and grid.timesteps.equal(sched.timesteps)
        assert grid.weights.equal(sched.linear_timesteps_weights)
        assert sched.training_weight(grid.timesteps).equal(grid.weights)
    assert not noise_grid(1.0).sigmas.equal(noise_grid(CFG.snr_shift).sigmas)


def test_noised_inputs_and_targets_are_add_noise_streams(policy) -> None:
    """Given LeRobot's draws, the sample is bit for bit what ``_add_noise_stream`` returns for both
    streams: noisy and clean copies, targets, timesteps and condition timesteps, with and without a
    noisy condition."""
    lat, act, mask, _, batch = clip_data()
    seen = set()
    for seed in range(4):
        draws = replay(seed, lat, act)
        seen.add(bool(draws.noisy_cond[0]))
        sample = lingbot_sample(batch, CFG, draws)
        torch.manual_seed(seed)
        ld = policy._add_noise_stream(lat, policy._train_sched_latent, None, False, CFG.noisy_cond_prob)
        ad = policy._add_noise_stream(act, policy._train_sched_action, mask, True, 0.0)
        pairs = [(sample.inputs.latent[0], ld["noisy_latents"]), (sample.inputs.latent[1], ld["latent"]),
                 (sample.target_latent, ld["targets"]), (sample.timestep[0], ld["timesteps"]),
                 (sample.timestep[1], ld["cond_timesteps"]), (sample.inputs.action[0], ad["noisy_latents"][..., 0]),
                 (sample.inputs.action[1], ad["latent"][..., 0]), (sample.target_action, ad["targets"][..., 0]),
                 (sample.action_timestep[0], ad["timesteps"]), (sample.action_timestep[1], ad["cond_timesteps"])]
        for i, (got, want) in enumerate(pairs):
            assert got.equal(want.to(got.dtype)), (seed, i)
    assert seen == {True, False}


def test_loss_is_flow_matching_loss_on_the_same_prediction(policy) -> None:
    """The loss formula alone, float32: any prediction, LeRobot's ``_flow_matching_loss`` and ours agree."""
    lat, act, mask, text, batch = clip_data()
    draws = replay(1, lat, act)
    sample = lingbot_sample(batch, CFG, draws)
    torch.manual_seed(1)
    ld = policy._add_noise_stream(lat, policy._train_sched_latent, None, False, CFG.noisy_cond_prob)
    ad = policy._add_noise_stream(act, policy._train_sched_action, mask, True, 0.0)
    ad["actions_mask"] = mask
    g = torch.Generator().manual_seed(9)
    pred = type("Pred", (), {})()
    pred.video, pred.action = torch.randn(lat.shape, generator=g), torch.randn(act[..., 0].shape, generator=g)
    want = policy._flow_matching_loss({"latent_dict": ld, "action_dict": ad}, grid_to_outputs(CFG, pred.video,
                                                                                              pred.action))
    got = lingbot_loss(pred, sample, batch)
    torch.testing.assert_close(torch.stack([got.latent_loss, got.action_loss]), torch.stack(want), rtol=1e-6, atol=0)
    assert got.loss == got.latent_loss + got.action_loss
    assert (got.latent_count, got.action_count) == (B * F, B * F)


def test_training_loss_equals_training_loss_from_streams(policy, monkeypatch) -> None:
    """LeRobot's whole step (bf16 transformer, its mask, its draws) against ours on the same weights in
    float32 with its draws injected: equal within bf16 rounding of the prediction (1 %: the loss is
    quadratic in an error of ~0.5 %, see test_lingbot_model); other noise moves the loss far more."""
    eager_flex(monkeypatch)
    lat, act, mask, text, batch = clip_data()
    ours = build_from_lerobot(policy.transformer.state_dict(), CFG, attn=FlexAttnFunc("dense"), dtype=torch.float32)
    for seed in (0, 1):
        torch.manual_seed(seed)
        with torch.no_grad():
            want, parts = policy.training_loss_from_streams(lat, act, mask, text.bfloat16())
        draws = replay(seed, lat, act)
        sample = lingbot_sample(batch, CFG, draws)
        with torch.no_grad():
            got = lingbot_loss(ours(sample.inputs, **sample.model_kwargs()), sample, batch)
        assert abs(float(got.latent_loss) / parts["latent_loss"] - 1) < 0.01, (seed, got.latent_loss, parts)
        assert abs(float(got.action_loss) / parts["action_loss"] - 1) < 0.01, (seed, got.action_loss, parts)
        other = lingbot_sample(batch, CFG, replace(draws, noise=replay(seed + 7, lat, act).noise))
        with torch.no_grad():
            off = lingbot_loss(ours(other.inputs, **other.model_kwargs()), other, batch)
        assert abs(float(off.latent_loss) / parts["latent_loss"] - 1) > 0.05


def packed_episodes(lens: list[int], seed: int = 0) -> tuple[list[Batch], Batch]:
    """Episodes alone (one batch each) and the same episodes packed into one row with a padding tail
    holding garbage (which must not matter)."""
    g = torch.Generator().manual_seed(seed)
    A, L = CFG.action_per_frame, 6
    alone = []
    for i, n in enumerate(lens):
        mask = torch.rand(CFG.action_dim, n, A, generator=g) < 0.7
        alone.append(Batch(latent=torch.randn(1, CFG.in_channels, n, 2, 2, generator=g),
                           action=torch.randn(1, CFG.action_dim, n, A, generator=g) * mask, action_mask=mask[None],
                           text=torch.randn(1, L, CFG.text_dim, generator=g),
                           layout=SequenceLayout.from_rows([[n]], n, episode_index=[10 + i], text_len=[L])))
    tail = 3
    cat = lambda key, fill: torch.cat([getattr(b, key) for b in alone] + [fill], dim=2)  # noqa: E731
    lat = cat("latent", torch.full((1, CFG.in_channels, tail, 2, 2), 1e3))
    act = cat("action", torch.full((1, CFG.action_dim, tail, A), -7.0))
    amask = cat("action_mask", torch.ones(1, CFG.action_dim, tail, A, dtype=torch.bool))
    layout = SequenceLayout.from_rows([lens], sum(lens) + tail, episode_index=[10 + i for i in range(len(lens))],
                                      text_len=[L] * len(lens))
    return alone, Batch(latent=lat, action=act, action_mask=amask, text=torch.cat([b.text for b in alone]),
                        layout=layout)


def test_packed_episodes_get_their_own_draws_and_loss() -> None:
    """Counter-based draws: each packed episode gets the noise, steps, condition coin, chunk and window
    it gets alone; the packed loss equals the loss accumulated over the episodes as micro-batches
    (FlowLoss.accumulation_loss with lingbot_loss_counts), and dropping the doc ids changes it."""
    lens, seeds = [4, 2, 5], [101, 202, 303]
    alone, packed = packed_episodes(lens)
    model = build_from_lerobot(reference_model(CFG).state_dict(), CFG, attn=FlexAttnFunc("dense"))
    dp = lingbot_draws(packed, CFG, seeds)
    start = 0
    for e, (b, n) in enumerate(zip(alone, lens)):
        da = lingbot_draws(b, CFG, seeds[e:e + 1])
        sl = slice(start, start + n)
        for name in ("step", "action_step", "cond_step"):
            assert getattr(dp, name)[:, sl].equal(getattr(da, name)), name
        for name in ("noise", "cond_noise", "action_noise"):
            assert getattr(dp, name)[:, :, sl].equal(getattr(da, name)), name
        for name in ("noisy_cond", "chunk_size", "window"):
            assert getattr(dp, name)[e] == getattr(da, name)[0], name
        start += n
    with torch.no_grad():
        whole = lingbot_training_loss(model, packed, CFG, seeds)
        parts = [lingbot_training_loss(model, b, CFG, seeds[e:e + 1]) for e, b in enumerate(alone)]
        totals = [sum(c) for c in zip(*(lingbot_loss_counts(b) for b in alone))]
        accumulated = sum(p.accumulation_loss(totals) for p in parts)
        torch.testing.assert_close(accumulated, whole.loss, rtol=1e-5, atol=0)
        torch.testing.assert_close(sum(p.latent_sum for p in parts), whole.latent_sum, rtol=1e-5, atol=0)
        assert whole.latent_count == sum(lens)
        # control: the same tensors and draws (one coin, chunk and window for all), claimed as one episode
        merged = replace(packed, text=packed.text[:1], layout=SequenceLayout.from_rows(
            [[sum(lens)]], sum(lens) + 3, episode_index=[10], text_len=[6]))
        first = lambda E: replace(dp, **{k: getattr(dp, k)[:1].expand(E)  # noqa: E731
                                         for k in ("noisy_cond", "chunk_size", "window")})
        losses = []
        for batch, draws in ((packed, first(3)), (merged, first(1))):
            sample = lingbot_sample(batch, CFG, draws)
            losses.append(float(lingbot_loss(model(sample.inputs, **sample.model_kwargs()), sample, batch).loss))
    assert abs(losses[1] / losses[0] - 1) > 1e-3, losses


def test_draws_follow_lerobots_distributions() -> None:
    """Over many episodes: step ids cover 0..999, clean-copy steps 500..999, the coin lands at about
    noisy_cond_prob, chunk sizes and windows fill their inclusive ranges; all zero on padding."""
    n = 400
    batch = Batch(latent=torch.zeros(1, 1, 3 * n + 2, 1, 1), action=None, action_mask=None, text=None,
                  layout=SequenceLayout.from_rows([[3] * n], 3 * n + 2))
    d = lingbot_draws(batch, CFG, list(range(n)))
    step, cond = d.step[0, :3 * n], d.cond_step[0, :3 * n]
    assert int(step.min()) < 10 and int(step.max()) > 990 and int(cond.min()) >= 500 and int(cond.max()) > 990
    assert int(cond.min()) < 510 and not d.step[0, 3 * n:].any() and not d.cond_step[0, 3 * n:].any()
    assert 0.4 < float(d.noisy_cond.float().mean()) < 0.6
    assert set(d.chunk_size.tolist()) == {1, 2, 3, 4} and set(d.window.tolist()) == set(range(4, 65))
    assert d.action_noise is None and d.noise[0, 0, :3 * n].std() > 0.9
