"""torchrun worker of tests/test_sampling_dist.py: packed sampling with an FSDP2-sharded model.

    torchrun --nproc_per_node 2 tests/sampling_dist_worker.py OUT_DIR
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flexpack.parallel.parallelize import ParallelOptions, parallelize  # noqa: E402
from flexpack.run.model import build_model  # noqa: E402
from flexpack.sampling.solver import PackedSampler, SampleOptions  # noqa: E402
from test_sampling import SPECS_DIST, _cfg, _items, _pairs, sample_run  # noqa: E402


def main(out: str) -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    cfg = _cfg("teacher_forcing", "data.max_tokens=60")
    torch.manual_seed(0)
    model = parallelize(build_model(cfg).eval(), device=torch.device("cpu"), options=ParallelOptions(compile=False))
    pairs = _pairs(_items(), SPECS_DIST)
    sampler = PackedSampler(model, sample_run(cfg), SampleOptions(steps=2))  # this rank's share (compose: the group's)
    sampler.run(pairs)
    if dist.get_rank() == 0:
        torch.save({"latent": [p.pred_latent for p in pairs], "action": [p.pred_action for p in pairs],
                    "forwards": sampler.forwards}, Path(out) / "pairs.pt")
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
