"""Where a profiled step's time goes: categories of device time (CPU op time without a GPU).

Input: the events of a ``torch.profiler`` window (``prof.events()``). Each unit of time is
classified into one of :data:`CATEGORIES`:

- on CUDA, every device kernel (memcpy/memset included) with its duration, attributed to the CPU
  op that launched it (the link ``key_averages`` uses for "Self CUDA"); kernels without a
  launching op (e.g. inside a replayed CUDA graph) are classified by their name alone;
- on CPU, every op's self time (named ranges and ``ProfilerStep#`` themselves count nothing: their
  self time is Python, not ops).

A unit is classified by its kernel name, the chain of CPU ops around its launch (innermost first,
up to the named ranges ``forward`` / ``backward`` / ``optimizer`` / ``block_mask`` / ``data`` /
``attention`` of :mod:`flexpack.training.observe.profiling` and ``FlexAttnFunc``), and, for a backward op, the
chain of the forward op that created its autograd node (linked by sequence number), so the
backward of attention counts as attention although it runs outside the ``attention`` range.
First match wins: communication (NCCL/gloo kernels, c10d ops) → optimizer (``optimizer`` range,
``Optimizer.step``/``zero_grad``) → other (``data`` and ``block_mask`` ranges: loading and mask
builds are overhead, not model compute) → attention (the ``attention`` range, SDPA/flash/flex
ops and kernels, inductor templates that are no matmul, text cross-attention included) → gemm
(cuBLAS/CUTLASS/nvjet/Triton mm kernels, ``aten::mm``-like ops) → elementwise
(pointwise/reduction/norm/copy/cast kernels and ops) → other.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any, Iterable

from torch.autograd import DeviceType

CATEGORIES = ("attention", "gemm", "elementwise", "communication", "optimizer", "other")
RANGES = ("data", "forward", "backward", "optimizer", "block_mask", "attention")

_COMM = re.compile(r"nccl|gloo|c10d::|all_?reduce|all_?gather|reduce_?scatter|record_param_comms|all_?to_?all", re.I)
_ATTN = re.compile(r"attention|flash|fmha|sdpa|flex_attn", re.I)
# inductor's Triton templates are matmuls (named after them) or FlexAttention: a template that is
# no matmul is attention even where the name says nothing more (blocks compiled whole, no ranges)
_ATTN_TEMPLATE = re.compile(r"triton_tem_(?!.*(mm|conv))")
_GEMM_KERNEL = re.compile(r"gemm|nvjet|xmma|cublas|cutlass|wgmma|triton_tem_fused_(mm|addmm|bmm)", re.I)
_GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addbmm", "aten::matmul", "aten::linear",
             "aten::_scaled_mm", "aten::mv", "aten::addmv", "aten::dot"}
_ELEM_KERNEL = re.compile(r"elementwise|vectorized|unrolled|reduce|norm|copy|cat|triton_(poi|red|per)_|memcpy|memset|"
                          r"fill|softmax|gelu|silu|sigmoid|tanh|pointwise|foreach", re.I)
# aten ops that are neither arithmetic nor data movement of activations: views (CPU dispatch
# time only), indexing, sorting, random numbers, allocation, host reads
_OTHER_OPS = re.compile(r"index|gather|scatter|sort|nonzero|unique|searchsorted|bucketize|embedding|item|"
                        r"_local_scalar_dense|random|normal|uniform|bernoulli|randperm|randn|rand\b|arange|empty|"
                        r"resize|set_|lift|detach|view|reshape|as_strided|unsqueeze|squeeze|permute|transpose|"
                        r"expand|select|slice|narrow|split|unbind|chunk|^aten::t$|alias|unflatten|flatten", re.I)
_BACKWARD_NODE = "autograd::engine::evaluate_function: "


@dataclass(frozen=True)
class Unit:
    """One piece of classified time: a kernel (CUDA) or an op's self time (CPU)."""

    name: str  # kernel name, or the op's name
    us: float
    chain: tuple[str, ...]  # launching op and its ancestors, innermost first (empty: unattributed)
    forward_chain: tuple[str, ...]  # for a backward op: the chain of the forward op of its node
    start_us: float  # start of the launching op (CPU clock), for step membership
    kernel: bool


def classify(unit: Unit) -> str:
    names = unit.chain + unit.forward_chain
    kernel = unit.name if unit.kernel else ""
    # the launching op, past CUDA runtime calls should kineto link a kernel to one
    leaf = next((n for n in unit.chain if not n.startswith(("cuda", "cu", "hip"))), "")
    if unit.forward_chain and ("Backward" in leaf or leaf.startswith(_BACKWARD_NODE)):
        leaf = unit.forward_chain[0]  # an autograd node's own time: the kind of the op it differentiates
    if (kernel and _COMM.search(kernel)) or any(_COMM.search(n) for n in unit.chain):
        return "communication"
    if any(n == "optimizer" or n.startswith(("Optimizer.step", "Optimizer.zero_grad")) for n in unit.chain):
        return "optimizer"
    if any(n in ("data", "block_mask") for n in names):
        return "other"
    if any(_ATTN.search(n) for n in names) or (kernel and (_ATTN.search(kernel) or _ATTN_TEMPLATE.match(kernel))):
        return "attention"
    if (kernel and _GEMM_KERNEL.search(kernel)) or leaf in _GEMM_OPS:
        return "gemm"
    if kernel and _ELEM_KERNEL.search(kernel):
        return "elementwise"
    if leaf.startswith("aten::") and not _OTHER_OPS.search(leaf):
        return "elementwise"
    return "other"


def _ancestors(fe: Any) -> list[Any]:
    out = []
    while fe is not None:
        out.append(fe)
        fe = fe.cpu_parent
    return out


def extract_units(events: Iterable[Any], device_time: bool) -> list[Unit]:
    """Units of time of a profiler window's events (``FunctionEvent``\\ s): kernels when
    ``device_time`` (CUDA), else CPU ops' self time."""
    events = list(events)
    cpu = [e for e in events if e.device_type == DeviceType.CPU and not getattr(e, "is_async", False)]
    forward: dict[tuple[int, int], tuple[str, ...]] = {}
    by_seq: dict[int, tuple[str, ...]] = {}
    for e in sorted(cpu, key=lambda e: e.time_range.start):
        if e.sequence_nr >= 0 and not e.name.startswith(_BACKWARD_NODE):
            chain = tuple(a.name for a in _ancestors(e))
            forward.setdefault((e.thread, e.sequence_nr), chain)
            by_seq.setdefault(e.sequence_nr, chain)

    def forward_chain(anc: list[Any]) -> tuple[str, ...]:
        node = next((a for a in anc if a.name.startswith(_BACKWARD_NODE)), None)
        if node is None or node.sequence_nr < 0:
            return ()
        return forward.get((node.fwd_thread, node.sequence_nr)) or by_seq.get(node.sequence_nr, ())

    units: list[Unit] = []
    attributed: dict[str, float] = defaultdict(float)
    for e in cpu:
        annotation = bool(e.is_user_annotation) or e.name.startswith("ProfilerStep#")
        if device_time:
            # a range's GPU-side mirror is linked to it like a kernel: the span, not work
            kernels = [k for k in e.kernels if k.name != e.name] if not annotation else []
            if not kernels:
                continue
            anc = _ancestors(e)
            chain, fwd = tuple(a.name for a in anc), forward_chain(anc)
            for k in kernels:
                units.append(Unit(k.name, float(k.duration), chain, fwd, e.time_range.start, True))
                attributed[k.name] += float(k.duration)
        elif not annotation and e.self_cpu_time_total > 0:
            anc = _ancestors(e)
            units.append(Unit(e.name, float(e.self_cpu_time_total), tuple(a.name for a in anc), forward_chain(anc),
                              e.time_range.start, False))
    if device_time:  # device time no CPU op claimed (graph replays): by kernel name alone
        totals: dict[str, tuple[float, float]] = {}
        for e in events:
            if e.device_type == DeviceType.CUDA and not e.is_user_annotation and e.name not in RANGES \
                    and not e.name.startswith("ProfilerStep#"):
                us, start = totals.get(e.name, (0.0, e.time_range.start))
                totals[e.name] = (us + e.time_range.elapsed_us(), start)
        for name, (us, start) in totals.items():
            rest = us - attributed.get(name, 0.0)
            if rest > 1e-3 * max(us, 1.0):
                units.append(Unit(name, rest, (), (), start, True))
    return units


def step_windows(events: Iterable[Any]) -> list[tuple[float, float]]:
    """(start, end) in µs of every ``ProfilerStep#k`` range, in order."""
    steps = [e for e in events if e.name.startswith("ProfilerStep#")]
    return [(e.time_range.start, e.time_range.end) for e in sorted(steps, key=lambda e: e.time_range.start)]


def categories(units: Iterable[Unit]) -> dict[str, float]:
    """Seconds per category (every category present, zeros included)."""
    out = dict.fromkeys(CATEGORIES, 0.0)
    for u in units:
        out[classify(u)] += u.us / 1e6
    return out


def shares(seconds: dict[str, float]) -> dict[str, float]:
    total = sum(seconds.values())
    if total <= 0:
        return {c: (1.0 if c == "other" else 0.0) for c in seconds}
    return {c: s / total for c, s in seconds.items()}


def kernel_table(units: Iterable[Unit], rows: int = 30) -> list[dict[str, Any]]:
    """Top ``rows`` kernels (ops on CPU) by time: name, category, calls, ms, share of the units' time."""
    agg: dict[tuple[str, str], list[float]] = {}
    total = 0.0
    for u in units:
        entry = agg.setdefault((u.name, classify(u)), [0, 0.0])
        entry[0] += 1
        entry[1] += u.us
        total += u.us
    top = sorted(agg.items(), key=lambda kv: -kv[1][1])[:rows]
    return [{"name": n, "category": c, "calls": int(k), "ms": us / 1e3, "share": us / total if total else 0.0}
            for (n, c), (k, us) in top]


def range_seconds(events: Iterable[Any]) -> dict[str, dict[str, float]]:
    """Wall seconds (CPU clock) and count of each named range over the window."""
    out = {r: {"seconds": 0.0, "count": 0} for r in RANGES}
    for e in events:
        if e.name in out and e.device_type == DeviceType.CPU:
            out[e.name]["seconds"] += e.time_range.elapsed_us() / 1e6
            out[e.name]["count"] += 1
    return out


def format_table(table: list[dict[str, Any]], unit: str) -> str:
    lines = [f"{'ms':>10}  {'share':>6}  {'calls':>6}  {'category':<13} {unit}"]
    lines += [f"{r['ms']:>10.3f}  {100 * r['share']:>5.1f}%  {r['calls']:>6}  {r['category']:<13} {r['name'][:120]}"
              for r in table]
    return "\n".join(lines)
