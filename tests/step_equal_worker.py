"""torchrun worker of tests/test_step_multigpu.py: one FSDP2 accumulation (the first two packed micro-batches of
each rank's sampler) of a config over in-memory episodes; rank 0 saves the step's loss parts (summed over
ranks), the full gradients and every rank's micro-batches.

    torchrun --nproc_per_node 2 tests/step_equal_worker.py CONFIG.json OUT_DIR
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from flexpack.parallel.parallelize import plain_name
from flexpack.run.config import load_config
from flexpack.run.memory_data import synthetic_run
from flexpack.training.step import accumulate

STEP = 3  # the noise of a step other than the first


def main(config: str, out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank, size = dist.get_rank(), dist.get_world_size()
    run = synthetic_run(load_config(config), rank=rank, world_size=size)
    model = run.build_model()
    mine = [list(b) for b in list(run.sampler)[:2]]
    sums = accumulate(model, [run.collate([run.dataset[i] for i in b]) for b in mine], run, step=STEP)
    dist.all_reduce(sums)
    grads = {plain_name(n): p.grad.full_tensor() for n, p in model.named_parameters()}
    sharded = all(hasattr(p, "to_local") for p in model.parameters())
    batches = [None] * size
    dist.all_gather_object(batches, mine)
    if rank == 0:
        torch.save({"sums": sums, "grads": grads, "batches": batches, "sharded": sharded, "world_size": size},
                   Path(out) / "fsdp.pt")
    dist.barrier()  # no rank leaves while another still reads from it
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
