"""The lingbot-va model: LeRobot's weights in and out strictly, its forward equal to LeRobot's
``forward_train``, packed episodes equal to each episode alone."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from flexpack.attention.flex import FlexAttnFunc
from flexpack.families.lingbot.config import LingbotConfig, config_from_lerobot, lingbot_config
from flexpack.families.lingbot.convert import (
    build_from_lerobot,
    from_lerobot_state_dict,
    load_lerobot,
    to_lerobot_state_dict,
)
from flexpack.families.lingbot.model import LingbotVA, lingbot_positions
from flexpack.packing.collate import Batch
from flexpack.packing.layout import SequenceLayout
from lingbot_ref import (
    LU,
    TEXT_TOKENS,
    eager_flex,
    fp32_attention,
    outputs_to_grid,
    reference_model,
    rel_err,
    train_inputs,
)

CFG = lingbot_config("lingbot-va-tiny")


def test_state_dict_round_trip_is_strict_both_ways() -> None:
    """LeRobot's state dict loads into LingbotVA (every tensor used and filled); the export loads into a
    fresh LeRobot model with strict=True, under ``transformer.`` for a policy; every tensor equal."""
    ref = reference_model(CFG)
    sd = ref.state_dict()
    ours = build_from_lerobot({"transformer." + k: v for k, v in sd.items()}, CFG, attn=FlexAttnFunc("dense"))
    assert ours.head_modulation.shape == (2, CFG.dim) and not ours.action_text_embed.fc1.weight.requires_grad
    back = to_lerobot_state_dict(ours.state_dict(), prefix="")
    assert back.keys() == sd.keys() and all(back[k].equal(sd[k]) for k in sd)
    fresh = reference_model(CFG, seed=1)
    fresh.load_state_dict(back, strict=True)
    assert all(fresh.state_dict()[k].equal(sd[k]) for k in sd)
    policy = to_lerobot_state_dict(ours.state_dict())
    assert policy.keys() == {"transformer." + k for k in sd}
    # the bare names of an upstream transformer/ folder load the same
    again = build_from_lerobot(sd, CFG)
    assert all(t.equal(ours.state_dict()[k]) for k, t in again.state_dict().items())


@pytest.mark.parametrize("change,match", [
    ("width", r"'scale_shift_table' has shape \(2, 96\), the config needs \(2, 64\) \(a checkpoint of another width"),
    ("depth", r"lacks tensor 'blocks\.1\.scale_shift_table'"),
    ("extra", r"'blocks\.0\.attn1\.norm_added_q\.weight' has no counterpart"),
    ("wan", r"'patch_embedding\.weight' has no counterpart"),
    ("mixed", r"tensor 'other\.weight' is outside the policy's transformer"),
])
def test_wrong_checkpoints_are_one_line_errors(change: str, match: str) -> None:
    if change == "width":
        sd = reference_model(replace(CFG, attention_head_dim=48)).state_dict()
    else:
        sd = reference_model(CFG).state_dict()
    if change == "depth":
        sd = {k: v for k, v in sd.items() if not k.startswith("blocks.1.")}
    elif change == "extra":
        sd["blocks.0.attn1.norm_added_q.weight"] = torch.ones(CFG.dim)
    elif change == "wan":  # a plain Wan video checkpoint has a Conv3d patch embedding
        sd["patch_embedding.weight"] = sd.pop("patch_embedding_mlp.weight").reshape(CFG.dim, 48, 1, 2, 2)
    elif change == "mixed":
        sd = {"transformer." + k: v for k, v in sd.items()} | {"other.weight": torch.ones(1)}
    with pytest.raises(ValueError, match=match) as err:
        from_lerobot_state_dict(sd, CFG, source="ckpt")
    assert "\n" not in str(err.value) and str(err.value).startswith("ckpt: ")


def test_head_dims_lerobots_rope_cannot_run_are_refused() -> None:
    """LeRobot's RoPE only fits heads with an even head_dim // 3; there its split is rope_bands'."""
    for hd in (24, 30, 32, 128):
        LingbotConfig(attention_head_dim=hd, num_attention_heads=1)
    for hd in (16, 40, 64):
        with pytest.raises(ValueError, match=f"attention_head_dim={hd} does not fit LeRobot's RoPE"):
            LingbotConfig(attention_head_dim=hd, num_attention_heads=1)
    # LeRobot's own RoPE at head_dim 64 gives 31 rotation pairs for 32: its attention cannot run
    assert LU.WanRotaryPosEmbed(64, (1, 2, 2), 1024)(torch.zeros(1, 3, 5)).shape[-1] == 31


def test_load_a_lerobot_policy_folder_and_a_transformer_folder(tmp_path) -> None:
    """``load_lerobot`` reads the shape from config.json: a LeRobot policy saved by LeRobot
    (``model.safetensors``, ``transformer.`` keys, bf16) and an upstream ``transformer/`` folder."""
    from lerobot.configs.types import FeatureType, PolicyFeature
    from lerobot.policies.lingbot_va.configuration_lingbot_va import LingBotVAConfig
    from lerobot.policies.lingbot_va.modeling_lingbot_va import LingBotVAPolicy

    feats = {"observation.images.image": PolicyFeature(type=FeatureType.VISUAL, shape=(3, 32, 32))}
    policy = LingBotVAPolicy(LingBotVAConfig(**CFG.lerobot_fields(), device="cpu", input_features=feats))
    policy.save_pretrained(tmp_path / "policy")
    got = load_lerobot(tmp_path / "policy")
    assert got.family_config == CFG and got.head_proj.weight.dtype == torch.bfloat16
    want = to_lerobot_state_dict(got.state_dict())
    assert all(t.equal(want[k]) for k, t in policy.state_dict().items())
    ref = reference_model(CFG)
    ref.save_pretrained(tmp_path / "transformer")
    got = load_lerobot(tmp_path / "transformer", dtype=torch.float32)
    assert all(t.equal(got.state_dict()[k]) for k, t in from_lerobot_state_dict(ref.state_dict(), CFG).items())
    raw = json.loads((tmp_path / "policy" / "config.json").read_text())
    with pytest.raises(ValueError, match="a LeRobot policy of type 'act', not 'lingbot_va'"):
        config_from_lerobot({**raw, "type": "act"})


def clips(B: int, F: int, H: int, W: int, seed: int = 1) -> dict:
    """Random noisy/clean latents and actions, per-frame timesteps of both copies and streams, text."""
    g = torch.Generator().manual_seed(seed)
    A, C, Ca = CFG.action_per_frame, CFG.in_channels, CFG.action_dim
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    t = lambda: torch.rand(B, F, generator=g) * 1000  # noqa: E731
    return dict(lat=r(B, C, F, H, W), clean=r(B, C, F, H, W), act=r(B, Ca, F, A), act_clean=r(B, Ca, F, A),
                t=t(), t_cond=t(), t_act=t(), t_act_cond=torch.zeros(B, F), text=r(B, TEXT_TOKENS, CFG.text_dim))


def flexpack_forward(model: LingbotVA, d: dict, mode: str, chunk, window):
    """The clips as pad rows or packed into one row (with a padding tail) through LingbotVA; outputs per clip."""
    B, _, F = d["lat"].shape[:3]
    if mode == "pad":
        sl = SequenceLayout.from_rows([[F]] * B, F, mode="pad", text_len=[TEXT_TOKENS] * B)
        grid = tgrid = lambda x: x  # noqa: E731
    else:
        sl = SequenceLayout.from_rows([[F] * B], F * B + 3, text_len=[TEXT_TOKENS] * B)

        def grid(x):  # (B, c, F, ...) -> (1, c, F*B + 3, ...)
            out = x.new_zeros(1, x.shape[1], F * B + 3, *x.shape[3:])
            out[0, :, :F * B] = torch.cat(list(x), dim=1)
            return out

        def tgrid(x):
            return torch.cat([x.reshape(1, -1), x.new_zeros(1, 3)], dim=1)

    batch = Batch(latent=torch.stack([grid(d["lat"]), grid(d["clean"])]),
                  action=torch.stack([grid(d["act"]), grid(d["act_clean"])]), action_mask=None, text=d["text"],
                  layout=sl)
    with torch.no_grad():
        out = model(batch, timestep=torch.stack([tgrid(d["t"]), tgrid(d["t_cond"])]),
                    action_timestep=torch.stack([tgrid(d["t_act"]), tgrid(d["t_act_cond"])]), chunk_size=chunk,
                    window=window)
    if mode == "pad":
        return out.video, out.action
    v, a = out.video[0, :, :F * B], out.action[0, :, :F * B]
    return v.unflatten(1, (B, F)).transpose(0, 1), a.unflatten(1, (B, F)).transpose(0, 1)


def lerobot_forward(ref, d: dict, chunk: int, window: int, fp32: bool):
    dt = torch.float32 if fp32 else torch.bfloat16
    args = {k: v.to(dt) if k == "text" else v for k, v in d.items()}
    inputs = train_inputs(CFG, **args, chunk=chunk, window=window, keep=fp32)
    with torch.no_grad():
        if fp32:
            with fp32_attention(ref):
                out = ref.forward_train(inputs)
        else:
            out = ref.forward_train(inputs)
    return outputs_to_grid(CFG, out, d["lat"].shape)


def test_forward_equals_lerobots_forward_train_in_float32(monkeypatch) -> None:
    """Same weights, inputs, chunk and window: LingbotVA (dense attention: the CPU training path) equals
    LeRobot's forward_train run in float32 over its own block masks, clips in pad rows and packed;
    another chunk size or window is far off (the comparison sees the mask). FlexAttention over the
    same mask equals the dense path in test_lingbot_mask.py."""
    eager_flex(monkeypatch)
    ref = reference_model(CFG)
    d = clips(B=2, F=5, H=4, W=2)
    want = lerobot_forward(ref, d, 2, 5, fp32=True)
    ours = build_from_lerobot(ref.state_dict(), CFG, attn=FlexAttnFunc("dense"))
    for mode in ("pad", "pack"):
        got = flexpack_forward(ours, d, mode, 2, 5)
        assert rel_err(got[0], want[0]) < 2e-6 and rel_err(got[1], want[1]) < 2e-6, mode
    for chunk, window in ((1, 5), (2, 2)):
        off = flexpack_forward(ours, d, "pack", chunk, window)
        assert rel_err(off[0], want[0]) > 1e-2 and rel_err(off[1], want[1]) > 1e-2


def test_forward_equals_lerobots_bf16_forward_within_bf16_rounding(monkeypatch) -> None:
    """LeRobot as it ships: a bfloat16 model whose forward_train casts inputs and q/k/v to bfloat16.
    LingbotVA in float32 on the same (bf16-valued) weights differs only by LeRobot's bf16 rounding of
    activations: bf16 keeps 8 significant bits (a relative step of 2^-8 = 0.4 %) and LeRobot rounds the
    output of every matmul, attention and residual sum, so a few such steps accumulate over the blocks
    (0.5 % of the output range measured here); 1.5 % bounds that, while a changed chunk size or window
    moves the outputs by more than 2.5 %."""
    eager_flex(monkeypatch)
    ref = reference_model(CFG).to(torch.bfloat16)
    d = clips(B=2, F=5, H=4, W=2, seed=2)
    want = lerobot_forward(ref, d, 3, 4, fp32=False)
    ours = build_from_lerobot(ref.state_dict(), CFG, attn=FlexAttnFunc("dense"), dtype=torch.float32)
    got = flexpack_forward(ours, d, "pack", 3, 4)
    errs = rel_err(got[0], want[0]), rel_err(got[1], want[1])
    assert max(errs) < 0.015, errs
    for chunk, window in ((1, 4), (3, 1)):
        off = flexpack_forward(ours, d, "pack", chunk, window)
        assert min(rel_err(off[0], want[0]), rel_err(off[1], want[1])) > 0.025, (chunk, window)


def test_action_positions_follow_get_mesh_id() -> None:
    """Per-token RoPE positions equal LeRobot's grid ids (float32 fractional frames for action steps)."""
    F, h, w, A = 3, 2, 3, 4
    tl = SequenceLayout.from_rows([[F]], F).tokens(h * w, A, copies=1, grid_hw=(h, w))
    f, hp, wp = lingbot_positions(tl)
    vid, act = LU.get_mesh_id(F, h, w, t=0), LU.get_mesh_id(F, A, 1, t=1, action=True)
    for index, grid in ((tl.video_index[0, 0].flatten(), vid), (tl.action_index[0, 0].flatten(), act)):
        got = torch.stack([f[index], hp[index], wp[index]])
        assert got.equal(grid[:3].to(torch.float64))
    assert len(set(f[tl.action_index[0, 0, 1]].tolist())) == A  # every step of a frame its own position


def test_packed_episodes_equal_each_episode_alone() -> None:
    """Episodes of different lengths, each with its own chunk size and window, packed into one row give
    each episode's outputs alone; claiming the row is one episode (doc ids dropped) changes them."""
    lens, chunks, windows = [4, 2, 5], [2, 1, 3], [4, 9, 6]
    torch.manual_seed(0)
    model = build_from_lerobot(reference_model(CFG).state_dict(), CFG, attn=FlexAttnFunc("dense"))
    H, W, A, L = 2, 4, CFG.action_per_frame, 7
    g = torch.Generator().manual_seed(5)
    eps = [dict(lat=torch.randn(2, 1, CFG.in_channels, n, H, W, generator=g),
                act=torch.randn(2, 1, CFG.action_dim, n, A, generator=g),
                t=torch.rand(2, 1, n, generator=g) * 1000, ta=torch.rand(2, 1, n, generator=g) * 1000,
                text=torch.randn(1, L, CFG.text_dim, generator=g)) for n in lens]
    budget = sum(lens) + 2

    def packed(sl, chunk_size, window):
        cat = lambda key, dim: torch.cat([e[key] for e in eps], dim=dim)  # noqa: E731
        pad = lambda x, dim: torch.cat([x, x.new_zeros(*x.shape[:dim], 2, *x.shape[dim + 1:])], dim)  # noqa: E731
        text = torch.cat([e["text"] for e in eps])[:sl.num_episodes]
        batch = Batch(latent=pad(cat("lat", 3), 3), action=pad(cat("act", 3), 3), action_mask=None, text=text,
                      layout=sl)
        return model(batch, timestep=pad(cat("t", 2), 2), action_timestep=pad(cat("ta", 2), 2),
                     chunk_size=chunk_size, window=window)

    three = SequenceLayout.from_rows([lens], budget, text_len=[L] * 3)
    with torch.no_grad():
        out = packed(three, torch.tensor(chunks), torch.tensor(windows))
        start = 0
        for i, (e, n) in enumerate(zip(eps, lens)):
            alone = model(Batch(latent=e["lat"], action=e["act"], action_mask=None, text=e["text"],
                                layout=SequenceLayout.from_rows([[n]], n, text_len=[L])),
                          timestep=e["t"], action_timestep=e["ta"], chunk_size=chunks[i], window=windows[i])
            assert rel_err(out.video[:, :, start:start + n], alone.video) < 1e-5
            assert rel_err(out.action[:, :, start:start + n], alone.action) < 1e-5
            start += n
        assert not out.video[:, :, start:].any() and not out.action[:, :, start:].any()  # padding frames
        # control: the same tokens claimed as one episode (doc ids dropped), same chunk and window
        one = packed(SequenceLayout.from_rows([[sum(lens)]], budget, text_len=[L]), 2, 4)
        right = packed(three, 2, 4)
    assert rel_err(one.video[:, :, :start], right.video[:, :, :start]) > 1e-2


def test_training_step_reaches_every_trained_parameter() -> None:
    """A backward on the CPU (dense attention) gives every parameter a gradient but the action copy's
    unused text projection, which is frozen (LeRobot never uses it either)."""
    model = build_from_lerobot(reference_model(CFG).state_dict(), CFG, attn=FlexAttnFunc("dense"))
    d = clips(B=1, F=3, H=2, W=2, seed=4)
    sl = SequenceLayout.from_rows([[3]], 3, text_len=[9])
    batch = Batch(latent=torch.stack([d["lat"], d["clean"]]), action=torch.stack([d["act"], d["act_clean"]]),
                  action_mask=None, text=d["text"][:, :9], layout=sl)
    out = model(batch, timestep=torch.stack([d["t"], d["t_cond"]]), action_timestep=torch.stack([d["t_act"],
                d["t_act_cond"]]), chunk_size=1, window=4)
    (out.video.square().mean() + out.action.square().mean()).backward()
    no_grad = sorted(n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum())
    assert no_grad == sorted(n for n, _ in model.named_parameters() if n.startswith("action_text_embed.")), no_grad
