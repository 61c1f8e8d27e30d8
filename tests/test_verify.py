"""verify: packed ≡ per-episode on a correct model; a layout with its doc ids dropped must fail."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

from flexpack.families.wan.config import wan_config
from flexpack.families.wan.model import WanVA
from flexpack.flow.objective import FlowMatchingConfig
from flexpack.packing.collate import PackCollate, PadCollate
from flexpack.run.root import ForwardOptions
from flexpack.tools.verify import verify_batch

ROOT = Path(__file__).resolve().parents[1]


pytestmark = pytest.mark.usefixtures("one_thread")


def items(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i, n in enumerate(lengths):
        mask = torch.rand(7, n, 2, generator=g) > 0.3
        mask[-2:] = False  # unused action channels
        out.append(dict(latent=torch.randn(4, n, 4, 6, generator=g), action=torch.randn(7, n, 2, generator=g),
                        action_mask=mask, text=torch.randn(4, 32, generator=g), text_len=4 - i % 3, episode_index=i))
    return out


def model():
    torch.manual_seed(0)
    m = WanVA(wan_config("tiny", attn_backend="dense"))
    with torch.no_grad():  # random heads/modulation so every path carries signal
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return m


CASES = {
    "pack": (PackCollate(20), FlowMatchingConfig(), ForwardOptions()),
    "pad": (PadCollate(4), FlowMatchingConfig(weighting="bell", action_weight=0.5), ForwardOptions()),
    "pack-chunk-causal": (PackCollate(20), FlowMatchingConfig(chunk_size=2),
                          ForwardOptions(mask="chunk_causal", chunk_size=2)),
    "pack-teacher-forcing": (PackCollate(20), FlowMatchingConfig(teacher_forcing=True, chunk_size=2),
                             ForwardOptions(mask="teacher_forcing", chunk_size=2)),
}


@pytest.mark.parametrize("case", CASES)
def test_packed_equals_per_episode_on_a_correct_model(case):
    collate, cfg, kw = CASES[case]
    report = verify_batch(model(), items([5, 3, 7, 2]), collate, cfg, seed=4, forward=kw)
    print(report.table())
    assert report.ok and report.max_err < 1e-5
    assert [r.frames for r in report.rows] == [5, 3, 7, 2]
    assert all(r.video_err < 1e-5 and r.action_err < 1e-5 and r.loss_err < 1e-5 for r in report.rows)
    assert report.grad_err[0] < 1e-5 and report.loss_batched[0] == pytest.approx(report.loss_alone[0], rel=1e-5)
    assert "OK: max rel err" in report.table()


def test_episodes_alone_in_the_pack_shape_equal_them_unpadded():
    """Compiled blocks run the per-episode passes in the run's pack shape (no graph per length):
    padding after the episode changes nothing."""
    report = verify_batch(model(), items([5, 3, 7, 2]), PackCollate(20), FlowMatchingConfig(), seed=4,
                          alone_collate=PackCollate(20))
    assert report.ok and report.max_err < 1e-5 and [r.frames for r in report.rows] == [5, 3, 7, 2]
    bad = verify_batch(model(), items([5, 3, 7, 2]), PackCollate(20), FlowMatchingConfig(),
                       alone_collate=PackCollate(20), drop_packing=True)
    assert not bad.ok and min(r.video_err for r in bad.rows) > 1e-3


def test_a_cropped_episode_is_compared_on_its_kept_frames():
    """data.crop: an episode longer than the budget is cut to it; alone it is cut the same way."""
    report = verify_batch(model(), items([10]), PackCollate(6, crop=True), FlowMatchingConfig(), seed=1)
    assert report.ok and report.max_err < 1e-5 and [r.frames for r in report.rows] == [6]


@pytest.mark.parametrize("collate", [PackCollate(20), PadCollate(4)], ids=["pack", "pad"])
def test_dropped_doc_ids_fail(collate):
    report = verify_batch(model(), items([5, 3, 7, 2]), collate, FlowMatchingConfig(), drop_packing=True)
    print(report.table())
    assert not report.ok
    assert min(r.video_err for r in report.rows) > 1e-3  # every episode sees foreign tokens
    assert report.grad_err[0] > 1e-3 and "MISMATCH" in report.table()


def test_noise_does_not_depend_on_batching():
    """The same episode gets the same x_t packed with others, padded, or alone."""
    from flexpack.flow.noise import episode_flow_sample

    its = items([5, 3])
    cfg = FlowMatchingConfig()
    packed = episode_flow_sample(PackCollate(12)(its), cfg, [11, 22])
    padded = episode_flow_sample(PadCollate(4)(its), cfg, [11, 22])
    alone = episode_flow_sample(PackCollate(3)([its[1]]), cfg, [22])
    assert torch.equal(packed.inputs.latent[0, :, 5:8], alone.inputs.latent[0])
    assert torch.equal(padded.inputs.latent[1, :, :3], alone.inputs.latent[0])
    assert torch.equal(packed.sigma[0, 5:8], alone.sigma[0])
    assert torch.equal(packed.inputs.action[0, :, 5:8], alone.inputs.action[0])
    assert not torch.equal(packed.inputs.latent[0, :, :3], alone.inputs.latent[0])


@pytest.fixture
def dataset(tiny_dataset) -> Path:
    return tiny_dataset  # the session's dataset (only read here)


def test_cli_and_script_exit_status(dataset, capsys, monkeypatch):
    from flexpack.cli import main

    args = [str(ROOT / "configs" / "tiny_cpu.toml"), "--set", f'data.root="{dataset}"', "--set", "data.max_tokens=60"]
    assert main(["verify", *args]) == 0
    out = capsys.readouterr().out
    assert "OK: max rel err" in out and "micro-batch 1:" in out
    monkeypatch.setattr(sys, "argv", ["verify_packing.py", *args, "--drop-packing", "--micro-batches", "1"])
    with pytest.raises(SystemExit) as info:
        runpy.run_path(str(ROOT / "scripts" / "verify_packing.py"), run_name="__main__")
    assert info.value.code == 1 and "MISMATCH" in capsys.readouterr().out


# -- the training configuration: synthetic episodes, dtypes, bad inputs, FSDP2, CUDA -------------

TINY = str(ROOT / "configs" / "tiny_cpu.toml")


def _verify(capsys, *args: str) -> tuple[int, str, str]:
    from flexpack.cli import main

    rc = main(["verify", TINY, "--synthetic", "--micro-batches", "1", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_synthetic_verify_reports_groups_and_passes_in_fp32_and_bf16(capsys, one_thread):
    rc, out, _ = _verify(capsys)
    assert rc == 0 and "runtime.dtype float32 (no autocast), blocks eager" in out
    assert "gradient rel err per parameter group" in out and "  blocks.1 " in out and "  patch_embed " in out
    assert "gradients finite: yes" in out and "tolerance output 1e-04, loss 1e-04, grad 1e-04" in out
    rc, out, _ = _verify(capsys, "--set", "runtime.dtype='bfloat16'")
    assert rc == 0 and "(autocast)" in out and "tolerance output 3e-02, loss 2e-03, grad 5e-02" in out
    loss_rel = float(out.split("rel diff ")[1].split(")")[0])
    assert 0 < loss_rel < 2e-3  # bf16 rounding is there, well inside the stated tolerance
    rc, out, _ = _verify(capsys, "--set", "runtime.dtype='bfloat16'", "--drop-packing")
    assert rc == 1 and "MISMATCH (output" in out  # bf16 tolerances still catch dropped packing


def test_bad_backend_for_dtype_and_checkpoint_of_another_shape_are_one_line(capsys, tmp_path, one_thread):
    from flexpack.run.state import checkpoint

    flash = "model.overrides={in_channels=48, text_dim=64, action_channels=6, attn_backend='flex-flash'}"
    rc, out, err = _verify(capsys, "--set", flash)
    assert rc == 2 and out == "" and len(err.strip().splitlines()) == 1
    assert "attn_backend = 'flex-flash' (FA4) takes bfloat16 inputs" in err and "runtime.dtype = 'float32'" in err
    other = WanVA(wan_config("tiny", in_channels=48, text_dim=64, action_channels=6, dim=96,  # tiny_cpu: dim 256
                             ffn_dim=96))
    from flexpack.run.config import load_config, save_config

    checkpoint.save(tmp_path / "checkpoints", 3, other, None)
    save_config(load_config(TINY), tmp_path / "config.json")  # a run whose config does not match its weights
    rc, out, err = _verify(capsys, "--checkpoint", str(tmp_path))
    said, error = err.strip().splitlines()  # which config verify uses, then the one-line error
    assert rc == 2 and out == "" and said.startswith("verify: config of ")
    assert error.startswith("flexpack verify: error: ")
    assert "shape" in error
    from flexpack.cli import main

    assert main(["verify", TINY, "--synthetic-hw", "2", "2"]) == 2  # shapes synthetic episodes only
    assert "add --synthetic" in capsys.readouterr().err


def test_nonfinite_gradients_fail(one_thread):
    m = model()
    m.patch_embed.weight.register_hook(lambda g: g * float("nan"))
    report = verify_batch(m, items([5, 3]), PackCollate(8), FlowMatchingConfig())
    assert not report.ok and report.nonfinite == ["patch_embed.weight"]
    assert "gradients finite: NO: patch_embed.weight" in report.table()


def test_param_groups_drop_wrappers():
    from flexpack.tools.verify import param_group

    assert param_group("blocks.3._checkpoint_wrapped_module.attn.q.weight") == "blocks.3"
    assert param_group("blocks.12.ffn.0.bias") == "blocks.12" and param_group("head_proj.weight") == "head_proj"


@pytest.mark.slow
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_fsdp2_under_torchrun_passes_and_catches_dropped_packing(tmp_path):
    """Two ranks (gloo on CPU, NCCL on GPUs): FSDP2 with bf16 parameters, as training shards the model."""
    import os
    import shutil
    import subprocess

    torchrun = shutil.which("torchrun", path=str(Path(sys.executable).parent)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not found next to the interpreter or on PATH")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    cmd = [torchrun, "--nproc_per_node", "2", "-m", "flexpack.cli", "verify", TINY, "--synthetic",
           "--micro-batches", "1", "--set", "runtime.dtype='bfloat16'"]
    if torch.cuda.device_count() < 2:
        cmd += ["--set", "runtime.device='cpu'"]
    ok = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    assert ("2 rank(s), FSDP2" in ok.stdout and "FSDP2 mixed precision" in ok.stdout
            and ok.stdout.count("OK: max rel err") == 1)
    bad = subprocess.run(cmd + ["--drop-packing"], capture_output=True, text=True, env=env, timeout=300)
    assert bad.returncode == 1 and "MISMATCH" in bad.stdout, bad.stdout + bad.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (verify in the GPU training configuration)")
@pytest.mark.parametrize("backend", ["flex", pytest.param("auto", marks=pytest.mark.fa4)])
def test_verify_on_cuda_in_the_training_configuration(capsys, backend):
    """CUDA, bf16 autocast, compiled blocks, Triton flex (or FA4 via auto where installed), head dim
    128: packed == per-episode within the bf16 tolerances; dropped packing fails."""
    shape = (f"model.overrides={{in_channels=48, text_dim=64, action_channels=6, attn_backend='{backend}', "
             "dim=256, num_heads=2, ffn_dim=512, num_layers=2}")
    common = ["--set", shape, "--set", "runtime.device='cuda'", "--set", "runtime.dtype='bfloat16'",
              "--set", "parallel.compile=true", "--set", "data.max_tokens=400", "--synthetic-hw", "4", "4"]
    rc, out, err = _verify(capsys, *common)
    assert rc == 0, out + err
    assert "cuda" in out and "(autocast), blocks compiled" in out and "gradients finite: yes" in out
    rc, out, err = _verify(capsys, *common, "--drop-packing")
    assert rc == 1 and "MISMATCH" in out, out + err
