#!/usr/bin/env python
"""Packed ≡ per-episode check for a training config: outputs, loss and gradients.

    python scripts/verify_packing.py configs/tiny_cpu.toml [--checkpoint out/demo-run] [--drop-packing]

Prints a table per episode and exits 1 when anything differs beyond the tolerance
(the same as ``flexpack verify``; see ``flexpack/verify.py``).
"""

import sys

from flexpack.cli import main

if __name__ == "__main__":
    # through the command line's error path: a bad input (a missing dataset, ...) is one line and exit 2
    sys.exit(main(["verify", *sys.argv[1:]]))
