"""parallel.float8: which linear layers convert, the start-of-run check, state dicts and checkpoints
that never see float8, and (emulated on CPU) float8 numerics close to the unconverted model."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

pytest.importorskip("torchao")

from flexpack.attention.flex import FlexAttnFunc  # noqa: E402
from flexpack.errors import UserError  # noqa: E402
from flexpack.families.wan.config import wan_config
from flexpack.families.wan.model import WanVA  # noqa: E402
from flexpack.flow.noise import episode_flow_sample  # noqa: E402
from flexpack.flow.objective import FlowMatchingConfig, flow_loss  # noqa: E402
from flexpack.packing.collate import PackCollate  # noqa: E402
from flexpack.parallel import float8  # noqa: E402
from flexpack.parallel.parallelize import ParallelOptions, parallelize  # noqa: E402

BLOCK_LAYERS = ["self_attn.q", "self_attn.k", "self_attn.v", "self_attn.o", "cross_attn.q", "cross_attn.o",
                "ffn.fc1", "ffn.fc2"]


def test_filter_converts_the_5b_blocks_linears_but_not_text_kv_heads_or_embeddings():
    with torch.device("meta"):
        model = WanVA(wan_config("wan2.2-5b", num_layers=2), attn=FlexAttnFunc("dense"))
    names = float8.convert(model, "rowwise")
    assert names == [f"blocks.{i}.{n}" for i in range(2) for n in BLOCK_LAYERS]
    assert float8.converted(model) == names
    assert type(model.blocks[0].cross_attn.k) is nn.Linear and type(model.patch_embed) is nn.Linear
    assert type(model.head_proj) is nn.Linear


def test_filter_shape_rule():
    f = float8.layer_filter
    assert f(nn.Linear(3072, 14336, device="meta"), "blocks.3.ffn.fc1")
    assert not f(nn.Linear(3072, 1032, device="meta"), "blocks.3.ffn.fc1")  # 1032 % 16 = 8: no _scaled_mm
    assert not f(nn.Linear(512, 3072, device="meta"), "blocks.3.ffn.fc1")  # K < MIN_DIM: the casts cost more
    assert not f(nn.Linear(3072, 3072, device="meta"), "head_proj")  # outside the blocks
    assert not f(nn.Linear(3072, 3072, device="meta"), "blocks.0.cross_attn.v")  # text rows only
    assert f(nn.Linear(64, 64), "blocks.0.ffn.fc2", min_dim=16)
    assert float8.convert(WanVA(wan_config("tiny", num_layers=1)), "tensorwise", emulate=True) == []  # dim 64


def test_off_and_bad_modes():
    model = WanVA(wan_config("tiny", num_layers=1))
    assert float8.convert(model, "off") == [] and float8.converted(model) == []
    with pytest.raises(ValueError, match="parallel.float8 must be one of .*got 'fp8'"):
        float8.convert(model, "fp8")
    from flexpack.run.config import load_config

    with pytest.raises(ValueError, match="parallel.float8 must be one of"):
        load_config(overrides=["parallel.float8='e4m3'"])
    assert load_config(overrides=["parallel.float8='rowwise'"]).parallel.float8 == "rowwise"


def test_check_says_what_is_missing(monkeypatch):
    float8.check("off", torch.device("cpu"))  # nothing needed
    with pytest.raises(UserError,
                       match=r"needs an NVIDIA GPU of compute capability 8.9 .*on cpu; set parallel.float8 = 'off'"):
        float8.check("rowwise", torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "A100")
    with pytest.raises(UserError, match="compute capability 8.9 or newer.*A100 is 8.0"):
        float8.check("tensorwise", torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    monkeypatch.setitem(sys.modules, "torchao.float8", None)  # as if torchao were not installed
    with pytest.raises(UserError, match=r"parallel.float8 needs torchao: pip install 'flexpack\[float8\]'"):
        float8.check("tensorwise", torch.device("cuda", 0))


def _items(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"latent": torch.randn(4, F, 4, 4, generator=g), "text": torch.randn(6, 32, generator=g),
             "action": torch.randn(7, F, 2, generator=g), "action_mask": torch.ones(7, F, 2, dtype=torch.bool),
             "episode_index": i} for i, F in enumerate(lens)]


def _loss_and_grads(model):
    cfg = FlowMatchingConfig()
    batch = PackCollate(8)(_items([5, 3], 0))
    sample = episode_flow_sample(batch, cfg, [0, 1])
    model.zero_grad()
    loss = flow_loss(model(sample.inputs, **sample.model_kwargs(), text_slots=4), sample, batch, cfg).loss
    loss.backward()
    return float(loss.detach()), torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_emulated_float8_trains_close_to_fp32_with_the_same_state_dict(one_thread, monkeypatch, mode):
    monkeypatch.setattr(float8, "MIN_DIM", 16)  # the tiny model's 64-wide layers
    torch.manual_seed(0)
    ref = WanVA(wan_config("tiny", num_layers=2), attn=FlexAttnFunc("dense"))
    f8 = WanVA(wan_config("tiny", num_layers=2), attn=FlexAttnFunc("dense"))
    f8.load_state_dict(ref.state_dict())
    parallelize(f8, device=torch.device("cpu"), options=ParallelOptions(float8=mode))  # emulated off CUDA
    assert len(float8.converted(f8)) == 2 * len(BLOCK_LAYERS)
    sd_ref, sd_f8 = ref.state_dict(), f8.state_dict()
    assert list(sd_ref) == list(sd_f8)
    assert all(sd_f8[k].dtype == v.dtype and type(sd_f8[k]) is torch.Tensor for k, v in sd_ref.items())
    (l_ref, g_ref), (l_f8, g_f8) = _loss_and_grads(ref), _loss_and_grads(f8)
    assert l_f8 != l_ref  # float8 rounding did engage
    assert abs(l_f8 - l_ref) < 0.02 * l_ref
    assert float(torch.nn.functional.cosine_similarity(g_f8, g_ref, dim=0)) > 0.99


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)),
                    reason="needs CUDA on an sm89+ GPU (float8 matmuls)")
@pytest.mark.parametrize("mode", ["tensorwise", "rowwise"])
def test_float8_matmuls_on_gpu_close_to_bf16(mode):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    with dev:
        ref = WanVA(wan_config("tiny", num_layers=2, dim=1024, num_heads=8, ffn_dim=2048), attn=FlexAttnFunc("dense"))
        f8 = WanVA(wan_config("tiny", num_layers=2, dim=1024, num_heads=8, ffn_dim=2048), attn=FlexAttnFunc("dense"))
    f8.load_state_dict(ref.state_dict())
    float8.check(mode, dev)
    parallelize(f8, device=dev, options=ParallelOptions(float8=mode))
    assert float8.converted(f8)
    cfg = FlowMatchingConfig()
    batch = PackCollate(8)(_items([5, 3], 0)).to(dev)
    sample = episode_flow_sample(batch, cfg, [0, 1])
    out = []
    for m in (ref, f8):
        with torch.autocast("cuda", torch.bfloat16):
            out.append(float(
                flow_loss(m(sample.inputs, **sample.model_kwargs(), text_slots=4), sample, batch, cfg).loss))
    assert abs(out[1] - out[0]) < 0.03 * out[0]


def test_checkpoints_switch_float8_on_and_off_on_resume(one_thread, monkeypatch, tiny_dataset, tmp_path):
    """float8 is a runtime choice: a checkpoint saved with it on resumes with it off, and back."""
    from flexpack.commands.train import train
    from flexpack.run.state import checkpoint
    from helpers import tiny_config

    monkeypatch.setattr(float8, "MIN_DIM", 16)
    monkeypatch.setattr(float8, "check", lambda mode, device: None)  # CPU: emulated float8

    def cfg(out, steps, mode):  # two micro-steps per step, as configs/tiny_cpu.toml has it
        return tiny_config(tiny_dataset, out, "optim.accum_steps=2", "log.tensorboard=false",
                           f"schedule.steps={steps}", f"parallel.float8='{mode}'")

    plain = train(cfg(tmp_path / "plain", 2, "off"))
    on = train(cfg(tmp_path / "on", 2, "rowwise"))
    assert float8.converted(on.model) and not float8.converted(plain.model)
    keys = {k: v for k, v in checkpoint.tensor_shapes(on.checkpoint).items() if k.startswith("model.")}
    assert keys == {k: v for k, v in checkpoint.tensor_shapes(plain.checkpoint).items() if k.startswith("model.")}
    assert on.losses != plain.losses  # float8 numerics did run
    off = train(cfg(tmp_path / "on", 4, "off"))  # resume the float8 run without it
    assert off.start_step == 2 and off.step == 4 and not float8.converted(off.model)
    back = train(cfg(tmp_path / "plain", 3, "tensorwise"))  # and a bf16 run with it
    assert back.start_step == 2 and back.step == 3 and float8.converted(back.model)
    assert all(torch.isfinite(torch.tensor(off.losses + back.losses)))


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_fsdp2_float8_all_gather_saves_plain_weights(tmp_path):
    """Two gloo ranks: tensorwise weights all-gathered in float8 (emulated on CPU), scales precomputed
    after the step; the DCP checkpoint loads into a plain model without float8, fp32 and equal."""
    import os
    import shutil
    import subprocess
    from pathlib import Path

    import torch.distributed.checkpoint as dcp

    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists() and shutil.which("torchrun") is None:
        pytest.skip("torchrun not found next to the interpreter or on PATH")
    worker = Path(__file__).with_name("dist_float8_worker.py")
    cmd = [str(torchrun if torchrun.exists() else shutil.which("torchrun")), "--standalone", "--nproc_per_node", "2",
           str(worker), str(tmp_path)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"},
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    assert (r0["all_gather"] and r0["weight_type"] == "DTensor"
            and r0["local_type"] == "WeightWithDynamicFloat8CastTensor")
    plain = WanVA(wan_config("tiny", num_layers=2), attn=FlexAttnFunc("dense"))
    sd = plain.state_dict()
    assert set(sd) == set(r0["full"])
    dcp.load({"model": sd}, checkpoint_id=str(tmp_path / "ckpt"))
    for k, v in sd.items():
        assert type(v) is torch.Tensor and v.dtype == torch.float32, k
        torch.testing.assert_close(v, r0["full"][k].as_subclass(torch.Tensor) if type(r0["full"][k]) is not torch.Tensor
                                   else r0["full"][k], rtol=0, atol=0)


CUDA = torch.device("cuda")  # the rule is the GPU's (torch._scaled_mm); nothing here runs on it


def _data(mode="pack", max_tokens=16384, pad_multiple=8):
    import types

    return types.SimpleNamespace(mode=mode, max_tokens=max_tokens, pad_multiple=pad_multiple)


def test_float8_packs_must_hold_a_multiple_of_16_tokens():
    """The weight-gradient GEMM reduces over the tokens (torch._scaled_mm: inner dims % 16 == 0): a
    pack of 455 frames x 36 tokens = 16,380 failed to compile on the H200; the check names a budget that works."""
    from flexpack.packing.geometry import TokenGeometry

    g = TokenGeometry(video_tokens=32, action_tokens=4, max_tokens=16384)
    float8.check_tokens("off", _data(), g, CUDA)  # bf16 takes any count
    with pytest.raises(UserError, match=r"16380; set data.max_tokens = 16272 \(a multiple of 4 frames\)"):
        float8.check_tokens("tensorwise", _data(), g, CUDA)
    good = TokenGeometry(video_tokens=32, action_tokens=4, max_tokens=16272)
    assert good.frame_budget * good.tokens_per_frame % 16 == 0
    float8.check_tokens("tensorwise", _data(max_tokens=16272), good, CUDA)
    float8.check_tokens("rowwise", _data(max_tokens=65536), TokenGeometry(video_tokens=32, action_tokens=4,
                                                                            max_tokens=65536), CUDA)  # 1820 x 36
    float8.check_tokens("rowwise", _data(), TokenGeometry(video_tokens=32, max_tokens=16384), CUDA)  # 32 per frame
    # teacher forcing: two copies of every frame, 72 tokens: an even frame count is enough
    tf = TokenGeometry(video_tokens=32, action_tokens=4, copies=2, max_tokens=16380)  # 455 frames
    with pytest.raises(UserError, match="data.max_tokens = 16344"):
        float8.check_tokens("tensorwise", _data(max_tokens=16380), tf, CUDA)


def test_float8_padded_rows_must_hold_a_multiple_of_16_tokens():
    from flexpack.packing.geometry import TokenGeometry

    g = TokenGeometry(video_tokens=32, action_tokens=4)
    float8.check_tokens("tensorwise", _data("pad", pad_multiple=8), g, CUDA)  # 8 x 36 = 288
    with pytest.raises(UserError, match="data.pad_multiple = 6 frames x 36 .* set data.pad_multiple = 12"):
        float8.check_tokens("tensorwise", _data("pad", pad_multiple=6), g, CUDA)


def test_float8_token_rule_is_the_gpus_and_suggests_a_whole_step():
    from flexpack.packing.geometry import TokenGeometry

    g = TokenGeometry(video_tokens=1, action_tokens=4, max_tokens=60)  # 12 frames x 5 tokens
    float8.check_tokens("rowwise", _data(max_tokens=60), g, torch.device("cpu"))  # emulated: any count
    with pytest.raises(UserError, match=r"12 frames x 5 tokens = 60; set data.max_tokens = 80 \(a multiple of 16"):
        float8.check_tokens("rowwise", _data(max_tokens=60), g, CUDA)


def test_train_refuses_a_float8_run_whose_packs_the_gemms_cannot_take(tiny_dataset, tmp_path, monkeypatch):
    """On a GPU the run checks before building the model (Run.build_model's first step; here the device is faked:
    nothing runs on it)."""
    from flexpack.commands.train import train
    from flexpack.run import start
    from helpers import tiny_config

    monkeypatch.setattr(float8, "check", lambda mode, device: None)
    monkeypatch.setattr(start, "preflight", lambda cfg, stop_after, model_cfg=None: torch.device("cuda"))
    built = []
    monkeypatch.setattr("flexpack.run.model.build_model", lambda *a, **k: built.append(1))
    cfg = tiny_config(tiny_dataset, tmp_path, "parallel.float8='tensorwise'")  # 12 frames x 5 tokens = 60
    with pytest.raises(UserError, match="parallel.float8 = 'tensorwise' needs packs of a multiple of 16 tokens"):
        train(cfg)
    assert not built
