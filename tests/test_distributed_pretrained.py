"""model.pretrained, EMA and validation under FSDP2 (2 CPU ranks over gloo): a sharded start equals a
single-process one, the EMA of the local shards is the EMA of the weights, and the validation loss
equals a single-process evaluation of the same weights."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("lerobot")
pytest.importorskip("diffusers")

from flexpack.data.encode import encode_dataset  # noqa: E402
from flexpack.data.synthetic import make_synthetic_dataset  # noqa: E402
from flexpack.run.compose import build_run  # noqa: E402
from flexpack.run.config import load_config, save_config  # noqa: E402
from flexpack.run.model import build_model  # noqa: E402
from flexpack.run.state import checkpoint  # noqa: E402
from flexpack.training.validation import Validator  # noqa: E402
from helpers import TINY, torchrun_worker  # noqa: E402
from hf_tiny import tiny_diffusers  # noqa: E402


@pytest.mark.slow  # two torchrun ranks training: ~11 s
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_fsdp2_pretrained_start_ema_and_validation(tmp_path):
    root = make_synthetic_dataset(tmp_path / "ds", lengths=[25, 21, 17, 13, 9, 9], seed=6)
    encode_dataset(root, progress=False)
    tiny_diffusers(seed=8).save_pretrained(tmp_path / "transformer", max_shard_size="40KB")
    decay = 0.8
    cfg = load_config(TINY, [
        f'data.root="{root}"', f'runtime.out_dir="{tmp_path / "run"}"', "log.progress=false",
        f'model.pretrained="{tmp_path / "transformer"}"', "parallel.activation_checkpointing=true",
        "schedule.steps=2", "schedule.warmup_steps=1", "optim.accum_steps=1", "data.max_tokens=60",
        "checkpoint.every=1", "checkpoint.keep=3", f"optim.ema_decay={decay}", "data.val_episodes=[0, 3]",
        "validation.every=2"])
    save_config(cfg, tmp_path / "cfg.json")
    torchrun_worker("dist_pretrained_worker.py", tmp_path / "cfg.json", tmp_path, cwd=tmp_path)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert r0["param_types"] == ["DTensor"] and r0["local_numel"] < 0.6 * r0["full_numel"] and r0["steps"] == 2

    # the sharded start (each rank its slices of the checkpoint + the seeded action stream) is the single-process one
    single = build_model(cfg).state_dict()
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert set(loaded) == set(single)
    for name, value in single.items():
        assert torch.equal(loaded[name], value), name

    # EMA over local shards: ema_k = d·ema_{k-1} + (1 − d)·w_k, with ema_0 = the loaded weights
    ck = {s: tmp_path / "run" / "checkpoints" / f"step_{s:08d}" for s in (1, 2)}
    prev = loaded
    for s in (1, 2):
        w = checkpoint.read_tensors(ck[s])
        ema = checkpoint.read_ema(ck[s])
        for name in w:
            assert torch.allclose(ema[name], decay * prev[name] + (1 - decay) * w[name], atol=1e-6), (s, name)
        prev = ema

    # validation over both ranks' shares equals one process evaluating the same weights
    recs = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    val = [r for r in recs if "val_loss" in r]
    assert [r["step"] for r in val] == [2]
    model = build_model(cfg)
    checkpoint.load(ck[2], model, restore_rng=False)
    got = Validator(build_run(cfg)).evaluate(model)
    assert got["val_loss"] == pytest.approx(val[0]["val_loss"], rel=1e-5)
    assert got["val_action_loss"] == pytest.approx(val[0]["val_action_loss"], rel=1e-5)
