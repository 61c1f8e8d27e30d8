"""Summaries of ``scripts/gpu_suite.sh``: one shard's phases and junit XML, or several shards merged.

    python scripts/gpu_suite_summary.py shard OUT PHASES.tsv TAG    # OUT/summary_TAG.json
    python scripts/gpu_suite_summary.py merge DIR [DIR ...] --out OUT/summary.json

A shard's summary lists its phases (exit status, expected status, seconds, whether it was cut at its time
limit), the tests of its junit XML (counts, failures, skips with their reasons, the slowest tests) and the
machine; ``ok`` is true when every phase exited as expected, none was cut and no test failed. ``merge`` reads
every ``summary_*.json`` in the folders given and writes one summary of the whole suite (``ok``: every shard
ok, all shards of the split present).
"""

from __future__ import annotations

import json
import os
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

CUT = (124, 137, 130)  # timeout's status, killed after its grace period, SIGINT


def junit(path: Path) -> dict | None:
    if not path.is_file():
        return None
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    n = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    n["passed"] = n["tests"] - n["failures"] - n["errors"] - n["skipped"]
    cases = [c for s in suites for c in s.iter("testcase")]

    def name(c: ET.Element) -> str:
        return f"{c.get('classname')}::{c.get('name')}"

    n["failed_tests"] = [name(c) for c in cases if c.find("failure") is not None or c.find("error") is not None]
    n["skipped_tests"] = [f"{name(c)}: {c.find('skipped').get('message', '')}" for c in cases
                          if c.find("skipped") is not None and c.get("name")]
    n["slowest"] = [[name(c), round(float(c.get("time") or 0), 1)]
                    for c in sorted(cases, key=lambda c: -float(c.get("time") or 0))[:12]]
    return n


def shard(out: Path, phases: Path, tag: str) -> dict:
    rows = []
    for line in phases.read_text().splitlines() if phases.is_file() else []:
        if not line.strip():
            continue
        phase, rc, expected, seconds, note = (line.split("\t") + [""] * 5)[:5]
        r = {"phase": phase, "rc": int(rc), "expected": expected, "seconds": int(seconds), "note": note}
        r["cut"] = r["rc"] in CUT
        r["ok"] = (expected == "any" or str(r["rc"]) == expected) and not r["cut"]
        rows.append(r)
    res: dict = {"shard": tag, "phases": rows, "pytest": junit(out / f"pytest_{tag}.xml")}
    if os.environ.get("GPU_SUITE_DEVICE_INFO"):  # torch takes seconds to import: the shard's last summary only
        try:
            import torch

            res["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA"
            res["gpus"], res["torch"] = torch.cuda.device_count(), torch.__version__
        except Exception as e:  # noqa: BLE001
            res["device"] = f"torch not importable: {e}"
    py = res["pytest"]
    res["ok"] = bool(rows) and all(r["ok"] for r in rows) and py is not None and not py["failed_tests"]
    res["seconds"] = sum(r["seconds"] for r in rows if r["phase"] != "pytest") + max(
        (r["seconds"] for r in rows if r["phase"] == "pytest"), default=0)
    return res


def merge(dirs: list[Path]) -> dict:
    shards = {}
    for d in dirs:
        for f in sorted(Path(d).glob("summary_*.json")):
            s = json.loads(f.read_text())
            shards[s["shard"]] = s  # a later folder's copy of a shard replaces an earlier one
    counts = {k: sum((s.get("pytest") or {}).get(k, 0) for s in shards.values())
              for k in ("tests", "passed", "failures", "errors", "skipped")}
    wanted = {t.split("of")[1] for t in shards} if shards else set()
    total = int(next(iter(wanted))) if len(wanted) == 1 else None
    complete = total is not None and len(shards) == total
    return {"shards": shards, "pytest": counts, "complete": complete,
            "ok": complete and all(s["ok"] for s in shards.values()),
            "failed_tests": [t for s in shards.values() for t in (s.get("pytest") or {}).get("failed_tests", [])],
            "cut_phases": [f"{k}:{r['phase']}" for k, s in shards.items() for r in s["phases"] if r["cut"]],
            "seconds": {k: s.get("seconds") for k, s in shards.items()}}


def _write(path: Path, data: dict) -> None:
    tmp = path.with_name(f"{path.name}.{os.getpid()}")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) == 4 and argv[0] == "shard":
        out = Path(argv[1])
        _write(out / f"summary_{argv[3]}.json", shard(out, Path(argv[2]), argv[3]))
        return 0
    if len(argv) >= 4 and argv[0] == "merge" and argv[-2] == "--out":
        _write(Path(argv[-1]), merge([Path(d) for d in argv[1:-2]]))
        return 0
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
