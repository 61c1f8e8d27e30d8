"""``flexpack export``: a trained run as a diffusers WanTransformer3DModel folder plus action stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("lerobot")

from flexpack.attention.flex import FlexAttnFunc  # noqa: E402
from flexpack.cli import main as cli_main  # noqa: E402
from flexpack.commands.train import train  # noqa: E402
from flexpack.families.wan.convert import rename  # noqa: E402
from flexpack.families.wan.export import load_export  # noqa: E402
from flexpack.packing.collate import PackCollate  # noqa: E402
from flexpack.run.compose import build_run  # noqa: E402
from flexpack.run.config import load_config  # noqa: E402
from flexpack.run.model import build_model  # noqa: E402
from flexpack.run.state import checkpoint  # noqa: E402
from flexpack.tools.export import export_run  # noqa: E402
from helpers import tiny_config  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def trained(tiny_dataset, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("export")
    cfg = tiny_config(tiny_dataset, tmp / "run", "schedule.steps=3", "optim.ema_decay=0.5")
    train(cfg)
    return cfg, tmp


def _checkpoint_model(cfg, ema: bool = False):
    model = build_model(cfg)
    found = checkpoint.latest(Path(cfg.runtime.out_dir) / "checkpoints")
    checkpoint.load(found, model, restore_rng=False)
    if ema:
        model.load_state_dict(checkpoint.read_ema(found))
    model.attn = FlexAttnFunc("dense")
    return model.eval()


def _video_inputs():
    g = torch.Generator().manual_seed(3)
    return torch.randn(2, 48, 3, 4, 2, generator=g), torch.tensor([11.0, 700.0]), torch.randn(2, 6, 64, generator=g)


def test_name_table_goes_both_ways():
    for ours in ("blocks.3.self_attn.q.weight", "blocks.0.cross_norm_bias", "blocks.1.modulation", "head_modulation",
                 "time_embed.mod_proj.bias", "patch_embed.weight", "blocks.2.ffn.fc1.weight"):
        theirs = rename(ours, to_diffusers=True)
        assert theirs is not None and rename(theirs) == ours, ours
    assert rename("blocks.1.modulation", to_diffusers=True) == "blocks.1.scale_shift_table"
    assert rename("action_embed.weight", to_diffusers=True) is None


@pytest.mark.parametrize("ema", [False, True], ids=["weights", "ema"])
def test_export_loads_in_diffusers_with_equal_outputs(trained, tmp_path, ema):
    cfg, _ = trained
    out = export_run(cfg.runtime.out_dir, tmp_path / "out", ema=ema)
    ours = _checkpoint_model(cfg)
    x, t, txt = _video_inputs()
    for folder, model in [(out, ours)] + ([(out / "ema", _checkpoint_model(cfg, ema=True))] if ema else []):
        dm = diffusers.WanTransformer3DModel.from_pretrained(folder).eval()
        with torch.no_grad():
            ref = dm(x, t, txt, return_dict=False)[0]
            mine = model.forward_video(x, t, txt)
        assert float((mine - ref).abs().max() / ref.abs().max()) < 1e-5, folder
    assert (out / "ema").is_dir() == ema
    if ema:  # the averaged weights differ from the last ones
        assert not torch.equal(_checkpoint_model(cfg, ema=True).head_proj.weight, ours.head_proj.weight)


def test_export_action_stream_normalization_and_roundtrip(trained, tmp_path):
    cfg, tmp = trained
    assert cli_main(["export", cfg.runtime.out_dir, str(tmp_path / "out")]) == 0
    out = tmp_path / "out"
    info = json.loads((out / "action_stream.json").read_text())
    assert info["action_channels"] == 6 and info["action_steps"] == 4 and info["weights"] == sorted(
        ["action_embed.weight", "action_embed.bias", "action_head_modulation", "action_head_proj.weight",
         "action_head_proj.bias"])
    norm = json.loads((out / "normalization.json").read_text())
    data = build_run(cfg)
    assert norm["mode"] == data.dataset.normalizer.mode
    assert norm["low"] == pytest.approx(data.dataset.normalizer.low.tolist())
    assert norm["high"] == pytest.approx(data.dataset.normalizer.high.tolist())
    # the whole model (video + actions) comes back from the export
    back = load_export(out, attn=FlexAttnFunc("dense")).eval()
    ours = _checkpoint_model(cfg)
    batch = PackCollate(20)([data.dataset[0]])
    kw = dict(timestep=torch.full(batch.layout.frame_doc.shape, 300.0))
    with torch.no_grad():
        a, b = back(batch, **kw), ours(batch, **kw)
    assert torch.allclose(a.video, b.video, atol=1e-6) and torch.allclose(a.action, b.action, atol=1e-6)


def test_export_in_bfloat16(trained, tmp_path):
    from safetensors import safe_open

    cfg, _ = trained
    out = export_run(cfg.runtime.out_dir, tmp_path / "bf16", dtype=torch.bfloat16)
    for name in ("diffusion_pytorch_model.safetensors", "action_stream.safetensors"):
        with safe_open(str(out / name), framework="pt") as f:
            assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}, name
    dm = diffusers.WanTransformer3DModel.from_pretrained(out, torch_dtype=torch.bfloat16)
    ours = _checkpoint_model(cfg)
    assert torch.equal(dm.proj_out.weight, ours.head_proj.weight.bfloat16())


def test_export_errors(trained, tmp_path):
    cfg, tmp = trained
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(ValueError, match=r"full: exists and is not empty"):
        export_run(cfg.runtime.out_dir, tmp_path / "full")
    with pytest.raises(FileNotFoundError, match="not a flexpack run folder"):
        export_run(tmp_path, tmp_path / "o")
    run = tmp_path / "noema"
    train(load_config(Path(cfg.runtime.out_dir) / "config.json",
                      [f'runtime.out_dir="{run}"', "optim.ema_decay=0.0", "schedule.steps=1"]))
    with pytest.raises(ValueError, match="holds no EMA weights"):
        export_run(run, tmp_path / "o", ema=True)
    assert not (tmp_path / "o").exists()
