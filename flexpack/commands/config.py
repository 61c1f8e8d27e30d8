"""``flexpack config``: the training config's keys, values, defaults and docs.

``show [CONFIG] [--set KEY=VALUE]``: the resolved config, every key with its value and doc (keys
that differ from the default marked, with the default); ``defaults``: a complete commented TOML
that loads back to the defaults; ``markdown``: ``docs/CONFIG.md``.
"""

from __future__ import annotations

import argparse
import sys

from flexpack.commands.common import add_config, add_set, load


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    show = sub.add_parser("show", help="the resolved config: every key, its value, default and doc",
                          description="Print the resolved config: every key, its value, its default and its doc.")
    add_config(show, folders="a run, checkpoint or export folder (its config); default: the defaults", optional=True)
    add_set(show)
    sub.add_parser("defaults", help="a complete commented TOML of the defaults (loads back to exactly them)")
    sub.add_parser("markdown", help="the config reference as Markdown (docs/CONFIG.md)")


def run(args: argparse.Namespace) -> int:
    from flexpack.run import config_doc

    if args.action == "show":
        text = config_doc.render_show(load(args.config, args.overrides))
    elif args.action == "defaults":
        text = config_doc.render_defaults()
    else:
        text = config_doc.render_markdown()
    sys.stdout.write(text)
    return 0
