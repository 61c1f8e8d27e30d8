"""What ``flexpack export`` adds for the ecosystem beside a family's own files.

``OUT/README.md``
    A model card (Hugging Face front matter + text): base model, data, steps, the training config,
    the final losses of ``metrics.jsonl`` and the newest sample metrics under ``RUN/samples/``.
``stats_tensors``
    Action statistics as LeRobot's processors hold them (every family's LeRobot-style folder). The
    ``diffusers`` export's ``OUT/lerobot_policy/`` folder is the Wan family's
    (:mod:`flexpack.families.wan.export_policy`); ``write_policy_folder``, ``write_extras`` and
    ``POLICY_TYPE`` moved there, and their old names here warn (a ``DeprecationWarning``) until flexpack 0.3.
``push_to_hub``
    Uploads the finished folder through ``huggingface_hub`` (``HfApi`` or any object with its
    ``create_repo`` / ``upload_folder`` methods).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from flexpack.data.normalization import ActionStats
    from flexpack.run.root import Run

POLICY_DIR = "lerobot_policy"


# -- run facts -------------------------------------------------------------------------------------
def _read(path: Path, run: Path, *, tail: bool = False) -> str | None:
    """A report file's text, or None (said on stderr) when it is not a bounded regular file of the run."""
    from flexpack.run.state.report_files import report_text

    try:
        return report_text(path, run, tail=tail)
    except ValueError as exc:
        print(f"export: warning: {exc}; left out of the model card", file=sys.stderr)
        return None


def _records(run: Path) -> list[dict[str, Any]]:
    path = run / "metrics.jsonl"
    text = _read(path, run, tail=True) if os.path.lexists(path) else None
    out = []
    for line in text.splitlines() if text else []:
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue  # a torn last line of a killed run
        if isinstance(rec, dict):
            out.append(rec)
    return out


def final_losses(run: Path) -> dict[str, float]:
    """The last logged value of every ``*loss`` key (train and validation) in ``RUN/metrics.jsonl``."""
    out: dict[str, float] = {}
    for rec in _records(run):
        for key, value in rec.items():
            if key.endswith("loss") and isinstance(value, (int, float)) and not isinstance(value, bool):
                out[key] = float(value)
    return out


def sample_metrics(run: Path) -> tuple[Path | None, dict[str, float]]:
    """The newest ``RUN/samples/**/metrics.json`` and its numeric entries (none before sampling runs); only
    regular files inside the run, of bounded size (:mod:`flexpack.run.state.report_files`)."""
    from flexpack.run.state.report_files import report_files

    found = sorted(report_files(run / "samples", "metrics.json"), key=lambda p: (p.lstat().st_mtime, str(p)))
    for path in reversed(found):
        text = _read(path, run)
        if text is None:
            continue
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            return path, {}
        flat = {k: float(v) for k, v in data.items() if isinstance(v, (int, float)) and not isinstance(v, bool)} \
            if isinstance(data, dict) else {}
        return path, flat
    return None, {}


# -- model card ------------------------------------------------------------------------------------
def model_card(*, run: Path, composed: Run, step: int, norm: dict[str, Any], ema: bool,
               dataset_info: dict[str, Any]) -> str:
    """``README.md`` of an export of the run folder ``run``, whose checkpoint ``composed`` is (its ``"export"`` run)."""
    cfg = composed.config
    base = cfg.model.pretrained or f"none (random init, preset {cfg.model.preset!r})"
    losses = final_losses(run)
    sample_file, samples = sample_metrics(run)
    root = str(cfg.data.root)
    front = ["---", "library_name: flexpack", "license: apache-2.0", "pipeline_tag: robotics",
             "tags: [flexpack, lerobot, robotics, vla, video-diffusion, wan]"]
    if cfg.model.pretrained and not Path(cfg.model.pretrained).exists() and cfg.model.pretrained.count("/") == 1:
        front.append(f"base_model: {cfg.model.pretrained}")  # a Hub id, not a local folder
    if not Path(root).exists() and root.count("/") == 1:
        front.append(f"datasets: [{root}]")
    front.append("---")
    lines = [
        *front, "", f"# {run.name}: a Wan-style video/action diffusion transformer trained with flexpack", "",
        "| | |", "|---|---|",
        f"| base model | {base} |",
        f"| data | `{root}` ({dataset_info.get('episodes', '?')} episodes, {dataset_info.get('frames', '?')} frames, "
        f"cameras {', '.join(dataset_info.get('cameras', [])) or '?'}) |",
        f"| action normalization | {norm['mode']} ({getattr(cfg.data, 'action_stats', 'pooled')} statistics): "
        f"{norm['formula']} |",
        f"| steps | {step} of {cfg.schedule.steps} ({cfg.data.mode} mode, "
        f"{cfg.data.max_tokens if cfg.data.mode == 'pack' else cfg.data.batch_size} "
        f"{'tokens' if cfg.data.mode == 'pack' else 'episodes'} per micro-batch, "
        f"{cfg.optim.accum_steps} micro-batches per step) |",
        f"| weights | {'EMA (ema/) and ' if ema else ''}final, in diffusers' WanTransformer3DModel layout "
        "+ the action stream |",
        "", "## Final losses", "",
    ]
    lines += [f"- `{k}`: {v:.5g}" for k, v in sorted(losses.items())] or ["- none logged"]
    lines += ["", "## Sample metrics", ""]
    if samples:
        lines += ([f"From `{sample_file.relative_to(run)}`:", ""]
                  + [f"- `{k}`: {v:.5g}" for k, v in sorted(samples.items())])
    else:
        lines.append("- no sampling run was recorded")
    lines += [
        "", "## Use", "", "```python",
        "import diffusers",
        "video = diffusers.WanTransformer3DModel.from_pretrained(FOLDER)   # the video transformer",
        "from flexpack.tools.export import load_export",
        "model = load_export(FOLDER)                                       # WanVA with the action stream",
        "```", "",
        f"`{POLICY_DIR}/` holds the LeRobot-style policy folder (config.json, model.safetensors, and the "
        "normalization as LeRobot processor pipelines); `normalization.json` says how to invert the action "
        "normalization.", "",
        "## Training config", "", "```json", json.dumps(cfg.to_dict(), indent=2, default=str), "```", "",
    ]
    return "\n".join(lines)


# -- LeRobot statistics --------------------------------------------------------------------------
def stats_tensors(stats: ActionStats, pooled: dict[str, Any], keys: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Per feature: LeRobot's stat names as float32 tensors; the action's q01/q99 (or mean/std) are the
    checkpoint's, the rest the pooled statistics."""
    out: dict[str, dict[str, torch.Tensor]] = {}
    for key in keys:
        out[key] = {k: torch.tensor(v, dtype=torch.float32) for k, v in (pooled.get(key) or {}).items()
                    if isinstance(v, list)}
    low, high = torch.tensor(stats.low), torch.tensor(stats.high)
    if stats.mode == "quantile":
        out.setdefault("action", {}).update(q01=low, q99=high)
    elif stats.mode == "meanstd":
        out.setdefault("action", {}).update(mean=low, std=high)
    return {k: {n: t.float() for n, t in v.items()} for k, v in out.items()}


# -- the Hub ---------------------------------------------------------------------------------------
def push_to_hub(folder: str | Path, repo_id: str, *, private: bool = False, api: Any = None,
                commit_message: str | None = None) -> str:
    """Upload an exported folder to ``repo_id`` (created if missing); returns the commit's URL or id."""
    if api is None:
        try:
            from huggingface_hub import HfApi
        except ImportError as exc:
            raise ImportError("--push-to-hub needs huggingface_hub: pip install 'flexpack[hub]'") from exc
        api = HfApi()
    folder = Path(folder)
    api.create_repo(repo_id=repo_id, repo_type="model", private=private, exist_ok=True)
    info = api.upload_folder(folder_path=str(folder), repo_id=repo_id, repo_type="model",
                             commit_message=commit_message or f"flexpack export of {folder.name}")
    return str(getattr(info, "commit_url", None) or info)


_MOVED = ("POLICY_TYPE", "write_extras", "write_policy_folder")  # to flexpack.families.wan.export_policy


def __getattr__(name: str) -> Any:
    if name not in _MOVED:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib
    import warnings

    warnings.warn(f"flexpack.tools.export_extras.{name} is deprecated: it moved to "
                  "flexpack.families.wan.export_policy; import it from there (the old path goes in flexpack 0.3)",
                  DeprecationWarning, stacklevel=2)
    return getattr(importlib.import_module("flexpack.families.wan.export_policy"), name)
