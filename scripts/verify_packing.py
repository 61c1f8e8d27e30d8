#!/usr/bin/env python
"""Packed ≡ per-episode check for a training config: outputs, loss and gradients.

    python scripts/verify_packing.py configs/tiny_cpu.toml [--checkpoint out/demo-run] [--drop-packing]
    python scripts/verify_packing.py configs/wan5b_pack.toml --synthetic --synthetic-hw 8 16 \\
        --set "model.overrides={attn_backend='flex', num_layers=2}"      # CUDA, bf16, compiled blocks
    torchrun --nproc_per_node 2 scripts/verify_packing.py CONFIG ...     # FSDP2, as training shards

The model is built as training builds it (device, runtime.dtype, compiled blocks, FSDP2 under
torchrun); ``--synthetic`` uses in-memory episodes instead of ``data.root``. Prints a table per
episode and the gradient error per parameter group; exits 1 when anything differs beyond the
tolerances of the dtype, 2 on a bad input (one line). The same as ``flexpack verify``; see
``flexpack/tools/verify.py``.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from flexpack.cli import main  # noqa: E402

if __name__ == "__main__":
    # through the command line's error path: a bad input (a missing dataset, ...) is one line and exit 2
    sys.exit(main(["verify", *sys.argv[1:]]))
