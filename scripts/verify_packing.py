#!/usr/bin/env python
"""Packed ≡ per-episode check for a training config: outputs, loss and gradients.

    python scripts/verify_packing.py configs/tiny_cpu.toml [--checkpoint out/demo-run] [--drop-packing]

Prints a table per episode and exits 1 when anything differs beyond the tolerance
(the same as ``flexpack verify``; see ``flexpack/verify.py``).
"""

import argparse
import sys

from flexpack.training import verify

if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    verify.add_arguments(parser)
    sys.exit(verify.run(parser.parse_args()))
