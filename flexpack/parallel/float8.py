"""``parallel.float8``: float8 (e4m3) matmuls for the transformer blocks' linear layers, through
torchao's float8 training (``convert_to_float8_training``; the optional extra ``flexpack[float8]``).

- ``"off"``: bf16/fp32 as configured. ``"tensorwise"``: one dynamic scale per tensor (the fastest
  cast; under FSDP2 the weights are all-gathered in float8, half the bytes of bf16).
  ``"rowwise"``: one scale per row of each operand (closer to bf16 numerically, a little slower).
- Which layers: the ``nn.Linear`` modules inside the model's blocks (its family's ``blocks``; self-attention q/k/v/o,
  cross-attention q/o, FFN) whose in and out features are both multiples of 16 (``torch._scaled_mm``
  needs them) and at least :data:`MIN_DIM`. Not converted: embeddings, the time MLP and the heads
  (outside the blocks: their M is a few rows or a few thousand tokens once per step, they are
  a sliver of the FLOPs and the most precision-sensitive layers), and the cross-attention k/v
  projections, whose M is the pack's text tokens (512 per episode, a few thousand per pack):
  there the dynamic-scale casts of input, weight and gradient cost about what the float8 GEMM saves.
- Order (as torchtitan's): convert → compile → activation checkpointing → FSDP2, in
  :func:`flexpack.parallel.parallelize.parallelize`. A LoRA model (``lora.rank``, :mod:`flexpack.run.lora`) gets its
  adapters first: float8 converts each adapted layer's frozen ``base_layer`` under the rules above (by the layer's
  name), never the adapters (``lora_A`` / ``lora_B``).
- State dicts stay in the model's dtype: ``Float8Linear`` keeps its ``weight``/``bias`` parameters
  (same names, same dtype); the float8 copies are made in each forward. Checkpoints and exports do
  not know float8 was on, and a run can switch it on or off on resume.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch import nn

from flexpack.errors import UserError
from flexpack.parallel.blocks import Blocks, block_path

MODES = ("off", "tensorwise", "rowwise")
MIN_DIM = 1024  # below this K or N the casts (amax + scale + cast, per forward and backward) outweigh the GEMM gain
SKIP = ("cross_attn.k", "cross_attn.v")  # M = the pack's text tokens: too few rows to pay (module docstring)


def check_mode(mode: Any) -> None:
    if mode not in MODES:
        raise ValueError(f"parallel.float8 must be one of {MODES}, got {mode!r}")


def check(mode: str, device: torch.device) -> None:
    """At the start of a run: torchao importable and an sm89+ GPU (Ada, Hopper, Blackwell), or one
    line saying what is missing."""
    if mode == "off":
        return
    if device.type != "cuda":
        raise UserError(f"parallel.float8 = {mode!r} needs an NVIDIA GPU of compute capability 8.9 or newer "
                        f"(float8 matmuls); this run is on {device.type}; set parallel.float8 = 'off'")
    cap = torch.cuda.get_device_capability(device)
    if cap < (8, 9):
        raise UserError(f"parallel.float8 = {mode!r} needs compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
                        f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}; set parallel.float8 = 'off'")
    _torchao()


def _torchao() -> Any:
    try:
        import torchao.float8 as f8
    except ImportError as exc:
        raise UserError("parallel.float8 needs torchao: pip install 'flexpack[float8]' (or torchao matching "
                        f"torch {torch.__version__.split('+')[0]}); set parallel.float8 = 'off' to train without it "
                        f"({exc})") from None
    return f8


def check_tokens(mode: str, data: Any, geometry: Any, device: torch.device) -> None:
    """Float8 training on a GPU needs every micro-batch's token count to be a multiple of 16: the
    weight gradient's float8 GEMM reduces over the tokens, and ``torch._scaled_mm`` takes inner
    dimensions that are multiples of 16 only. A pack holds ``frame budget × tokens per frame × copies``
    tokens, a padded row a multiple of ``data.pad_multiple`` frames of them; one line names the setting
    to change and a value that works (``data``: the config's data section; ``geometry``: the run's).
    Emulated float8 (CPU) has no such rule."""
    if mode == "off" or device.type != "cuda":
        return
    unit = geometry.tokens_per_frame * geometry.copies  # tokens of one latent frame, every copy
    step = 16 // math.gcd(unit, 16)  # frames that make a multiple of 16 tokens
    if data.mode == "pack":
        budget = geometry.frame_budget
        if budget % step:
            good = max(budget // step, 1) * step * geometry.tokens_per_frame
            raise UserError(f"parallel.float8 = {mode!r} needs packs of a multiple of 16 tokens, but data.max_tokens = "
                            f"{data.max_tokens} packs {budget} frames x {unit} tokens = {budget * unit}; set "
                            f"data.max_tokens = {good} (a multiple of {step} frames)")
    elif data.pad_multiple % step:
        good = math.lcm(data.pad_multiple, step)
        raise UserError(f"parallel.float8 = {mode!r} needs rows of a multiple of 16 tokens, but data.pad_multiple = "
                        f"{data.pad_multiple} frames x {unit} tokens per frame is not; set data.pad_multiple = {good}")


def layer_filter(module: nn.Module, fqn: str, *, min_dim: int | None = None, within: str = "blocks") -> bool:
    """Whether the linear layer at ``fqn`` (a name inside the model) gets float8 matmuls; ``within``: the dotted
    name of the blocks' container (:func:`flexpack.parallel.blocks.block_path`)."""
    min_dim = MIN_DIM if min_dim is None else min_dim
    if not isinstance(module, nn.Linear) or ".lora_A." in fqn or ".lora_B." in fqn:
        return False  # LoRA adapters (flexpack.run.lora) stay in high precision: rank-r matmuls gain nothing
    fqn = fqn.removesuffix(".base_layer")  # a LoRA layer's frozen base: judged by the layer's own name
    if not (fqn.startswith(within + ".") or f".{within}." in fqn):
        return False
    if any(fqn.endswith(s) for s in SKIP):
        return False
    k, n = module.in_features, module.out_features
    return k % 16 == 0 and n % 16 == 0 and min(k, n) >= min_dim


def convert(model: nn.Module, mode: str, *, fsdp: bool = False, emulate: bool = False,
            min_dim: int | None = None, name_of: Callable[[str], str] | None = None, blocks: Blocks = "blocks"
            ) -> list[str]:
    """Swap the blocks' qualifying ``nn.Linear`` layers for torchao ``Float8Linear`` in place;
    returns their names. ``fsdp``: float8 all-gather of the weights (tensorwise only: torchao has it
    for dynamic tensorwise scales). ``emulate``: float8 numerics without float8 kernels (tests on CPU).
    ``name_of``: the WanVA name :func:`layer_filter` judges for a module's name in ``model``, so that
    another implementation of the model (diffusers' Wan, through its WanVA names) gets the same
    layers converted. ``blocks``: where the model keeps its blocks (:mod:`flexpack.parallel.blocks`)."""
    check_mode(mode)
    if mode == "off":
        return []
    f8 = _torchao()
    config = f8.Float8LinearConfig.from_recipe_name(mode)
    if fsdp and mode == "tensorwise":
        config = f8.Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=emulate)
    elif emulate:
        import dataclasses

        config = dataclasses.replace(config, emulate=True)
    names: list[str] = []
    within = block_path(model, blocks)

    def keep(module: nn.Module, fqn: str) -> bool:
        ok = layer_filter(module, name_of(fqn) if name_of else fqn, min_dim=min_dim, within=within)
        if ok:
            names.append(fqn)
        return ok

    f8.convert_to_float8_training(model, module_filter_fn=keep, config=config)
    model.float8_all_gather = bool(fsdp and mode == "tensorwise")
    return names


def after_optimizer_step(model: nn.Module) -> None:
    """Under FSDP2 with float8 all-gather: compute every float8 weight's scale in one fused amax
    over the shards (instead of one all-reduce per layer in the next forward)."""
    if getattr(model, "float8_all_gather", False):
        _torchao().precompute_float8_dynamic_scale_for_fsdp(model)


def converted(model: nn.Module) -> list[str]:
    """Names of the model's float8 linear layers."""
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        return []
    return [n for n, m in model.named_modules() if isinstance(m, Float8Linear)]
