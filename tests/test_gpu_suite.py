"""scripts/gpu_suite.sh's shards and summaries, on the CPU: a phase cut at its limit or a failed test fails the
shard, the merged summary is complete only with every shard of the split, and a bad --shard is one line."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))
import gpu_suite_summary as gs  # noqa: E402

XML = """<testsuites><testsuite tests="3" failures="{f}" errors="0" skipped="1" time="9">
<testcase classname="tests.test_a" name="test_one" time="7.5"/>
<testcase classname="tests.test_a" name="test_two" time="1.0">{fail}</testcase>
<testcase classname="tests.test_b" name="test_three" time="0.1"><skipped message="FA4 not installed"/></testcase>
</testsuite></testsuites>"""


def shard(tmp: Path, tag: str, rows: list[str], failed: bool = False) -> dict:
    (tmp / f"pytest_{tag}.xml").write_text(XML.format(f=int(failed), fail="<failure message='x'/>" if failed else ""))
    (tmp / "phases.tsv").write_text("\n".join(rows) + "\n")
    assert gs.main(["shard", str(tmp), str(tmp / "phases.tsv"), tag]) == 0
    return json.loads((tmp / f"summary_{tag}.json").read_text())


def test_a_shard_is_ok_only_without_cuts_and_failures(tmp_path):
    good = ["wheels\t0\t0\t10\t", "requirements\t0\t0\t5\t", "pytest\t0\t0\t400\t", "verify-fsdp\t-1\tany\t0\tnot run"]
    s = shard(tmp_path, "1of2", good)
    assert s["ok"] and s["pytest"]["passed"] == 2 and s["pytest"]["skipped"] == 1
    assert s["pytest"]["slowest"][0] == ["tests.test_a::test_one", 7.5]
    assert s["pytest"]["skipped_tests"] == ["tests.test_b::test_three: FA4 not installed"] and s["seconds"] == 415
    cut = shard(tmp_path, "1of2", good[:2] + ["pytest\t124\t0\t540\t"])
    assert not cut["ok"] and cut["phases"][-1]["cut"]
    assert not shard(tmp_path, "1of2", good, failed=True)["ok"]
    assert not shard(tmp_path, "1of2", ["wheels\t0\t0\t10\t", "requirements\t1\t0\t5\t", "pytest\t0\t0\t9\t"])["ok"]


def test_the_merged_summary_needs_every_shard(tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    rows = ["wheels\t0\t0\t10\t", "pytest\t0\t0\t300\t"]
    shard(a, "1of2", rows)
    half = gs.merge([a])
    assert not half["complete"] and not half["ok"]
    shard(b, "2of2", rows, failed=True)
    whole = gs.merge([a, b])
    assert whole["complete"] and not whole["ok"] and whole["failed_tests"] == ["tests.test_a::test_two"]
    assert whole["pytest"]["tests"] == 6 and whole["seconds"] == {"1of2": 310, "2of2": 310}
    shard(b, "2of2", rows)
    assert gs.merge([a, b])["ok"]


def test_a_bad_shard_is_refused_in_one_line():
    out = subprocess.run(["bash", str(ROOT / "scripts" / "gpu_suite.sh"), "--shard", "3/2"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.strip() == "gpu_suite.sh: --shard must be 1/1, 1/2 or 2/2, got '3/2'"
