"""What ``flexpack verify`` compares and how it reports it: tolerances per dtype, per-episode rows,
gradient errors per parameter group over all ranks' shards, and the printed table."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

TOL = 1e-4


@dataclass(frozen=True, kw_only=True)
class Tolerance:
    """Max relative errors (``max |a − b| / max |b|``) per compared quantity."""

    output: float = TOL  # video / action predictions per episode
    loss: float = TOL  # per-episode and per-micro-batch losses
    grad: float = TOL  # every parameter group's gradient

    @classmethod
    def uniform(cls, tol: float) -> "Tolerance":
        return cls(output=tol, loss=tol, grad=tol)

    def __str__(self) -> str:
        return f"output {self.output:.0e}, loss {self.loss:.0e}, grad {self.grad:.0e}"


# float32: rounding only. bfloat16 (autocast or FSDP mixed precision): activations carry ~3
# significant digits (eps 7.8e-3) and the packed and per-episode passes tile and reduce
# differently, so outputs may differ by a few bf16 ulps of their largest value; the loss is a mean
# over many tokens (errors average out, the reference figures are 1e-4 and 2.7e-4); gradients sum
# over all tokens in bf16 matmuls. A dropped packing layout moves them by much more (the tiny
# model on CPU in bf16: outputs 9e-2, gradients 2.5e-1; tests/test_verify.py checks it still fails).
TOLERANCES = {"float32": Tolerance(), "bfloat16": Tolerance(output=3e-2, loss=2e-3, grad=5e-2)}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp(min=1e-12))


@dataclass
class EpisodeRow:
    episode: int
    frames: int
    video_err: float
    action_err: float
    loss_batched: float
    loss_alone: float

    @property
    def loss_err(self) -> float:
        return abs(self.loss_batched - self.loss_alone) / max(abs(self.loss_alone), 1e-12)


@dataclass
class VerifyReport:
    rows: list[EpisodeRow] = field(default_factory=list)
    loss_batched: list[float] = field(default_factory=list)  # per micro-batch
    loss_alone: list[float] = field(default_factory=list)
    grad_err: list[float] = field(default_factory=list)  # per micro-batch, over all parameters
    grad_groups: list[dict[str, float]] = field(default_factory=list)  # per micro-batch: group -> rel err
    nonfinite: list[str] = field(default_factory=list)  # parameters with a non-finite gradient
    tol: float | Tolerance = TOL
    setup: str = ""  # how the model ran (device, dtype, compile, backend, ranks)

    @property
    def tolerance(self) -> Tolerance:
        return self.tol if isinstance(self.tol, Tolerance) else Tolerance.uniform(self.tol)

    @property
    def loss_rel(self) -> list[float]:
        """Per micro-batch: batched loss vs the accumulated per-episode losses."""
        return [abs(a - b) / max(abs(b), 1e-12) for a, b in zip(self.loss_batched, self.loss_alone)]

    @property
    def max_err(self) -> float:
        errs = [max(r.video_err, r.action_err, r.loss_err) for r in self.rows] + self.grad_err + self.loss_rel
        return max(errs, default=0.0)

    def failures(self) -> list[str]:
        """What exceeds its tolerance, one phrase each (empty: OK)."""
        t, out = self.tolerance, []
        worst = lambda xs: max(xs, default=0.0)  # noqa: E731
        if (e := worst([max(r.video_err, r.action_err) for r in self.rows])) > t.output:
            out.append(f"output {e:.2e} > {t.output:.0e}")
        if (e := worst([r.loss_err for r in self.rows] + self.loss_rel)) > t.loss:
            out.append(f"loss {e:.2e} > {t.loss:.0e}")
        if (e := worst(self.grad_err + [v for g in self.grad_groups for v in g.values()])) > t.grad:
            out.append(f"grad {e:.2e} > {t.grad:.0e}")
        if self.nonfinite:
            out.append(f"non-finite gradients in {', '.join(self.nonfinite[:5])}")
        return out

    @property
    def ok(self) -> bool:
        return not self.failures()

    def table(self) -> str:
        lines = [self.setup] if self.setup else []
        lines.append(f"{'episode':>8} {'frames':>6} {'video err':>10} {'action err':>10} {'loss batched':>13} "
                     f"{'loss alone':>11} {'loss err':>9}")
        for r in self.rows:
            lines.append(f"{r.episode:>8} {r.frames:>6} {r.video_err:>10.2e} {r.action_err:>10.2e} "
                         f"{r.loss_batched:>13.6f} {r.loss_alone:>11.6f} {r.loss_err:>9.2e}")
        for i, (a, b, g) in enumerate(zip(self.loss_batched, self.loss_alone, self.grad_err)):
            lines.append(f"micro-batch {i}: loss batched {a:.6f} vs accumulated alone {b:.6f} "
                         f"(rel diff {self.loss_rel[i]:.2e}); max grad rel err {g:.2e}")
        if self.grad_groups:
            lines.append("gradient rel err per parameter group (worst micro-batch):")
            for name in self.grad_groups[0]:
                lines.append(f"  {name:<24} {max(g.get(name, 0.0) for g in self.grad_groups):.2e}")
        lines.append(f"gradients finite: {'yes' if not self.nonfinite else 'NO: ' + ', '.join(self.nonfinite[:5])}")
        fails = self.failures()
        verdict = "OK" if not fails else "MISMATCH (" + "; ".join(fails) + ")"
        lines.append(f"{verdict}: max rel err {self.max_err:.2e} (tolerance {self.tolerance})")
        return "\n".join(lines)


def param_group(name: str) -> str:
    """The group a parameter's gradient is reported in: ``blocks.<i>`` for a transformer block,
    else its top-level module (``patch_embed``, ``head_proj``, ...); wrapper prefixes dropped."""
    name = re.sub(r"(_checkpoint_wrapped_module|_orig_mod|_fsdp_wrapped_module)\.", "", name)
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" and len(parts) > 2 else parts[0]


def _local(t: torch.Tensor | None) -> torch.Tensor | None:
    """This rank's shard of a (possibly DTensor) gradient."""
    return t.to_local() if t is not None and hasattr(t, "to_local") else t


def _grads(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, this rank's gradient shard, fp32 copy); zeros for a parameter without a gradient."""
    out = []
    for name, p in model.named_parameters():
        g = _local(p.grad)
        out.append((name, torch.zeros_like(_local(p.data), dtype=torch.float32) if g is None
                      else g.detach().float().clone()))
    return out


def _compare_grads(batched: list[tuple[str, torch.Tensor]], alone: list[tuple[str, torch.Tensor]]
                   ) -> tuple[float, dict[str, float], list[str]]:
    """(rel err over all parameters, rel err per group, names with non-finite gradients), over all
    ranks' shards: max |a - b| and max |b| are reduced with MAX."""
    groups: dict[str, int] = {}
    for name, _ in alone:
        groups.setdefault(param_group(name), len(groups))
    dev = alone[0][1].device if alone else torch.device("cpu")
    diff, ref = torch.zeros(len(groups), device=dev), torch.zeros(len(groups), device=dev)
    bad = torch.zeros(len(alone), device=dev)
    for i, ((name, a), (_, b)) in enumerate(zip(batched, alone)):
        k = groups[param_group(name)]
        if a.numel():
            diff[k] = torch.maximum(diff[k], (a - b).abs().max())
            ref[k] = torch.maximum(ref[k], b.abs().max())
            bad[i] = (~torch.isfinite(a)).any().float() + (~torch.isfinite(b)).any().float()
    stats = torch.cat([diff, ref, bad])
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(stats, op=dist.ReduceOp.MAX)
    stats = stats.cpu()
    diff, ref, bad = stats[: len(groups)], stats[len(groups): 2 * len(groups)], stats[2 * len(groups):]
    per = {g: float(diff[k] / ref[k].clamp(min=1e-12)) for g, k in groups.items()}
    total = float(diff.max() / ref.max().clamp(min=1e-12)) if len(groups) else 0.0
    return total, per, [name for (name, _), b in zip(alone, bad.tolist()) if b]
