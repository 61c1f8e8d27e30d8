"""Helpers shared by the command-line and fault tests (imported as ``helpers``: pytest puts tests/ on the path)."""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

from flexpack.cli import main


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    """(exit status, stderr) of ``flexpack ARGV``; argparse errors count as exit status 2 too."""
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err


def logged_steps(out: Path) -> list[int]:
    """Steps of the complete lines of ``out/metrics.jsonl`` (none before the file exists)."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.endswith("}")]


def wait_for_steps(proc: subprocess.Popen, out: Path, n: int, timeout: float = 120.0) -> None:
    """Wait until the ``train`` process ``proc`` has logged ``n`` steps in ``out``; fail if it ends first."""
    t0 = time.monotonic()
    while len(logged_steps(out)) < n:
        if proc.poll() is not None:
            raise AssertionError(f"train ended early (rc {proc.returncode}): {proc.stderr.read()[-3000:]}")
        if time.monotonic() - t0 > timeout:
            proc.kill()
            raise AssertionError(f"no {n} metrics lines after {timeout} s")
        time.sleep(0.02)
