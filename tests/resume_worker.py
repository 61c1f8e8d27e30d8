"""torchrun worker of tests/test_resume.py: run a list of training jobs in one process group.

    torchrun --nproc_per_node 2 tests/resume_worker.py JOBS.json OUT_DIR

Each job is ``{"name", "config", "stop_after"}`` (train) or ``{"copy": [SRC, DST]}`` (rank 0 copies
a run folder); every train job writes ``OUT_DIR/NAME.rank<r>.json`` with what that rank saw.
"""

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from flexpack.commands.train import train
from flexpack.run.config import load_config


def main(jobs: str, out: str) -> None:
    dist.init_process_group("gloo")
    rank, out_dir = dist.get_rank(), Path(out)
    torch.set_num_threads(1)
    for job in json.loads(Path(jobs).read_text()):
        if "copy" in job:
            if rank == 0:
                shutil.copytree(*job["copy"])
            dist.barrier()
            continue
        res = train(load_config(job["config"]), stop_after=job.get("stop_after"))
        facts = {"start_step": res.start_step, "step": res.step, "losses": res.losses, "lrs": res.lrs,
                 "episodes": res.episodes, "world_size": dist.get_world_size(), "host_offload": _on_host(res.model)}
        (out_dir / f"{job['name']}.rank{rank}.json").write_text(json.dumps(facts))
    dist.destroy_process_group()


def _on_host(model) -> bool:
    """Whether FSDP2 keeps this model's shards on the host (its CPUOffloadPolicy)."""
    state = model._get_fsdp_state() if hasattr(model, "_get_fsdp_state") else None
    group = state._fsdp_param_group if state is not None else None
    return bool(group and all(p.offload_to_cpu for p in group.fsdp_params))


if __name__ == "__main__":
    main(*sys.argv[1:3])
