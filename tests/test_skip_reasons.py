"""Every skip in the test suite says why, in one line: a GPU test that does not run must say what it lacks."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def _reason(call: ast.Call, positional: int) -> str | None:
    """The literal reason of a skip call (keyword ``reason`` or the ``positional``-th argument)."""
    for kw in call.keywords:
        if kw.arg in ("reason", "msg"):
            return kw.value.value if isinstance(kw.value, ast.Constant) else "<computed>"
    if len(call.args) > positional:
        arg = call.args[positional]
        return arg.value if isinstance(arg, ast.Constant) and isinstance(arg.value, str) else "<computed>"
    return None


def skip_calls() -> list[tuple[str, int, str, str | None]]:
    """(file, line, kind, reason) of every ``skipif`` / ``skip`` call in the tests."""
    found = []
    for path in sorted(TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("skipif", "skip")):
                found.append((path.name, node.lineno, node.func.attr,
                              _reason(node, 1 if node.func.attr == "skipif" else 0)))
    return found


def test_every_skip_gives_a_one_line_reason():
    calls = skip_calls()
    assert any(f == "test_compiled_step.py" and k == "skipif" for f, _, k, _ in calls)  # the scan sees the CUDA skips
    bad = [f"{f}:{line} {kind} without a reason" for f, line, kind, why in calls if not why or not why.strip()]
    bad += [f"{f}:{line} {kind} reason spans lines" for f, line, kind, why in calls if why and "\n" in why]
    assert not bad, bad


def test_cuda_skips_say_cuda():
    """A skip for lack of CUDA names CUDA in its reason, so that -rs shows what was missing."""
    seen = 0
    for path in sorted(TESTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "skipif" and node.args:
                cond = ast.unparse(node.args[0])
                if cond.startswith("not ") and "cuda.is_available" in cond:  # skipped for lack of CUDA
                    why = _reason(node, 1) or ""
                    assert "CUDA" in why, f"{path.name}:{node.lineno}: {why!r}"
                    seen += 1
    # test_attention, test_blockmask (2), test_blockmask_compiled, test_compiled_step, test_profiling, ...
    assert seen >= 6
