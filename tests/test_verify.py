"""verify: packed ≡ per-episode on a correct model; a layout with its doc ids dropped must fail."""

from __future__ import annotations

import runpy
import sys
from pathlib import Path

import pytest
import torch

from flexpack.packing.collate import PackCollate, PadCollate
from flexpack.models import WanVA, wan_config
from flexpack.training.objective import FlowMatchingConfig
from flexpack.training.verify import verify_batch

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
    "pack": (PackCollate(20), FlowMatchingConfig(), {}),
    "pad": (PadCollate(4), FlowMatchingConfig(weighting="bell", action_weight=0.5), {}),
    "pack-chunk-causal": (PackCollate(20), FlowMatchingConfig(chunk_size=2), {"mask": "chunk_causal", "chunk_size": 2}),
    "pack-teacher-forcing": (PackCollate(20), FlowMatchingConfig(teacher_forcing=True, chunk_size=2),
                             {"mask": "teacher_forcing", "chunk_size": 2}),
}


@pytest.mark.parametrize("case", CASES)
def test_packed_equals_per_episode_on_a_correct_model(case):
    collate, cfg, kw = CASES[case]
    report = verify_batch(model(), items([5, 3, 7, 2]), collate, cfg, seed=4, model_kwargs=kw)
    print(report.table())
    assert report.ok and report.max_err < 1e-5
    assert [r.frames for r in report.rows] == [5, 3, 7, 2]
    assert all(r.video_err < 1e-5 and r.action_err < 1e-5 and r.loss_err < 1e-5 for r in report.rows)
    assert report.grad_err[0] < 1e-5 and report.loss_batched[0] == pytest.approx(report.loss_alone[0], rel=1e-5)
    assert "OK: max rel err" in report.table()


@pytest.mark.parametrize("collate", [PackCollate(20), PadCollate(4)], ids=["pack", "pad"])
def test_dropped_doc_ids_fail(collate):
    report = verify_batch(model(), items([5, 3, 7, 2]), collate, FlowMatchingConfig(), drop_packing=True)
    print(report.table())
    assert not report.ok
    assert min(r.video_err for r in report.rows) > 1e-3  # every episode sees foreign tokens
    assert report.grad_err[0] > 1e-3 and "MISMATCH" in report.table()


def test_noise_does_not_depend_on_batching():
    """The same episode gets the same x_t packed with others, padded, or alone."""
    from flexpack.training.noise import episode_flow_sample

    its = items([5, 3])
    cfg = FlowMatchingConfig()
    packed = episode_flow_sample(PackCollate(12)(its), cfg, [11, 22])
    padded = episode_flow_sample(PadCollate(4)(its), cfg, [11, 22])
    alone = episode_flow_sample(PackCollate(3)([its[1]]), cfg, [22])
    assert torch.equal(packed.inputs.latent[0, :, 5:8], alone.inputs.latent[0])
    assert torch.equal(padded.inputs.latent[1, :, :3], alone.inputs.latent[0])
    assert torch.equal(packed.sigma[0, 5:8], alone.sigma[0]) and torch.equal(packed.inputs.action[0, :, 5:8], alone.inputs.action[0])
    assert not torch.equal(packed.inputs.latent[0, :, :3], alone.inputs.latent[0])


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    pytest.importorskip("lerobot")
    from flexpack.data.encode import encode_dataset
    from flexpack.data.synthetic import make_synthetic_dataset

    root = make_synthetic_dataset(tmp_path_factory.mktemp("verify") / "ds", lengths=[33, 21, 13, 9], seed=2)
    encode_dataset(root, progress=False)
    return root


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
