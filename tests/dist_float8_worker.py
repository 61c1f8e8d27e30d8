"""torchrun worker for tests/test_float8.py: FSDP2 over 2 gloo ranks with float8 (emulated) tensorwise
weights all-gathered in float8; one step, the scales precomputed, the model state saved with DCP."""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_model_state_dict

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from flexpack.attention.flex import FlexAttnFunc  # noqa: E402
from flexpack.families.wan.config import wan_config
from flexpack.families.wan.model import WanVA  # noqa: E402
from flexpack.flow.noise import episode_flow_sample  # noqa: E402
from flexpack.flow.objective import FlowMatchingConfig, flow_loss  # noqa: E402
from flexpack.packing.collate import PackCollate  # noqa: E402
from flexpack.parallel import float8  # noqa: E402
from flexpack.parallel.parallelize import ParallelOptions, parallelize  # noqa: E402

out = Path(sys.argv[1])
dist.init_process_group("gloo")
rank = dist.get_rank()
float8.MIN_DIM = 16  # the tiny model's layers
torch.manual_seed(0)
model = WanVA(wan_config("tiny", num_layers=2), attn=FlexAttnFunc("dense"))
parallelize(model, device=torch.device("cpu"), options=ParallelOptions(float8="tensorwise"))
w = model.blocks[0].ffn.fc1.weight
g = torch.Generator().manual_seed(rank)
items = [{"latent": torch.randn(4, F, 4, 4, generator=g), "text": torch.randn(6, 32, generator=g), "episode_index": i}
         for i, F in enumerate([5, 3])]
batch, cfg = PackCollate(8)(items), FlowMatchingConfig()
sample = episode_flow_sample(batch, cfg, [0, 1])
loss = flow_loss(model(sample.inputs, **sample.model_kwargs(), text_slots=4), sample, batch, cfg).loss
loss.backward()
torch.optim.AdamW(model.parameters(), lr=1e-3).step()
float8.after_optimizer_step(model)
sd = get_model_state_dict(model)
dcp.save({"model": sd}, checkpoint_id=str(out / "ckpt"))
full = {k: v.full_tensor() for k, v in sd.items()}
if rank == 0:
    torch.save({"full": full, "all_gather": model.float8_all_gather, "weight_type": type(w).__name__,
                "local_type": type(w._local_tensor).__name__, "loss": float(loss.detach())}, out / "rank0.pt")
dist.destroy_process_group()
