"""``model.pretrained``: a diffusers WanTransformer3DModel checkpoint as the starting point of training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("lerobot")

from flexpack.attention.flex import FlexAttnFunc  # noqa: E402
from flexpack.commands.train import train  # noqa: E402
from flexpack.run.config import load_config  # noqa: E402
from flexpack.run.model import build_model  # noqa: E402
from flexpack.run.resolve import model_config_of  # noqa: E402
from hf_tiny import tiny_diffusers  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
pytestmark = pytest.mark.usefixtures("one_thread")


def cfg_for(pretrained, *overrides: str, root: str = "unused", out: str = "unused"):
    return load_config(CONFIGS / "tiny_cpu.toml", [f'model.pretrained="{pretrained}"', f'data.root="{root}"',
                                                   f'runtime.out_dir="{out}"', "log.progress=false", *overrides])


def _inputs(L=5):
    g = torch.Generator().manual_seed(1)
    return torch.randn(2, 48, 3, 4, 2, generator=g), torch.tensor([7.0, 640.0]), torch.randn(2, L, 64, generator=g)


@pytest.mark.parametrize("sharded", [False, True], ids=["single-file", "sharded"])
def test_pretrained_folder_gives_diffusers_outputs_and_an_initialized_action_stream(tmp_path, sharded):
    m = tiny_diffusers()
    m.save_pretrained(tmp_path / "transformer", **({"max_shard_size": "30KB"} if sharded else {}))
    assert (tmp_path / "transformer" / "diffusion_pytorch_model.safetensors.index.json").exists() == sharded
    cfg = cfg_for(tmp_path / "transformer")
    wc = model_config_of(cfg)
    # the checkpoint's shape replaced the tiny preset's; options come from the config
    assert (wc.dim, wc.num_heads, wc.ffn_dim, wc.freq_dim, wc.action_channels) == (32, 2, 48, 16, 6)
    model = build_model(cfg)
    model.attn = FlexAttnFunc("dense")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    x, t, txt = _inputs()
    with torch.no_grad():
        ref = m(x, t, txt, return_dict=False)[0]
        out = model.forward_video(x, t, txt)
    assert float((out - ref).abs().max() / ref.abs().max()) < 1e-5
    # the action stream is initialized as a fresh model's (seeded by the run seed), not left empty
    torch.manual_seed(cfg.runtime.seed)
    from flexpack.families.wan.model import action_stream_init

    for name, value in action_stream_init(wc).items():
        assert torch.equal(model.get_parameter(name), value), name


def test_pretrained_safetensors_file_and_contradicting_overrides(tmp_path):
    m = tiny_diffusers(seed=2)
    m.save_pretrained(tmp_path / "transformer")
    weights = tmp_path / "transformer" / "diffusion_pytorch_model.safetensors"
    model = build_model(cfg_for(weights))  # config.json beside the file gives the shape
    assert model.config.dim == 32
    pipeline = build_model(cfg_for(tmp_path))  # a pipeline folder: its transformer/
    assert all(torch.equal(v, pipeline.state_dict()[k]) for k, v in model.state_dict().items())
    with pytest.raises(ValueError, match=r"model.overrides.dim=64 but .*config.json has dim=32$"):
        cfg_for(tmp_path / "transformer", "model.overrides.dim=64")
    with pytest.raises(ValueError, match=r"model.overrides.text_dim=64 but .*config.json has text_dim=16"):
        tiny_diffusers(text_dim=16).save_pretrained(tmp_path / "t16")
        cfg_for(tmp_path / "t16")
    # a lone file without config.json: the config's shape, checked tensor by tensor
    lone = tmp_path / "lone.safetensors"
    weights.rename(lone)
    with pytest.raises(ValueError, match="checkpoint shape .* != model shape"):
        build_model(cfg_for(lone))
    with pytest.raises(FileNotFoundError, match="model.pretrained: .*nope: no such file or folder"):
        cfg_for(tmp_path / "nope")


def test_training_starts_from_the_pretrained_weights(tiny_dataset, tmp_path, capsys):
    root = tiny_dataset
    m = tiny_diffusers(seed=4)
    m.save_pretrained(tmp_path / "t")
    cfg = cfg_for(tmp_path / "t", "schedule.steps=2", "data.max_tokens=60", root=str(root), out=str(tmp_path / "run"))
    start = build_model(cfg).state_dict()
    capsys.readouterr()
    res = train(cfg, stop_after=0)  # no step: the model as the loop built it
    for name, value in res.model.state_dict().items():
        assert torch.equal(value, start[name]), name
    # the start line: which weights, their shape, how many tensors matched (the action stream is new)
    from flexpack.families.wan.model import action_stream_init

    fresh, total = len(action_stream_init(model_config_of(cfg))), len(list(res.model.parameters()))
    assert len(m.state_dict()) + fresh == total and fresh > 0
    (line,) = [x for x in capsys.readouterr().out.splitlines() if x.startswith("model.pretrained:")]
    folder = tmp_path / "t"
    assert line == (f"model.pretrained: {folder} (1 safetensors file, shape from {folder / 'config.json'}"
                    f"): dim 32 (2 heads x 16), 2 layers, ffn 48, 48 latent channels, text 64; "
                    f"{sum(p.numel() for p in res.model.parameters()) / 1e6:,.2f}M parameters; {len(m.state_dict())} "
                    f"tensors matched the model by name and shape and were loaded, {fresh} of the model's {total} "
                    "tensors are not in it and start fresh (new to the wanva model)")
    res = train(cfg)
    assert res.step == 2 and all(torch.isfinite(torch.tensor(res.losses)))
