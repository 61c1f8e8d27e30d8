"""Flow-matching objective: σ sampling, masking of padding and unused action channels, accumulation."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from flexpack.attention.flex import FlexAttnFunc
from flexpack.families.wan.config import wan_config
from flexpack.families.wan.model import WanVA
from flexpack.flow.objective import (
    FlowMatchingConfig,
    flow_loss,
    loss_counts,
    make_flow_sample,
    sample_sigma,
    shift_sigma,
    timestep_weight,
)
from flexpack.packing.collate import PackCollate, PadCollate
from flexpack.packing.layout import SequenceLayout

C, H, W, CA, A, L, DT = 4, 4, 4, 7, 2, 3, 32


def make_items(lengths: list[int], seed: int = 0) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    items = []
    for i, n in enumerate(lengths):
        mask = torch.rand(CA, n, A, generator=g) > 0.3
        mask[-2:] = False  # unused action channels
        items.append(dict(latent=torch.randn(C, n, H, W, generator=g), action=torch.randn(CA, n, A, generator=g),
                          action_mask=mask, text=torch.randn(L, DT, generator=g), text_len=L, episode_index=i))
    return items


def tiny() -> WanVA:
    torch.manual_seed(0)
    return WanVA(wan_config("tiny"), attn=FlexAttnFunc("dense"))


def grads(model: WanVA) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_shift_sigma_values():
    s = torch.tensor([0.0, 0.25, 0.5, 1.0])
    assert torch.equal(shift_sigma(s, 1.0), s)
    assert torch.allclose(shift_sigma(s, 3.0), torch.tensor([0.0, 0.5, 0.75, 1.0]))


def test_bell_weight_has_mean_one():
    sig = (torch.arange(100000, dtype=torch.float64) + 0.5) / 100000
    assert abs(float(timestep_weight(sig, "bell").mean()) - 1.0) < 1e-6
    assert float(timestep_weight(torch.tensor(0.5), "bell")) > float(timestep_weight(torch.tensor(0.0), "bell"))


def test_sample_sigma_groups_padding_and_seed():
    pack = SequenceLayout.from_rows([[5, 3]], 10)
    pad = SequenceLayout.from_rows([[5], [3]], 6, mode="pad")
    for chunk, check in ((1, "distinct"), (2, "pairs"), (None, "episode")):
        cfg = FlowMatchingConfig(chunk_size=chunk)
        s = sample_sigma(pack, cfg, torch.Generator().manual_seed(0))
        assert s.shape == (1, 10) and torch.all(s[0, 8:] == 0)  # padding
        e0 = s[0, :5]
        if check == "distinct":
            assert e0.unique().numel() == 5
        elif check == "pairs":
            assert e0[0] == e0[1] and e0[2] == e0[3] and e0[1] != e0[2]
        else:
            assert torch.all(e0 == e0[0]) and s[0, 5] != e0[0]
        # values follow (episode, chunk), not rows: the pad layout gets the same σ per episode
        sp = sample_sigma(pad, cfg, torch.Generator().manual_seed(0))
        assert torch.equal(sp[0, :5], e0) and torch.equal(sp[1, :3], s[0, 5:8])
    a = sample_sigma(pack, FlowMatchingConfig(), torch.Generator().manual_seed(1))
    assert torch.equal(a, sample_sigma(pack, FlowMatchingConfig(), torch.Generator().manual_seed(1)))


def test_loss_value_is_a_mean_over_valid_elements():
    batch = PackCollate(10)(make_items([4, 3]))
    cfg = FlowMatchingConfig(latent_weight=1.0, action_weight=0.5)
    sample = make_flow_sample(batch, cfg, torch.Generator().manual_seed(0))
    valid = batch.layout.frame_valid
    # prediction = target + 1 on valid entries, nonsense (NaN) on padding
    video = torch.where(valid[:, None, :, None, None], sample.target_latent + 1, float("nan"))
    action = sample.target_action + 2 * batch.action_mask
    out = flow_loss(SimpleNamespace(video=video, action=action), sample, batch, cfg)
    assert float(out.latent_loss) == pytest.approx(1.0)
    assert float(out.action_loss) == pytest.approx(4.0)  # only mask-True entries count
    assert float(out.loss) == pytest.approx(1.0 + 0.5 * 4.0)
    lat_n, act_n = loss_counts(batch)
    assert float(lat_n) == 7 * C * H * W and float(act_n) == float(batch.action_mask.sum())
    # bell weighting multiplies each frame's error by w(σ)
    bell = flow_loss(SimpleNamespace(video=video, action=action), sample, batch, replace(cfg, weighting="bell"))
    w = timestep_weight(sample.sigma, "bell")[valid]
    assert float(bell.latent_loss) == pytest.approx(float(w.mean()), rel=1e-5)


def test_padding_and_unused_action_channels_change_neither_loss_nor_gradients():
    batch = PackCollate(10)(make_items([4, 3], seed=1))
    cfg = FlowMatchingConfig(teacher_forcing=False)
    results = []
    for garbage in (False, True):
        b = batch
        if garbage:
            pad = ~batch.layout.frame_valid
            lat = batch.latent.clone()
            lat[pad[:, None].expand(-1, C, -1)] = 123.0
            act = torch.where(batch.action_mask, batch.action, torch.randn_like(batch.action) * 50)
            b = replace(batch, latent=lat, action=act)
        model = tiny()
        sample = make_flow_sample(b, cfg, torch.Generator().manual_seed(0))
        out = flow_loss(model(sample.inputs, **sample.model_kwargs()), sample, b, cfg)
        out.loss.backward()
        results.append((out.loss.detach(), grads(model)))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    # ... while a real value does change them (the test can fail)
    act = batch.action.clone()
    act[batch.action_mask] += 1.0
    model = tiny()
    b = replace(batch, action=act)
    sample = make_flow_sample(b, cfg, torch.Generator().manual_seed(0))
    assert not torch.equal(flow_loss(model(sample.inputs, **sample.model_kwargs()), sample, b, cfg).loss.detach(),
                           results[0][0])


def _grid(collate, items, per_episode: list[torch.Tensor], key: str) -> torch.Tensor:
    """Arrange per-episode tensors (shaped like item[key]) with the collate, as the batch is arranged."""
    if key == "sigma":
        arranged = collate([dict(latent=s[None, :, None, None]) for s in per_episode]).latent
        return arranged[:, 0, :, 0, 0]
    fake = [dict(latent=v if key == "latent" else it["latent"], action=v if key == "action" else it["action"])
            for it, v in zip(items, per_episode)]
    out = collate(fake)
    return out.latent if key == "latent" else out.action


@pytest.mark.parametrize("collate", [PackCollate(16), PadCollate(pad_multiple=4)], ids=["pack", "pad"])
def test_four_micro_batches_of_one_equal_one_batch_of_four(collate):
    lengths = [3, 5, 2, 4]
    items = make_items(lengths, seed=2)
    cfg = FlowMatchingConfig(action_weight=0.7, weighting="bell")
    g = torch.Generator().manual_seed(5)
    sig = [torch.rand(n, generator=g) for n in lengths]
    noise = [torch.randn(C, n, H, W, generator=g) for n in lengths]
    anoise = [torch.randn(CA, n, A, generator=g) for n in lengths]

    def loss_of(model, col, its, s, n, a):
        b = col(its)
        sample = make_flow_sample(b, cfg, sigma=_grid(col, its, s, "sigma"), noise=_grid(col, its, n, "latent"),
                                  action_noise=_grid(col, its, a, "action"))
        return b, flow_loss(model(sample.inputs, **sample.model_kwargs()), sample, b, cfg)

    model = tiny()
    _, full = loss_of(model, collate, items, sig, noise, anoise)
    full.loss.backward()
    g_full = grads(model)

    model = tiny()
    singles = [PackCollate(n)([it]) for n, it in zip(lengths, items)]
    counts = [loss_counts(b) for b in singles]
    totals = (sum(c[0] for c in counts), sum(c[1] for c in counts))
    acc, means = 0.0, []
    for e, n in enumerate(lengths):
        _, part = loss_of(model, PackCollate(n), [items[e]], [sig[e]], [noise[e]], [anoise[e]])
        share = part.accumulation_loss(totals)
        share.backward()
        acc += float(share.detach())
        means.append(float(part.loss.detach()))
    assert acc == pytest.approx(full.loss.item(), rel=1e-6)
    grad_err = float((grads(model) - g_full).abs().max() / g_full.abs().max())
    print(f"accumulated {acc:.8f} vs batch {full.loss.item():.8f}; max grad rel err {grad_err:.1e}")
    assert grad_err <= 1e-5
    # the naive mean of per-micro-batch means is a different objective
    assert abs(sum(means) / 4 - full.loss.item()) > 1e-4


def test_teacher_forcing_inputs():
    batch = PackCollate(9)(make_items([4, 3], seed=3))
    sample = make_flow_sample(batch, FlowMatchingConfig(teacher_forcing=True), torch.Generator().manual_seed(0))
    valid = batch.layout.frame_valid
    assert sample.inputs.latent.shape == (2, *batch.latent.shape)
    assert torch.equal(sample.inputs.latent[1][:, :, valid[0]], batch.latent[:, :, valid[0]])  # clean copy = data
    assert torch.all(sample.inputs.latent[:, :, :, ~valid[0]] == 0)
    assert torch.all(sample.timestep[1] == 0) and torch.all(sample.timestep[0][~valid] == 0)
    assert sample.inputs.action.shape == (2, *batch.action.shape)


def test_config_errors():
    with pytest.raises(ValueError, match="weighting"):
        FlowMatchingConfig(weighting="cosine")
    with pytest.raises(ValueError, match="shift"):
        FlowMatchingConfig(shift=0)
    with pytest.raises(ValueError, match="chunk_size"):
        FlowMatchingConfig(chunk_size=0)
    batch = PackCollate(8)(make_items([4]))
    with pytest.raises(ValueError, match="sigma"):
        make_flow_sample(batch, FlowMatchingConfig(), sigma=torch.zeros(1, 7))
