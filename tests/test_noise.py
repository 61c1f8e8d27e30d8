"""Counter-based per-episode noise: standard normal, keyed by episode seed and in-episode coordinates."""

import math

import torch

from flexpack.flow.noise import _mix32, _normal, episode_flow_sample
from flexpack.flow.objective import FlowMatchingConfig
from flexpack.packing.collate import PackCollate


def item(F, C=4, H=4, W=6, ca=3, A=2, idx=0):
    g = torch.Generator().manual_seed(100 + idx)
    return {"latent": torch.randn(C, F, H, W, generator=g), "text": torch.randn(5, 8, generator=g),
            "action": torch.randn(ca, F, A, generator=g), "action_mask": torch.ones(ca, F, A, dtype=torch.bool),
            "episode_index": idx}


def test_normal_draws_are_standard_normal_and_independent():
    ctr = torch.arange(400_000)
    z = _normal(ctr, torch.tensor(123456789), torch.tensor(987654321))
    assert abs(float(z.mean())) < 0.01 and abs(float(z.std()) - 1.0) < 0.01
    assert abs(float((z.abs() < 1).float().mean()) - 0.6827) < 0.005  # the normal's 1-sigma mass
    assert abs(float((z.abs() < 2).float().mean()) - 0.9545) < 0.003
    assert abs(float(torch.corrcoef(torch.stack([z[:-1], z[1:]]))[0, 1])) < 0.01  # neighbours uncorrelated
    other = _normal(ctr, torch.tensor(123456790), torch.tensor(987654321))  # a key one apart
    assert abs(float(torch.corrcoef(torch.stack([z, other]))[0, 1])) < 0.01
    assert torch.isfinite(z).all()


def test_mix32_stays_in_32_bits_and_spreads_neighbours():
    h = _mix32(torch.arange(1 << 16))
    assert int(h.min()) >= 0 and int(h.max()) < 2**32 and h.unique().numel() == 1 << 16
    bits = torch.stack([(h >> b) & 1 for b in range(32)]).float().mean(1)
    assert float((bits - 0.5).abs().max()) < 0.01  # every output bit is balanced


def test_episode_noise_is_deterministic_and_seeded_per_episode():
    cfg = FlowMatchingConfig()
    batch = PackCollate(20)([item(5, idx=0), item(7, idx=1)])
    a = episode_flow_sample(batch, cfg, [11, 22])
    b = episode_flow_sample(batch, cfg, [11, 22])
    c = episode_flow_sample(batch, cfg, [11, 23])
    assert torch.equal(a.target_latent, b.target_latent) and torch.equal(a.sigma, b.sigma)
    assert torch.equal(a.target_latent[0, :, :5], c.target_latent[0, :, :5])  # episode 0 unchanged
    assert not torch.equal(a.target_latent[0, :, 5:12], c.target_latent[0, :, 5:12])  # episode 1 re-seeded
    assert float(a.sigma[0, 12:].abs().max()) == 0.0 and float(a.inputs.latent[0, :, 12:].abs().max()) == 0.0
    s = a.sigma[0, :12]
    assert float(s.min()) > 0.0 and float(s.max()) < 1.0


def test_cropping_an_episode_keeps_the_noise_of_its_frames():
    cfg = FlowMatchingConfig(chunk_size=2)
    full, crop = item(6), item(6)
    crop = {**crop, "latent": crop["latent"][:, :4], "action": crop["action"][:, :4],
            "action_mask": crop["action_mask"][:, :4]}
    a = episode_flow_sample(PackCollate(6)([full]), cfg, [5])
    b = episode_flow_sample(PackCollate(4)([crop]), cfg, [5])
    noise_a = a.target_latent + PackCollate(6)([full]).latent
    noise_b = b.target_latent + PackCollate(4)([crop]).latent
    assert torch.allclose(noise_a[..., :4, :, :], noise_b, atol=1e-6)
    assert torch.equal(a.sigma[:, :4], b.sigma)
    assert torch.equal(a.sigma[0, 0], a.sigma[0, 1]) and not torch.equal(a.sigma[0, 1], a.sigma[0, 2])  # per chunk
    assert math.isfinite(float(a.target_action.abs().max()))
