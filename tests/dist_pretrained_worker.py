"""torchrun worker of tests/test_distributed_pretrained.py: under FSDP2, load model.pretrained (each
rank its shards), record the loaded weights, then train with EMA and validation.

    torchrun --nproc_per_node 2 tests/dist_pretrained_worker.py CONFIG.json OUT_DIR
"""

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

from flexpack.commands.train import train
from flexpack.run.config import load_config


def main(config: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, out_dir = dist.get_rank(), Path(out)
    torch.set_num_threads(1)
    cfg = load_config(config)
    loaded = train(cfg, stop_after=0)  # built, sharded and loaded; no step taken
    params = list(loaded.model.parameters())
    full = get_model_state_dict(loaded.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, out_dir / "loaded.pt")
    res = train(cfg)
    facts = {"param_types": sorted({type(p).__name__ for p in params}), "steps": res.step,
             "local_numel": sum(p.to_local().numel() for p in params), "full_numel": sum(p.numel() for p in params)}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(facts))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
