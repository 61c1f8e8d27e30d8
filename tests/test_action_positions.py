"""Action-step RoPE positions: each action step of a latent frame at its own position (LingBot-VA's
rule), so the model can tell the steps of a frame apart; the older rule for old checkpoints."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from flexpack.attention.flex import FlexAttnFunc
from flexpack.families.wan.config import wan_config
from flexpack.families.wan.model import WanVA
from flexpack.models.rope import action_step_offsets, rope_positions
from flexpack.packing.collate import PackCollate
from flexpack.packing.layout import ACTION, VIDEO, SequenceLayout

C, CA, A = 4, 7, 4


def _items(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [dict(latent=torch.randn(C, n, 2, 2, generator=g), action=torch.randn(CA, n, A, generator=g),
                 action_mask=torch.ones(CA, n, A, dtype=torch.bool), text=torch.randn(3, 32, generator=g),
                 text_len=3, episode_index=i) for i, n in enumerate(lengths)]


def _model(**kw) -> WanVA:
    torch.manual_seed(0)
    model = WanVA(wan_config("tiny", in_channels=C, patch_size=(1, 1, 1), **kw), attn=FlexAttnFunc("dense"))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def test_positions_of_action_steps_follow_the_fractional_frame_offset_rule():
    lay = SequenceLayout.from_rows([[2, 3]], 6)
    for copies in (1, 2):
        tl = lay.tokens(video_tokens=4, action_tokens=3, copies=copies, grid_hw=(2, 2))
        f, h, w = rope_positions(tl)
        assert f.dtype == torch.float64
        act, vid = tl.stream == ACTION, tl.stream == VIDEO
        # video tokens keep the layout's frame and grid positions
        assert torch.equal(f[vid], tl.frame[vid].double()) and torch.equal(h[vid], tl.hpos[vid].double())
        assert torch.equal(w[vid], tl.wpos[vid].double())
        # action step j of a frame: frame + (j + 1) / 4, spatial (-1, -1)
        idx = tl.action_index.reshape(-1, 3)  # (units, steps) token positions
        want = tl.frame[idx[:, 0]].double()[:, None] + torch.tensor([0.25, 0.5, 0.75], dtype=torch.float64)
        assert torch.equal(f[idx], want)
        assert (h[act] == -1).all() and (w[act] == -1).all()
    # the older rule: the layout's own positions; another spatial id and other frame ids are parameters
    f0, h0, w0 = rope_positions(tl, "frame")
    assert torch.equal(f0, tl.frame.double()) and torch.equal(h0, tl.hpos.double())
    f2, h2, _ = rope_positions(tl, action_spatial=7.0, frame=tl.frame * 2 + 1)
    assert torch.equal(f2[idx], (tl.frame[idx[:, 0]] * 2 + 1).double()[:, None] + torch.tensor([0.25, 0.5, 0.75],
                                                                                                dtype=torch.float64))
    assert (h2[tl.stream == ACTION] == 7).all()
    with pytest.raises(ValueError, match="action_positions must be one of"):
        rope_positions(tl, "grid")


def test_action_positions_equal_lingbot_grid_ids():
    utils = pytest.importorskip("lerobot.policies.lingbot_va.utils")
    F = 5
    tl = SequenceLayout.from_rows([[F]], F).tokens(video_tokens=1, action_tokens=A)
    f, h, w = rope_positions(tl)
    act = tl.action_index.reshape(-1)  # frame-major, step-minor: LingBot's (f, h = step, w = 1) grid order
    grid = utils.get_mesh_id(F, A, 1, 1, action=True)  # (4, F*A): frame, height, width, stream
    torch.testing.assert_close(f[act], grid[0].double(), rtol=0, atol=1e-6)
    assert torch.equal(h[act], grid[1].double()) and torch.equal(w[act], grid[2].double())
    torch.testing.assert_close(action_step_offsets(A), torch.arange(1, A + 1, dtype=torch.float64) / (A + 1))


def _permuted_steps(batch, perm):
    """The batch with the action steps of frame 1 of every row reordered by ``perm``."""
    act, mask = batch.action.clone(), batch.action_mask.clone()
    act[:, :, 1] = act[:, :, 1][..., perm]
    mask[:, :, 1] = mask[:, :, 1][..., perm]
    return replace(batch, action=act, action_mask=mask)


@pytest.mark.parametrize("rule", ["step", "frame"])
def test_permuting_a_frames_action_steps_changes_the_output_only_under_the_step_rule(rule):
    """Under the old rule the steps of a frame are interchangeable: permuting them permutes the outputs
    exactly. With per-step positions the model sees their order (the default must be this one)."""
    batch = PackCollate(8)(_items([4, 3]))
    perm = torch.tensor([2, 0, 3, 1])
    t = torch.full((1, 8), 500.0)
    model = _model() if rule == "step" else _model(action_positions="frame")
    assert model.config.action_positions == rule
    with torch.no_grad():
        out = model(batch, timestep=t)
        out_p = model(_permuted_steps(batch, perm), timestep=t)
    permuted_back = out_p.action.clone()
    permuted_back[:, :, 1] = out_p.action[:, :, 1][..., torch.argsort(perm)]
    same = torch.allclose(permuted_back, out.action, atol=1e-5) and torch.allclose(out_p.video, out.video, atol=1e-5)
    assert same == (rule == "frame"), (rule, (permuted_back - out.action).abs().max())


def _as_before_the_rule(path):
    """A checkpoint as made before the rule was recorded: train_state.json without it (manifest redone)."""
    from flexpack.run.state import manifest

    state = json.loads((path / "train_state.json").read_text())
    del state["action_positions"]
    (path / "train_state.json").write_text(json.dumps(state))
    (path / manifest.MANIFEST).write_text(json.dumps(manifest.describe(path)))
    return path


def test_checkpoints_record_their_rule_and_one_of_another_rule_is_refused_in_one_line(tmp_path):
    from flexpack.run.state import checkpoint

    old = _model(action_positions="frame")
    path = checkpoint.save(tmp_path / "new", 1, _model(), None)
    assert json.loads((path / "train_state.json").read_text())["action_positions"] == "step"
    checkpoint.load(path, _model(), restore_rng=False)
    with pytest.raises(ValueError, match="trained with action_positions = 'step', the config builds 'frame'"):
        checkpoint.load(path, _model(action_positions="frame"), restore_rng=False)
    # a checkpoint from before the rule was recorded holds weights of the old rule: refused by a "step" model,
    # with the override that loads it
    legacy = _as_before_the_rule(checkpoint.save(tmp_path / "old", 1, old, None))
    with pytest.raises(ValueError, match=r"action_positions = 'frame' \(it records no rule.*"
                                         r"--set model.overrides.action_positions=frame\)") as err:
        checkpoint.load(legacy, _model(), restore_rng=False)
    assert "\n" not in str(err.value)
    fresh = _model(action_positions="frame")
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    checkpoint.load(legacy, fresh, restore_rng=False)  # under the old rule it loads
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict().values(), old.state_dict().values()))
    # a model without actions has no rule to match
    no_actions = _as_before_the_rule(checkpoint.save(tmp_path / "c3", 1, _model(action_channels=0), None))
    checkpoint.load(no_actions, _model(action_channels=0), restore_rng=False)
    with pytest.raises(ValueError, match="action_positions must be one of"):
        wan_config("tiny", action_positions="grid")
