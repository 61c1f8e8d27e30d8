"""docs/USAGE.md "Train on your data": every command of its tested block, run at tiny scale.

The block is read from docs/USAGE.md (after the ``<!-- train-on-your-data -->`` marker) and run as
written, with only these substitutions: the model and run folders point into a temporary
directory holding tiny random models in the Wan2.2-TI2V-5B-Diffusers layout (``vae/``,
``transformer/``, ``text_encoder/``, ``tokenizer/``), ``cuda`` becomes ``cpu``, 8 ranks per node
become 2 (1 per "node" for the several-node command, whose two nodes run on localhost), the
rendezvous port is a free one, and train commands get a few extra ``--set`` for a 2-3 step run.
The dataset id resolves in a temporary lerobot cache holding a synthetic dataset.
"""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lerobot")
diffusers = pytest.importorskip("diffusers")
pytest.importorskip("transformers")

from flexpack.data.synthetic import make_synthetic_dataset  # noqa: E402
from hf_tiny import save_tiny_umt5, tiny_diffusers, tiny_tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TORCHRUN = Path(sys.executable).with_name("torchrun")
MARKER = "<!-- train-on-your-data -->"


def readme_block() -> list[str]:
    text = (ROOT / "docs" / "USAGE.md").read_text()
    block = text[text.index(MARKER):].split("```bash\n", 1)[1].split("```", 1)[0]
    return [line for line in block.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def tiny_wan(folder: Path) -> Path:
    import torch

    torch.manual_seed(0)
    diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                               temperal_downsample=[False, True, True], latents_mean=[0.0] * 4,
                               latents_std=[1.0] * 4).save_pretrained(folder / "vae")
    tiny_diffusers(seed=1, in_channels=4, out_channels=4, text_dim=16).save_pretrained(folder / "transformer")
    save_tiny_umt5(folder / "text_encoder", d_model=16, tokenizer=False)
    tiny_tokenizer().save_pretrained(folder / "tokenizer")
    return folder


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_readme_block_runs_end_to_end(tmp_path):
    lines = readme_block()
    assert (any(line.startswith("torchrun --nnodes") for line in lines)
            and any("flexpack export" in line for line in lines))
    home = tmp_path / "lerobot-home"
    make_synthetic_dataset(home / "lerobot" / "aloha_sim_insertion_human", lengths=[37, 29, 25, 21, 17, 13, 9, 9],
                           seed=3)
    wan, run = tiny_wan(tmp_path / "wan"), tmp_path / "run"
    tiny = ("--set data.max_tokens=120 --set data.num_workers=0 --set log.progress=false --set checkpoint.every=0 "
            "--set schedule.warmup_steps=1 --set schedule.rewarmup_steps=0 --set validation.every=1")
    script = ['set -euo pipefail', f'flexpack() {{ "{sys.executable}" -m flexpack.cli "$@"; }}',
              f'python() {{ "{sys.executable}" "$@"; }}', f'torchrun() {{ "{TORCHRUN}" "$@"; }}']
    for line in lines:
        line = line.replace("/models/Wan2.2-TI2V-5B-Diffusers", str(wan)).replace("/shared/runs/aloha", str(run))
        line = line.replace("cuda", "cpu")
        if line.startswith("torchrun --nnodes"):  # two 1-rank nodes on localhost, resuming the first run to step 3
            line = line.replace("--nproc_per_node 8", "--nproc_per_node 1")
            line = line.replace("$MASTER_ADDR:29500", f"127.0.0.1:{_free_port()}")
            line += f" {tiny} --set schedule.steps=3"
            line = f"(NODE_RANK=0; {line}) & p0=$!; (NODE_RANK=1; {line}) & p1=$!; wait $p0; wait $p1"
        elif line.startswith("torchrun"):
            line = line.replace("--nproc_per_node 8", "--nproc_per_node 2") + f" {tiny} --set schedule.steps=2"
        script.append(line)
    env = {**os.environ, "HF_LEROBOT_HOME": str(home), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1",
           "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    proc = subprocess.run(["bash", "-c", "\n".join(script)], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, "\n".join(script) + "\n" + proc.stdout[-4000:] + proc.stderr[-8000:]

    data = home / "lerobot" / "aloha_sim_insertion_human"
    assert (data / "latents" / "text" / "task_000000.safetensors").is_file()  # the cache beside the resolved dataset
    from flexpack.data import cache

    assert cache.read_text_header(cache.text_path(data / "latents", 0)).encoder == f"umt5:{wan}:512"
    state = json.loads((run / "checkpoints" / "step_00000003" / "train_state.json").read_text())
    assert state["step"] == 3 and state["world_size"] == 2  # the two "nodes" resumed the 2-rank run
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in recs if "val_loss" in r] == [1, 2, 3]
    exported = json.loads((run / "export" / "ema" / "config.json").read_text())
    assert (exported["in_channels"], exported["text_dim"], exported["num_layers"]) == (4, 16, 2)  # the pretrained shape
    assert ((run / "export" / "action_stream.safetensors").is_file()
            and (run / "export" / "normalization.json").is_file())
    assert re.search(r"exported .* -> ", proc.stdout)
