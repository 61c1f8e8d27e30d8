"""WanVA against diffusers' WanTransformer3DModel (a reference we did not write), float32 on CPU."""

from __future__ import annotations

import json

import pytest
import torch

from flexpack.attention.flex import FlexAttnFunc
from flexpack.families.wan.convert import config_from_diffusers, convert_state_dict, load_converted
from flexpack.families.wan.model import WanVA
from flexpack.packing.layout import SequenceLayout

diffusers = pytest.importorskip("diffusers")

REL = 1e-5
CONFIGS = [
    # (diffusers kwargs, latent (C, F, H, W), text length)
    (dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, num_layers=2,
          freq_dim=16), (4, 3, 4, 6), 7),
    (dict(patch_size=(2, 1, 2), num_attention_heads=3, attention_head_dim=16, num_layers=1,
          freq_dim=10), (4, 4, 3, 4), 5),
    (dict(patch_size=(1, 1, 1), num_attention_heads=4, attention_head_dim=8, num_layers=3, freq_dim=8,
          cross_attn_norm=False), (4, 2, 3, 2), 3),
]


def reference(kw: dict, seed: int = 0):
    torch.manual_seed(seed)
    m = diffusers.WanTransformer3DModel(in_channels=4, out_channels=3, text_dim=16, ffn_dim=40, **kw).eval()
    with torch.no_grad():  # move every weight (norm gains too) off its init so each mapping matters
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    return m


def inputs(shape, L: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(2, *shape, generator=g)
    return latent, torch.tensor([3.0, 871.0]), torch.randn(2, L, 16, generator=g)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| / max |b|."""
    return float((a - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("kw,shape,L", CONFIGS)
def test_forward_video_matches_diffusers(kw, shape, L):
    m = reference(kw)
    ours = WanVA.from_diffusers(m, attn=FlexAttnFunc("dense")).eval()
    x, t, txt = inputs(shape, L)
    with torch.no_grad():
        ref = m(x, t, txt, return_dict=False)[0]
        out = ours.forward_video(x, t, txt)
    assert out.shape == ref.shape
    err = rel_err(out, ref)
    print(f"patch {kw['patch_size']}: max rel err {err:.2e}")
    assert err <= REL
    # the comparison is sensitive: a wrong timestep already shows
    with torch.no_grad():
        assert rel_err(ours.forward_video(x, t + 1.0, txt), ref) > 100 * REL


def test_model_forward_matches_diffusers_per_frame_timesteps():
    """The batch entry point (pad layout, per-frame timesteps) agrees with diffusers' per-token timesteps."""
    kw, shape, L = CONFIGS[0]
    m = reference(kw)
    ours = WanVA.from_diffusers(m, attn=FlexAttnFunc("dense")).eval()
    x, _, txt = inputs(shape, L)
    B, (_, Fn, H, W) = 2, shape
    t_BF = torch.tensor([[10.0, 500.0, 990.0], [0.0, 0.0, 250.0]])
    tokens_per_frame = (H // 2) * (W // 2)

    class B_:  # a Batch-like object: the model reads latent, action, text
        latent, action, text = x, None, txt
        layout = SequenceLayout.from_rows([[Fn]] * B, Fn, text_len=[L] * B, mode="pad")

    with torch.no_grad():
        ref = m(x, t_BF.repeat_interleave(tokens_per_frame, dim=1), txt, return_dict=False)[0]
        out = ours(B_(), timestep=t_BF).video
    assert rel_err(out, ref) <= REL


def test_from_diffusers_file_folder_and_file(tmp_path):
    kw, shape, L = CONFIGS[1]
    m = reference(kw, seed=3)
    m.save_pretrained(tmp_path)
    x, t, txt = inputs(shape, L)
    with torch.no_grad():
        ref = m(x, t, txt, return_dict=False)[0]
        from_folder = WanVA.from_diffusers_file(str(tmp_path), attn=FlexAttnFunc("dense"))
        weights = tmp_path / "diffusion_pytorch_model.safetensors"
        cfg = json.loads((tmp_path / "config.json").read_text())
        from_file = WanVA.from_diffusers_file(str(weights), config_from_diffusers(cfg), attn=FlexAttnFunc("dense"))
        for model in (from_folder, from_file):
            assert rel_err(model.eval().forward_video(x, t, txt), ref) <= REL


def test_from_diffusers_file_sharded(tmp_path):
    kw, shape, L = CONFIGS[0]
    m = reference(kw, seed=4)
    m.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "diffusion_pytorch_model.safetensors.index.json").exists()
    x, t, txt = inputs(shape, L)
    with torch.no_grad():
        ref = m(x, t, txt, return_dict=False)[0]
        ours = WanVA.from_diffusers_file(str(tmp_path), attn=FlexAttnFunc("dense")).eval()
        assert rel_err(ours.forward_video(x, t, txt), ref) <= REL


def test_loading_initializes_only_the_action_stream(tmp_path, monkeypatch):
    """Loaders build on the meta device and adopt the checkpoint: no random init of the video weights
    (minutes and ~20 GB at 5B); the action stream, absent from the checkpoint, gets a real init."""
    kw, shape, L = CONFIGS[0]
    m = reference(kw, seed=5)
    m.save_pretrained(tmp_path)
    real_init = torch.nn.init.kaiming_uniform_
    inits = []

    def recording_init(tensor, *args, **kwargs):
        if not tensor.is_meta:
            inits.append(tuple(tensor.shape))
        return real_init(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.nn.init, "kaiming_uniform_", recording_init)
    x, t, txt = inputs(shape, L)
    with torch.no_grad():
        ref = m(x, t, txt, return_dict=False)[0]
    for load in (lambda: WanVA.from_diffusers_file(str(tmp_path), attn=FlexAttnFunc("dense"), action_channels=3),
                 lambda: WanVA.from_diffusers(m, attn=FlexAttnFunc("dense"), action_channels=3)):
        inits.clear()
        ours = load().eval()
        D = ours.config.dim
        assert sorted(inits) == [(3, D), (D, 3)]  # action_embed and action_head_proj, nothing else
        assert not any(p.is_meta for p in ours.parameters())
        for name in ("action_embed.weight", "action_head_proj.weight", "action_head_modulation"):
            p = ours.get_parameter(name)
            assert torch.isfinite(p).all() and p.abs().sum() > 0 and p.requires_grad, name
        with torch.no_grad():
            assert rel_err(ours.forward_video(x, t, txt), ref) <= REL
    # from_diffusers copies: changing the diffusers model afterwards leaves ours alone
    before = ours.blocks[0].self_attn.q.weight.clone()
    with torch.no_grad():
        m.blocks[0].attn1.to_q.weight.add_(1.0)
    assert torch.equal(ours.blocks[0].self_attn.q.weight, before)


def test_from_diffusers_file_takes_the_main_dtype_and_config_overrides(tmp_path):
    kw, shape, L = CONFIGS[0]
    m = reference(kw, seed=6)
    m.save_pretrained(tmp_path)
    cfg = config_from_diffusers(json.loads((tmp_path / "config.json").read_text()))
    from safetensors.torch import load_file, save_file

    sd = load_file(tmp_path / "diffusion_pytorch_model.safetensors")
    mixed = {k: v if k.endswith("norm_q.weight") else v.to(torch.bfloat16) for k, v in sd.items()}
    save_file(mixed, tmp_path / "mixed.safetensors")
    ours = WanVA.from_diffusers_file(str(tmp_path / "mixed.safetensors"), cfg, attn=FlexAttnFunc("dense"),
                                     action_channels=2)
    assert ours.config.action_channels == 2  # overrides apply to a WanVAConfig too
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}


def test_conversion_fails_loudly():
    kw, _, _ = CONFIGS[0]
    m = reference(kw)
    cfg = config_from_diffusers(dict(m.config))
    sd = dict(m.state_dict())
    sd["blocks.0.something_new.weight"] = torch.zeros(1)
    with pytest.raises(ValueError, match="no WanVA counterpart"):
        convert_state_dict(sd, cfg)
    sd = dict(m.state_dict())
    del sd["blocks.1.attn2.norm_k.weight"]
    with pytest.raises(ValueError, match="lacks WanVA weights"):
        load_converted(WanVA(cfg, attn=FlexAttnFunc("dense")), convert_state_dict(sd, cfg))
    with pytest.raises(ValueError, match="image conditioning"):
        config_from_diffusers({**dict(m.config), "image_dim": 1280})
    with pytest.raises(ValueError, match="no such file"):
        WanVA.from_diffusers_file("/nonexistent/x.safetensors")
