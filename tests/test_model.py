"""WanVA on packed and padded batches: per-episode equivalence, masking, RoPE, training, presets."""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch

from flexpack.attention.flex import FlexAttnFunc
from flexpack.families.wan.config import wan_config
from flexpack.families.wan.model import WanVA
from flexpack.flow.objective import FlowMatchingConfig, make_flow_sample, training_loss
from flexpack.models.rope import apply_rope, rope_bands, rope_cos_sin
from flexpack.packing.collate import PackCollate, PadCollate
from flexpack.packing.layout import SequenceLayout

C, H, W, CA, A, L, DT = 4, 4, 6, 7, 3, 5, 32
REL = 1e-5


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a - b).abs().max() / b.abs().max().clamp(min=1e-12))


def make_items(lengths: list[int], seed: int = 0, text_lens: list[int] | None = None) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    items = []
    for i, n in enumerate(lengths):
        mask = torch.rand(CA, n, A, generator=g) > 0.3
        mask[-2:] = False  # two unused action channels
        tl = text_lens[i] if text_lens else L - (i % 3)
        items.append(dict(
            latent=torch.randn(C, n, H, W, generator=g), action=torch.randn(CA, n, A, generator=g), action_mask=mask,
            text=torch.randn(L, DT, generator=g), text_len=tl, episode_index=i,
        ))
    return items


def tiny(**kw) -> WanVA:
    torch.manual_seed(0)
    model = WanVA(wan_config("tiny", **kw), attn=FlexAttnFunc("dense"))
    with torch.no_grad():  # random head/modulation so every path carries signal
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model


def frame_grid(items: list[dict], collate, values: list[torch.Tensor]) -> torch.Tensor:
    """Arrange per-episode per-frame values (F,) into the collate's (R, Fr) grid."""
    grid_items = [dict(latent=v[None, :, None, None].expand(1, -1, 1, 1)) for v in values]
    return collate(grid_items).latent[:, 0, :, 0, 0]


def run(model, batch, t_RF, **kw):
    return model(batch, timestep=t_RF, action_timestep=t_RF * 0.5, **kw)


def garbage_in_padding(batch):
    pad = ~batch.layout.frame_valid
    lat = batch.latent.clone()
    lat[pad[:, None].expand(-1, C, -1)] = 1e3
    act = batch.action.clone()
    act[pad[:, None, :, None].expand_as(act)] = -7.0
    return replace(batch, latent=lat, action=act)


@pytest.mark.parametrize("mode", ["pack", "pad"])
@pytest.mark.parametrize("mask,kw", [("document", {}), ("chunk_causal", {"chunk_size": 2})])
def test_batched_forward_equals_per_episode(mode, mask, kw):
    lengths = [3, 5, 2]
    items = make_items(lengths, text_lens=[5, 3, 1])
    collate = PackCollate(12) if mode == "pack" else PadCollate(pad_multiple=3)
    batch = garbage_in_padding(collate(items))  # pad values must not matter
    g = torch.Generator().manual_seed(1)
    t_eps = [torch.rand(n, generator=g) * 1000 for n in lengths]
    model = tiny()
    with torch.no_grad():
        out = run(model, batch, frame_grid(items, collate, t_eps), mask=mask, **kw)
        lay = batch.layout
        for e, n in enumerate(lengths):
            single = PackCollate(n)([items[e]])
            ref = run(model, single, t_eps[e][None], mask=mask, **kw)
            r, s = int(lay.episode_row[e]), int(lay.episode_start[e])
            assert rel_err(out.video[r, :, s : s + n], ref.video[0]) <= REL
            assert rel_err(out.action[r, :, s : s + n], ref.action[0]) <= REL
        assert torch.all(out.video[~lay.frame_valid.unsqueeze(1).expand(-1, C, -1)] == 0)  # pad outputs zeroed


def test_teacher_forcing_packed_equals_per_episode():
    lengths = [4, 3]
    items = make_items(lengths, seed=3)
    cfg = FlowMatchingConfig(teacher_forcing=True)
    model = tiny()
    g = torch.Generator().manual_seed(0)
    sig = [torch.rand(n, generator=g) for n in lengths]
    packed = PackCollate(9)(items)
    sp = make_flow_sample(packed, cfg, sigma=frame_grid(items, PackCollate(9), sig),
                          noise=torch.zeros_like(packed.latent), action_noise=torch.zeros_like(packed.action))
    assert sp.inputs.latent.shape[0] == 2 and torch.all(sp.timestep[1] == 0)
    with torch.no_grad():
        out = model(sp.inputs, **sp.model_kwargs(), mask="teacher_forcing", chunk_size=2)
        for e, n in enumerate(lengths):
            single = PackCollate(n)([items[e]])
            s1 = make_flow_sample(single, cfg, sigma=sig[e][None], noise=torch.zeros_like(single.latent),
                                  action_noise=torch.zeros_like(single.action))
            ref = model(s1.inputs, **s1.model_kwargs(), mask="teacher_forcing", chunk_size=2)
            s = int(packed.layout.episode_start[e])
            assert rel_err(out.video[0, :, s : s + n], ref.video[0]) <= REL
            assert rel_err(out.action[0, :, s : s + n], ref.action[0]) <= REL


def test_episodes_do_not_leak_and_timesteps_are_per_frame():
    items = make_items([4, 4], seed=5)
    batch = PackCollate(8)(items)
    model = tiny()
    t = torch.full((1, 8), 500.0)
    with torch.no_grad():
        base = run(model, batch, t).video
        lat = batch.latent.clone()
        lat[:, :, 5] += 1.0  # episode 1, frame 1
        changed = run(model, replace(batch, latent=lat), t).video
        assert torch.equal(changed[:, :, :4], base[:, :, :4])  # episode 0 untouched, bit for bit
        assert not torch.allclose(changed[:, :, 4:], base[:, :, 4:])
        t2 = t.clone()
        t2[0, 2] = 0.0  # one frame of episode 0 is clean: its output changes
        out2 = run(model, batch, t2).video
        assert not torch.allclose(out2[:, :, 2], base[:, :, 2])
        assert torch.equal(out2[:, :, 4:], base[:, :, 4:])


def test_masks_are_prepared_once_per_forward_and_shared_by_every_block():
    class Counting(FlexAttnFunc):
        def __init__(self):
            super().__init__("dense")
            self.prepared, self.seen = [], set()

        def prepare(self, *args, **kw):
            self.prepared.append(super().prepare(*args, **kw))
            return self.prepared[-1]

        def __call__(self, q, k, v, prep, *args, **kw):
            self.seen.add(id(prep))
            return super().__call__(q, k, v, prep, *args, **kw)

        def bind(self, prep, head_dim, **kw):  # the model binds each prepared mask once per forward
            bound = super().bind(prep, head_dim, **kw)
            calls = self.bound.setdefault(id(bound), [bound, 0])

            def counted(q, k, v):
                calls[1] += 1
                self.seen.add(id(bound.prep))
                return bound(q, k, v)
            return counted

    attn = Counting()
    attn.bound = {}
    model = WanVA(wan_config("tiny", num_layers=3), attn=attn)
    batch = PackCollate(9)(make_items([5, 3]))
    with torch.no_grad():
        run(model, batch, torch.full((1, 9), 400.0), mask="chunk_causal", chunk_size=2)
    assert [p.kind for p in attn.prepared] == ["chunk_causal", "text"]  # once, not once per block
    assert attn.seen == {id(p) for p in attn.prepared}
    assert sorted(n for _, n in attn.bound.values()) == [3, 3]  # each bound mask serves all 3 blocks
    # 2 episodes -> 2 text slots; 3 episodes -> 4 slots (power of two: few compiled shapes)
    L = batch.text.shape[1]
    assert attn.prepared[1].kv_len == 2 * L
    batch3 = PackCollate(12)(make_items([5, 3, 2]))
    with torch.no_grad():
        run(model, batch3, torch.full((1, 12), 400.0), mask="chunk_causal", chunk_size=2)
    assert attn.prepared[-1].kind == "text" and attn.prepared[-1].kv_len == 4 * batch3.text.shape[1]


def test_rope_bands_and_action_tokens_have_identity_spatial_rotation():
    assert rope_bands(128) == (44, 42, 42) and rope_bands(12) == (4, 4, 4)
    with pytest.raises(ValueError, match="even"):
        rope_bands(7)
    T, Hh, D = 5, 2, 12
    x = torch.randn(T, Hh, D)
    frame = torch.arange(T)
    cos, sin = rope_cos_sin(frame, torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long), D)
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[..., 4:], x[..., 4:])  # h/w bands at position 0 are the identity
    assert torch.equal(y[0], x[0]) and not torch.allclose(y[1:, :, :4], x[1:, :, :4])
    # relative: shifting all frame positions leaves q·k unchanged
    k = torch.randn(T, Hh, D)
    c2, s2 = rope_cos_sin(frame + 7, torch.zeros(T, dtype=torch.long), torch.zeros(T, dtype=torch.long), D)
    d1 = torch.einsum("thd,shd->hts", apply_rope(x, cos, sin), apply_rope(k, cos, sin))
    d2 = torch.einsum("thd,shd->hts", apply_rope(x, c2, s2), apply_rope(k, c2, s2))
    assert torch.allclose(d1, d2, atol=1e-5)


def test_activation_checkpointing_gives_same_gradients():
    batch = PackCollate(8)(make_items([5, 3], seed=2))
    cfg = FlowMatchingConfig()
    grads = []
    for ckpt in (False, True):
        model = tiny(activation_checkpointing=ckpt)
        loss = training_loss(model, batch, cfg, torch.Generator().manual_seed(0)).loss
        loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-5, atol=1e-7)


def test_bf16_forward_is_finite_and_close():
    batch = PackCollate(8)(make_items([5, 3], seed=4))
    model = tiny()
    t = torch.full((1, 8), 300.0)
    with torch.no_grad():
        ref = run(model, batch, t).video
        m16 = model.to(torch.bfloat16)
        out = run(m16, batch, t).video  # fp32 data into a bf16 model: inputs follow the weights
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all()
    assert rel_err(out.float(), ref) < 0.1


def test_tiny_trains_on_cpu_in_seconds():
    batch = PackCollate(12)(make_items([5, 4, 3], seed=6))
    model = WanVA(wan_config("tiny"), attn=FlexAttnFunc("dense"))
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cfg = FlowMatchingConfig()
    losses = []
    start = time.perf_counter()
    for _ in range(25):
        # a fixed batch and fixed noise: the loss must go down
        loss = training_loss(model, batch, cfg, torch.Generator().manual_seed(0)).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    per_step = (time.perf_counter() - start) / len(losses)
    print(f"tiny: {model.num_parameters()} params, {per_step * 1e3:.1f} ms/step, "
          f"loss {losses[0]:.3f} -> {losses[-1]:.3f}")
    assert losses[-1] < 0.7 * losses[0]
    assert per_step < 1.0


def test_5b_preset_on_meta_device():
    with torch.device("meta"):
        model = WanVA(wan_config("wan2.2-5b"), attn=FlexAttnFunc("dense"))
    n = model.num_parameters()
    print(f"wan2.2-5b preset: {n:,} parameters")
    assert 4.9e9 < n < 5.1e9
    assert all(p.is_meta for p in model.parameters())


def test_bad_inputs_raise_value_errors():
    batch = PackCollate(8)(make_items([5, 3]))
    model = tiny()
    with pytest.raises(ValueError, match="timestep"):
        model(batch, timestep=torch.zeros(1, 7))
    with pytest.raises(ValueError, match="layout has"):
        model(batch, SequenceLayout.from_rows([[5]], 6), timestep=torch.zeros(1, 6))
    with pytest.raises(ValueError, match="divisible"):
        wan_config("tiny", dim=65)
    with pytest.raises(ValueError, match="unknown WanVA preset"):
        wan_config("huge")
    with pytest.raises(ValueError, match="action_channels=0"):
        WanVA(wan_config("tiny", action_channels=0), attn=FlexAttnFunc("dense"))(batch, timestep=torch.zeros(1, 8))
    with pytest.raises(ValueError, match="temporal patch"):
        WanVA(wan_config("tiny", patch_size=(2, 2, 2)), attn=FlexAttnFunc("dense"))(batch, timestep=torch.zeros(1, 8))
