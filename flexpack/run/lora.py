"""LoRA fine-tuning (``[lora]``, ``lora.rank > 0``) through peft: low-rank adapters on the blocks' linear layers,
every other weight frozen.

:func:`apply` injects peft's ``LoraLayer`` modules in place (``peft.inject_adapter_in_model``): the model keeps its
class and its ``forward(batch, layout, ...)``, so the packed forward, per-block ``torch.compile``, activation
checkpointing and FSDP2 wrap it as they wrap a plain model. :meth:`~flexpack.run.root.Run.build_model` applies it
after the weights load and before ``parallelize`` (float8 → compile → checkpointing → FSDP2); float8 then converts
each adapted layer's ``base_layer`` (:func:`flexpack.parallel.float8.layer_filter` judges it by the layer's own
name), never the adapters. The base weights are frozen and cast to ``lora.base_dtype``; the adapters
(``lora_A`` / ``lora_B``) stay float32 and are the only parameters with ``requires_grad``, so the only ones the
optimizer holds. Adapters start as peft's (``lora_A`` Kaiming-uniform, ``lora_B`` zero: the model starts as its
base), drawn from ``runtime.seed`` by :func:`init_adapters` on every rank alike (a sharded start equals a
single-process one).

Checkpoints hold the whole model state (base and adapters, under peft's names: ``...q.base_layer.weight``,
``...q.lora_A.default.weight``) and the optimizer state of the adapters; ``train_state.json``'s ``extra.lora``
records the options (:func:`lora_record`) and a resume with others is refused.
A command that reads a LoRA checkpoint builds the structure its record gives
(:func:`flexpack.run.state.trained.saved_lora`, then :func:`apply` with ``cast=False``), loads it and merges the
adapters into the base weights (:func:`merge`): exports and ``flexpack sample`` see a plain model with the names of a
run without LoRA. :func:`adapter_state` and :func:`write_adapter` give the adapters alone as a peft adapter folder
(``export --adapter``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from flexpack.errors import UserError

ADAPTER = "default"  # peft's adapter name inside the model
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
PEFT_PREFIX = "base_model.model."  # the key prefix of PeftModel.save_pretrained's adapter files


def _peft() -> Any:
    try:
        import peft
    except ImportError as exc:
        raise UserError(f"lora.rank > 0 needs peft: pip install 'flexpack[lora]' ({exc})") from None
    return peft


def _family(cfg: Any, family: Any) -> Any:
    """``family`` (a run's), else the registry entry of ``model.family``."""
    from flexpack.models.registry import family as registered

    return registered(cfg.model.family) if family is None else family


def targets(cfg: Any, family: Any = None) -> tuple[str, ...]:
    """``lora.targets``, or the family's default (its registry entry's ``lora_targets``)."""
    return tuple(cfg.lora.targets) or tuple(_family(cfg, family).lora_targets)


def matches(name: str, pattern: str) -> bool:
    """Whether the module ``name`` is a target of ``pattern`` as peft's ``target_modules`` list reads it: the
    name itself, or its last dotted parts."""
    return name == pattern or name.endswith(f".{pattern}")


def peft_config(cfg: Any, record: dict[str, Any] | None = None) -> Any:
    """The ``peft.LoraConfig`` of ``[lora]`` (its targets resolved), or of a checkpoint's ``record``
    (``extra.lora``: :func:`lora_record`)."""
    record = lora_record(cfg) if record is None else record
    if record is None:
        raise ValueError("no LoRA options: lora.rank is 0")
    return _peft().LoraConfig(r=record["rank"], lora_alpha=record["alpha"], lora_dropout=record["dropout"],
                              target_modules=list(record["targets"]), bias="none",
                              base_model_name_or_path=cfg.model.pretrained or None)


def lora_record(cfg: Any, family: Any = None) -> dict[str, Any] | None:
    """The LoRA options as a checkpoint records them (``extra.lora``; the targets resolved: the family's default
    where ``lora.targets`` is empty), None without LoRA. ``family``: the run's (default: ``model.family``'s)."""
    import dataclasses

    if not cfg.lora.rank:
        return None
    record = dataclasses.asdict(cfg.lora)
    record["targets"] = list(targets(cfg, family))
    return record


def check_targets(cfg: Any, model_cfg: Any, fam: Any = None) -> None:
    """Every pattern of the LoRA targets names at least one module of the model and only linear layers; else one
    line with the patterns and a few module names that exist. The model (``model_cfg``, the resolved model config,
    of family ``fam``) is built on the meta device (no weights)."""
    fam = _family(cfg, fam)
    found = targets(cfg, fam)
    if not found:
        raise ValueError(f"lora.targets is empty and model.family = {fam.name!r} has no default LoRA targets; "
                         "set lora.targets")
    with torch.device("meta"):
        model = fam.build(model_cfg)
    modules = dict(model.named_modules())
    linear = [n for n, m in modules.items() if isinstance(m, nn.Linear)]
    none = [p for p in found if not any(matches(n, p) for n in modules)]
    if none:
        first = [n for n in linear if n.startswith(f"{fam.blocks}.0.") and n.endswith((".q", ".o", ".fc1"))]
        examples = first[:5] + [n for n in linear if "." not in n][:2]
        raise ValueError(f"lora.targets {none} match no module of the {fam.name} model (patterns are module names or "
                         f"their last dotted parts, e.g. {', '.join(examples)})")
    other = sorted({f"{n} ({type(modules[n]).__name__})" for p in found for n in modules
                    if matches(n, p) and not isinstance(modules[n], nn.Linear)})
    if other:
        raise ValueError(f"lora.targets {list(found)} match modules that are not linear layers: {other[:4]}; LoRA "
                         "adapts nn.Linear only: name the linear layers inside them")


def is_adapter(name: str) -> bool:
    """Whether the parameter ``name`` is a LoRA adapter's (``lora_A`` / ``lora_B``)."""
    return ".lora_A." in name or ".lora_B." in name


def base_name(name: str) -> str:
    """A base parameter's name in the model without LoRA (``...q.base_layer.weight`` -> ``...q.weight``)."""
    return name.replace(".base_layer.", ".")


def lora_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every peft LoRA layer of ``model``, in module order (none where peft is not installed)."""
    try:
        from peft.tuners.lora import LoraLayer
    except ImportError:
        return []

    return [(n, m) for n, m in model.named_modules() if isinstance(m, LoraLayer)]


def apply(model: nn.Module, cfg: Any, *, record: dict[str, Any] | None = None,
          cast: bool = True) -> nn.Module:
    """``model`` with LoRA adapters injected in place (see the module docstring), of ``[lora]`` or of a checkpoint's
    ``record``; returns it. ``cast``: freeze the base, cast it to ``lora.base_dtype``, adapters float32 and drawn from
    ``runtime.seed`` (a model on the meta device gets them drawn after it is filled: :func:`init_adapters`); without
    ``cast`` only the structure (a checkpoint is loaded into it next)."""
    peft = _peft()
    peft.inject_adapter_in_model(peft_config(cfg, record), model, adapter_name=ADAPTER)
    if not cast:
        return model
    dtype = getattr(torch, (record or {}).get("base_dtype", cfg.lora.base_dtype))
    for name, p in model.named_parameters():
        p.requires_grad_(is_adapter(name))
        p.data = p.data.to(torch.float32 if is_adapter(name) else dtype)
    if not any(p.is_meta for p in model.parameters()):
        init_adapters(model, cfg.runtime.seed)
    return model


@torch.no_grad()
def init_adapters(model: nn.Module, seed: int) -> None:
    """peft's default start of every adapter, drawn on the CPU from ``seed`` in module order so that every rank and
    a single process draw the same: ``lora_A`` uniform in ±1/sqrt(in_features) (Kaiming-uniform with a = sqrt(5),
    as ``nn.Linear``), ``lora_B`` zero. Sharded (DTensor) adapters get their slices."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    g = torch.Generator().manual_seed(seed)
    for _, layer in lora_layers(model):
        a, b = layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight
        bound = 1.0 / math.sqrt(a.shape[1])
        # on the CPU by name: the model may be built under a CUDA default device, which a CPU generator refuses
        for param, full in ((a, (torch.rand(tuple(a.shape), generator=g, device="cpu") * 2 - 1) * bound),
                            (b, torch.zeros(tuple(b.shape), device="cpu"))):
            full = full.to(device=param.device, dtype=param.dtype)
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None).to_local()
                param.to_local().copy_(full)
            else:
                param.copy_(full)


@torch.no_grad()
def merge(model: nn.Module) -> nn.Module:
    """``model`` with every LoRA layer merged into its base layer (``W + alpha/r · B·A``, computed in the base
    weights' dtype: cast the model to float32 first for a float32 merge) and replaced by it; the model's state dict
    then has the names of a model without LoRA. Returns ``model``."""
    for name, layer in lora_layers(model):
        layer.merge(safe_merge=True, adapter_names=[ADAPTER])  # safe_merge: a non-finite result is refused
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer.get_base_layer())
    if hasattr(model, "peft_config"):
        del model.peft_config
    return model


@dataclass(frozen=True)
class Adapters:
    """A LoRA model's adapters as an adapter folder holds them: their ``peft.LoraConfig`` and :func:`adapter_state`."""

    config: Any
    state: dict[str, torch.Tensor]


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' weights as a peft adapter file holds them (``PeftModel.save_pretrained``'s names:
    ``base_model.model.<module>.lora_A.weight``), full float32 CPU tensors."""
    from peft import get_peft_model_state_dict

    state = get_peft_model_state_dict(model, adapter_name=ADAPTER)
    return {PEFT_PREFIX + k: v.detach().float().cpu().contiguous() for k, v in state.items()}


def write_adapter(folder: Path, state: dict[str, torch.Tensor], config: Any) -> None:
    """A peft adapter folder (``adapter_config.json`` + ``adapter_model.safetensors``) of the adapters ``state``
    (:func:`adapter_state`) and their ``peft.LoraConfig`` (:func:`peft_config`):
    ``PeftModel.from_pretrained(base, folder)`` puts them on a base model of the run's family."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(str(folder))
    save_file(state, str(folder / ADAPTER_FILES[1]), metadata={"format": "pt"})
