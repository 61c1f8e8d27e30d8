"""Several ranks: the packed FSDP2 step equals one process on the same global batch, and
``benchmarks/step_multigpu.py`` (the several-GPU benchmark) runs its every path under torchrun over gloo."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from helpers import ROOT, TINY, torchrun_worker

sys.path.insert(0, str(ROOT / "benchmarks"))


@pytest.mark.slow  # two torchrun ranks: ~15 s
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_fsdp2_packed_step_losses_and_full_gradients_equal_one_process_on_the_joined_micro_batches(tmp_path):
    from flexpack.parallel.parallelize import plain_name
    from flexpack.run.config import load_config, save_config
    from flexpack.run.memory_data import synthetic_run
    from flexpack.training.step import accumulate
    from step_equal_worker import STEP

    cfg = load_config(TINY, ["data.max_tokens=60", "parallel.activation_checkpointing=true", "log.progress=false",
                             f'runtime.out_dir="{tmp_path / "run"}"'])
    save_config(cfg, tmp_path / "cfg.json")
    torchrun_worker("step_equal_worker.py", tmp_path / "cfg.json", tmp_path, cwd=tmp_path)
    got = torch.load(tmp_path / "fsdp.pt", weights_only=True)
    assert got["world_size"] == 2 and got["sharded"]
    b0, b1 = got["batches"]
    assert len(b0) == len(b1) == 2 and b0 != b1 and sum(map(len, b0 + b1)) > 4  # several episodes a pack

    # one process, the same weights, every rank's micro-batches of the step joined
    torch.manual_seed(123)  # the model's init seeds itself (runtime.seed); this one must not matter
    run = synthetic_run(cfg)
    model = run.build_model()
    sums = accumulate(model, [run.collate([run.dataset[i] for i in b]) for b in b0 + b1], run, step=STEP)
    torch.testing.assert_close(got["sums"], sums, rtol=1e-5, atol=1e-7)  # loss, latent part, action part
    assert float(sums[0]) > 0
    grads = {plain_name(n): p.grad for n, p in model.named_parameters()}
    assert set(grads) == set(got["grads"])
    for name, g in grads.items():
        scale = float(g.abs().max()) or 1.0
        torch.testing.assert_close(got["grads"][name], g, rtol=1e-4, atol=1e-5 * scale, msg=name)
    assert sum(float(g.abs().sum()) > 0 for g in grads.values()) > len(grads) // 2  # gradients did flow


@pytest.mark.slow  # two torchrun ranks, four runs of a tiny model: ~25 s
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_step_multigpu_smoke_under_torchrun_writes_every_key(tmp_path):
    from step_multigpu import KEYS

    out = tmp_path / "step.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "benchmarks" / "step_multigpu.py"), "--smoke", "--family", "wan", "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    res = json.loads(out.read_text())
    assert res["world_size"] == 2 and res["device"] == "cpu (gloo)" and res["smoke"] is True
    assert "--nproc_per_node 2" in res["command"] and res["torch"] == torch.__version__ and res["date"]
    runs = res["runs"]
    assert sorted(runs) == ["wan-batch1-bf16-w2-g8-l2", "wan-packed-bf16-w2-g8-l2"]
    for name, r in runs.items():
        assert "error" not in r, r.get("error")
        assert all(k in r for k in KEYS), [k for k in KEYS if k not in r]
        assert r["step_s"] > 0 and r["tokens_per_s_per_gpu"] > 0 and r["mfu"] > 0
        assert 0 < r["comm_share"] < 1 and r["comm_kind"] == "gloo_share_of_cpu_wall_time"
        assert r["recompiles_after_warmup"] == 0 and r["peak_mem_gb"] is None  # no CUDA memory on the CPU
        assert r["rank_imbalance"] >= 1 and len(r["rank_busy_s_per_step"]) == 2 and r["finite"]
        assert r["global_episodes"] == 8 and r["world_size"] == 2
        # every episode of the global batch counted once, whatever the micro-batching
        assert r["useful_tokens_per_step"] == runs["wan-batch1-bf16-w2-g8-l2"]["useful_tokens_per_step"]
    b1, packed = runs["wan-batch1-bf16-w2-g8-l2"], runs["wan-packed-bf16-w2-g8-l2"]
    assert b1["micro_steps_per_rank"] == 4 and b1["repeated_episodes"] == 0  # batch 1: 8 episodes over 2 ranks
    assert packed["micro_steps_per_rank"] < 4 and packed["max_tokens"] == 64
    assert b1["trained_tokens_per_step"] == b1["useful_tokens_per_step"] < b1["computed_tokens_per_step"]


def test_step_plans_deal_equal_micro_steps_and_train_each_episode_once():
    from step_multigpu import step_plan, weak_scaling

    lengths = [5, 7, 3, 9, 4, 6, 8, 5, 2, 2, 11, 1]
    episodes = list(range(12))
    for world in (1, 2, 4):
        ranks, repeats = step_plan("batch1", episodes, lengths, world, 0, 4, seed=0)
        assert repeats == 0 and {len(r) for r in ranks} == {12 // world}
        assert sorted(e for r in ranks for mb in r for e in mb) == episodes and all(len(mb) == 1 for r in ranks
                                                                                   for mb in r)
        ranks, repeats = step_plan("packed", episodes, lengths, world, 16, 4, seed=0)
        flat = [e for r in ranks for mb in r for e in mb]
        assert len({len(r) for r in ranks}) == 1 and set(flat) == set(episodes) and len(flat) == 12 + repeats
        assert all(sum(lengths[e] for e in mb) <= 16 for r in ranks for mb in r)
        assert all(len(set(mb)) == len(mb) for r in ranks for mb in r)
    # the heaviest micro-batches are dealt in snake order: 2 ranks get 11+1 and 9+2 (of 11, 9, 2, 1)
    ranks, _ = step_plan("batch1", [10, 3, 8, 11], lengths, 2, 0, 4, seed=0)
    assert ranks == [[[10], [11]], [[3], [8]]]
    runs = {"a": {"family": "w", "variant": "packed", "float8": "off", "episodes_per_gpu": 4, "layers": 2,
                  "world_size": 1, "tokens_per_s_per_gpu": 100.0},
            "b": {"family": "w", "variant": "packed", "float8": "off", "episodes_per_gpu": 4, "layers": 2,
                  "world_size": 2, "tokens_per_s_per_gpu": 80.0}}
    assert weak_scaling(runs)["w-packed-off-e4-l2"]["efficiency"] == {"1": 1.0, "2": 0.8}


def test_multigpu_script_refuses_an_odd_or_single_gpu_count_in_one_line():
    for n in ("3", "1", "x"):
        out = subprocess.run(["bash", str(ROOT / "benchmarks" / "multigpu_h200.sh"), n], capture_output=True,
                             text=True, timeout=30, env={**os.environ, "OUT": "/nonexistent/never-made"})
        assert out.returncode == 2 and out.stderr.strip() == f"N must be an even number >= 2, got {n}"
