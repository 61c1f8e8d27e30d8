"""torchrun worker of tests/test_distributed.py: train a config under FSDP2 and record per-rank facts.

    torchrun --nproc_per_node 2 tests/dist_worker.py CONFIG.json OUT_DIR
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
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(1)
    res = train(load_config(config))
    params = list(res.model.parameters())
    facts = {
        "rank": rank, "world_size": dist.get_world_size(), "steps": res.step, "lrs": res.lrs,
        "losses": res.losses, "episodes": res.episodes,
        "param_types": sorted({type(p).__name__ for p in params}),
        "local_numel": sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params),
        "full_numel": sum(p.numel() for p in params),
        "checkpoint": str(res.checkpoint),
    }
    full = get_model_state_dict(res.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if rank == 0:
        torch.save(full, out_dir / "final_weights.pt")
    (out_dir / f"rank{rank}.json").write_text(json.dumps(facts))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
