"""The ``flexpack`` command line: one subcommand per module, imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> (module, one-line help). Each module defines ``add_arguments(parser)`` and
# ``run(args) -> int``; modules are imported lazily so ``flexpack stats`` never imports lerobot.
COMMANDS: dict[str, tuple[str, str]] = {
    "stats": ("flexpack.cli_stats", "waste, shapes and rank balance of a sampler on episode lengths"),
    "make-dataset": ("flexpack.data.synthetic", "write a synthetic LeRobot dataset"),
    "encode": ("flexpack.data.encode", "encode a LeRobot dataset's videos into the latent cache"),
    "check-dataset": ("flexpack.data.check", "list every problem of a dataset and its latent cache"),
    "train": ("flexpack.training.loop", "train a WanVA on a LeRobot dataset from a TOML/JSON config (torchrun for FSDP2)"),
    "verify": ("flexpack.training.verify", "check packed == per-episode outputs, loss and gradients; exit 1 on mismatch"),
    "export": ("flexpack.training.export", "write a run's newest checkpoint as a diffusers folder plus action stream"),
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="flexpack", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if name == wanted:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    module = importlib.import_module(COMMANDS[args.command][0])
    return int(module.run(args) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
