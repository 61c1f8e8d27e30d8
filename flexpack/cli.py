"""The ``flexpack`` command line: one subcommand per module, imported only when used.

Errors take one path for every subcommand: a user error (:mod:`flexpack.errors`) is printed as
``flexpack CMD: error: <one line>`` with exit status 2; a bug keeps its traceback;
``flexpack --debug CMD ...`` shows the traceback of user errors too.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from flexpack import __version__
from flexpack.errors import is_user_error, one_line

# subcommand -> (module, one-line help). Each module of flexpack/commands/ defines ``add_arguments(parser)``
# and ``run(args) -> int``; only the module of the command given is imported, and it imports the library
# (torch, lerobot, ...) inside ``run``: ``flexpack CMD --help`` stays under a second (tests/test_cli.py).
COMMANDS: dict[str, tuple[str, str]] = {
    "stats": ("flexpack.commands.stats", "waste, shapes and rank balance of a sampler on episode lengths"),
    "make-dataset": ("flexpack.commands.make_dataset", "write a synthetic LeRobot dataset"),
    "encode": ("flexpack.commands.encode", "encode a LeRobot dataset's videos into the latent cache"),
    "check-dataset": ("flexpack.commands.check_dataset", "list every problem of a dataset and its latent cache"),
    "train": ("flexpack.commands.train",
              "train a WanVA on a LeRobot dataset from a TOML/JSON config (torchrun for FSDP2)"),
    "verify": ("flexpack.commands.verify",
               "check packed == per-episode outputs, loss and gradients; exit 1 on mismatch"),
    "plot": ("flexpack.commands.plot",
             "write a PNG of a run's loss curves and throughput from its metrics.jsonl"),
    "sample": ("flexpack.commands.sample",
               "sample episodes of a trained run (forecast or rollout) and score them against baselines"),
    "export": ("flexpack.commands.export", "write a run's newest checkpoint as a diffusers folder plus action stream"),
    "config": ("flexpack.commands.config",
               "print the resolved training config, its defaults as TOML, or docs/CONFIG.md"),
}

# subcommands that read a training config: their --help points to where every key is documented
CONFIG_EPILOG = ("Every config key, its default and its doc: 'flexpack config show [CONFIG] [--set KEY=VALUE]' "
                 "(the resolved config), 'flexpack config defaults' (a complete TOML) and docs/CONFIG.md.")
TAKES_CONFIG = ("train", "verify", "sample")


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="flexpack", description="Packed variable-length robot episodes for video/VLA diffusion transformers.",
        epilog="A bad input is one line 'flexpack CMD: error: ...' and exit status 2; --debug shows its traceback.")
    parser.add_argument("--debug", action="store_true",
                        help="show the traceback of every error (by default only bugs show one)")
    parser.add_argument("--version", action="version", version=f"flexpack {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    wanted = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_text) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text,
                           epilog=CONFIG_EPILOG if name in TAKES_CONFIG else None)
        if name == wanted:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run one subcommand. User errors (:mod:`flexpack.errors`) print ``flexpack CMD: error: ...``
    on one line and return 2; other exceptions are bugs and propagate with their traceback."""
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    try:
        module = importlib.import_module(COMMANDS[args.command][0])
        return int(module.run(args) or 0)
    except Exception as exc:
        if args.debug or not is_user_error(exc):
            raise
        print(f"flexpack {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
