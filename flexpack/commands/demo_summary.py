"""The closing block of ``make demo`` (:func:`flexpack.tools.demo.summary`): what ran, where each output is,
what to try next.

    python -m flexpack.commands.demo_summary OUT [--bin .venv/bin]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from flexpack.tools.demo import summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m flexpack.commands.demo_summary", description=__doc__.splitlines()[0])
    p.add_argument("out", type=Path, help="the demo's output folder (make demo: out)")
    p.add_argument("--run", type=Path, default=None, help="run folder (default OUT/demo-run)")
    p.add_argument("--data", type=Path, default=None, help="dataset folder (default OUT/demo-data)")
    p.add_argument("--bin", default=".venv/bin", help="where the flexpack command is")
    args = p.parse_args(argv)
    print(summary(args.out, run=args.run, data=args.data, bin_dir=args.bin))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
