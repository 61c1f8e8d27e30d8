"""The command line: every argparse definition and the subcommands' thin drivers."""
