"""Upstream LingBot-VA's own training step (``wan_va/train.py`` of https://github.com/robbyant/lingbot-va),
imported from a checkout given at run time, never copied here: what ``benchmarks/lingbot_bundle.py`` times as
"the recipe as users run it".

What is upstream's and what is ours:

* upstream's: ``WanTransformer3DModel`` (``modules/model.py``, ``attn_mode="flex"``: its compiled
  ``flex_attention`` and ``create_block_mask`` over the whole sequence every micro-step), ``apply_ac`` (every block
  checkpoint-wrapped), ``_configure_model`` (its single-process branch: the model cast to the config's
  ``param_dtype``, bf16), ``FlowMatchScheduler``, ``warmup_constant_lambda`` and ``Trainer._train_step`` with the
  ``_prepare_input_dict`` / ``_add_noise`` / ``compute_loss`` it calls (noise, grid ids, chunk size and window
  drawn per micro-step, the loss over 1 / gradient_accumulation_steps, clip 2.0, fused AdamW, LambdaLR); the
  hyper-parameters of its ``robotwin_train`` config.
* ours: the Trainer is made with ``Trainer.__new__`` and given the attributes its ``__init__`` would set (its
  ``__init__`` loads pretrained weights from disk, wraps FSDP2 and builds its LeRobot-0.3 data loader); the model
  is randomly initialised on the device; ``set_requires_gradient_sync`` (FSDP2's, which ``_train_step`` calls) is a
  no-op on the unsharded single-GPU model; each micro-step's batch is a ``BundleDataset`` item in the dict
  upstream's loader yields (:func:`upstream_batch`).
* stubs in ``sys.modules`` for imports unused on this path (:data:`ALWAYS_STUBBED`, and :data:`STUB_IF_MISSING`
  where not installed), listed in the results JSON.
* on the CPU only (``--smoke``): FlexAttention has no CPU backward, so upstream's ``FlexAttnFunc.flex_attn`` becomes
  SDPA over the dense mask of the same block mask (:func:`dense_flex`) and its compiled ``create_block_mask`` the
  eager one.
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import subprocess
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

# upstream's own data loader (LeRobot 0.3.3 internals and scipy) and its inference server (websockets): replaced
# by BundleDataset items and unused in training
ALWAYS_STUBBED = {"dataset": {"MultiLatentLeRobotDataset": None}, "utils.sever_utils": {"run_async_server_mode": None}}
# imported at module level, unused with attn_mode="flex" and enable_wandb off
STUB_IF_MISSING = {"flash_attn": {"flash_attn_func": None}, "wandb": {}}
CONFIG = "robotwin_train"  # upstream's config of the RoboTwin post-training recipe
MODEL_KEYS = ("patch_size", "num_attention_heads", "attention_head_dim", "in_channels", "out_channels", "action_dim",
              "text_dim", "freq_dim", "ffn_dim", "num_layers", "cross_attn_norm", "eps", "rope_max_seq_len")


@dataclass
class Upstream:
    """The imported upstream modules and what was stubbed to import them."""

    root: Path  # the folder holding train.py
    commit: str
    train: Any
    model: Any  # modules.model
    config: Any  # VA_CONFIGS[CONFIG]
    stubbed: list[str] = field(default_factory=list)


def _stub(name: str, attrs: dict[str, Any]) -> None:
    mod = types.ModuleType(name)
    mod.__spec__ = importlib.machinery.ModuleSpec(name, None)  # diffusers probes find_spec of what it may use
    mod.__dict__.update(attrs)
    sys.modules[name] = mod


def _missing(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is None
    except (ImportError, ValueError):  # a broken or half-installed package counts as missing
        return True


def _commit(root: Path) -> str:
    for base in (root, root.parent):
        if (base / "UPSTREAM_COMMIT").is_file():
            return (base / "UPSTREAM_COMMIT").read_text().strip()
    try:
        return subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def load(checkout: str | Path) -> Upstream:
    """Import upstream's ``train`` module (and what it imports) from ``checkout`` (the repository root or its
    ``wan_va`` folder) as its ``train.py`` runs: with ``wan_va`` on ``sys.path``."""
    root = Path(checkout).resolve()
    if (root / "wan_va" / "train.py").is_file():
        root = root / "wan_va"
    if not (root / "train.py").is_file():
        raise ValueError(f"--upstream {checkout}: no wan_va/train.py there (a checkout of robbyant/lingbot-va)")
    stubbed = []
    for name, attrs in ALWAYS_STUBBED.items():
        _stub(name, attrs)
        stubbed.append(name)
    for name, attrs in STUB_IF_MISSING.items():
        if _missing(name):
            _stub(name, attrs)
            stubbed.append(name)
    sys.path.insert(0, str(root))
    train = importlib.import_module("train")
    if not str(Path(train.__file__).resolve()).startswith(str(root)):
        raise ValueError(f"imported {train.__file__} as upstream's train.py, not the one under {root}")
    model = importlib.import_module("modules.model")
    config = importlib.import_module("configs").VA_CONFIGS[CONFIG]
    return Upstream(root=root, commit=_commit(root), train=train, model=model, config=config, stubbed=stubbed)


def dense_flex(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_mask: Any = None,
               **_kernel_options: Any) -> torch.Tensor:
    """``flex_attention`` on the CPU with a backward: SDPA over ``block_mask``'s dense mask; a query that may attend
    no key (upstream's padding rows) gets zeros, as FlexAttention gives it."""
    from torch.nn.attention.flex_attention import create_mask

    Q, K = query.shape[-2], key.shape[-2]
    mask = create_mask(block_mask.mask_mod, 1, 1, Q, K, device=query.device)
    some = mask.any(-1, keepdim=True)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask | ~some)
    return out * some.to(out.dtype)


def use_cpu_attention(up: Upstream) -> None:
    """Upstream's attention made runnable with a backward on the CPU (see the module docstring)."""
    from torch.nn.attention.flex_attention import create_block_mask

    fa = up.model.FlexAttnFunc
    fa.flex_attn = staticmethod(dense_flex)
    fa.compiled_create_block_mask = staticmethod(lambda *a, _compile=None, **k: create_block_mask(*a, **k))


def upstream_batch(item: dict) -> dict:
    """A ``BundleDataset`` item as upstream's DataLoader yields it at batch 1: ``latents`` (1, C, F, H, W) and
    ``text_emb`` (1, L, Dt) in bf16 (the dtype of the ``.pth`` files), ``actions`` (1, Ca, F, A, 1) float32 and
    ``actions_mask`` bool."""
    return {"latents": item["latent"][None].to(torch.bfloat16, copy=True),  # copies: _add_noise works in place
            "actions": item["action"][None, ..., None].to(torch.float32, copy=True),
            "actions_mask": item["action_mask"][None, ..., None].to(torch.bool, copy=True),
            "text_emb": item["text"][None].to(torch.bfloat16, copy=True)}


class Recipe:
    """Upstream's ``Trainer`` as its ``train()`` drives it, minus data loading: :meth:`optimizer_step` runs
    ``_train_step`` over one optimizer step's micro-batches (``gradient_accumulation_steps`` = their count)."""

    def __init__(self, up: Upstream, model_config: Any, accumulation: int, device: torch.device) -> None:
        cfg, tr = up.config, up.train
        kw = {k: getattr(model_config, k) for k in MODEL_KEYS}
        kw["patch_size"] = list(kw["patch_size"])
        with device:  # random init where it trains (upstream loads fp32 weights on the host, then casts and moves)
            model = up.model.WanTransformer3DModel(**kw, attn_mode="flex")
        tr.apply_ac(model)
        model = tr._configure_model(model=model, shard_fn=tr.shard_model, param_dtype=cfg.param_dtype, device=device,
                                    eval_mode=False)
        model.train()
        model.requires_grad_(True)
        model.set_requires_gradient_sync = lambda requires_gradient_sync: None  # FSDP2's; no FSDP on one GPU
        t = tr.Trainer.__new__(tr.Trainer)
        t.config, t.device, t.dtype, t.patch_size, t.step = cfg, device, cfg.param_dtype, cfg.patch_size, 0
        t.transformer = model
        params = [p for p in model.parameters() if p.requires_grad]
        t.optimizer = torch.optim.AdamW(params, lr=cfg.learning_rate, betas=(cfg.beta1, cfg.beta2), eps=1e-8,
                                        weight_decay=cfg.weight_decay, fused=True, foreach=False)
        t.lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
            t.optimizer, lr_lambda=lambda step: tr.warmup_constant_lambda(step, warmup_steps=cfg.warmup_steps))
        t.train_scheduler_latent = tr.FlowMatchScheduler(shift=cfg.snr_shift, sigma_min=0.0, extra_one_step=True)
        t.train_scheduler_latent.set_timesteps(1000, training=True)
        t.train_scheduler_action = tr.FlowMatchScheduler(shift=cfg.action_snr_shift, sigma_min=0.0,
                                                         extra_one_step=True)
        t.train_scheduler_action.set_timesteps(1000, training=True)
        t.gradient_accumulation_steps = accumulation
        self.trainer, self.model, self.params = t, model, sum(p.numel() for p in params)
        self.drawn: list[tuple[int, int]] = []  # (chunk_size, window_size) of every micro-step, in order
        prepare = t._prepare_input_dict

        def recorded(batch_dict):  # upstream's own, noting the chunk size and window it drew
            out = prepare(batch_dict)
            self.drawn.append((int(out["chunk_size"]), int(out["window_size"])))
            return out

        t._prepare_input_dict = recorded

    def optimizer_step(self, batches: list[dict]) -> torch.Tensor:
        """``_train_step`` on each micro-batch (a copy: it moves the values to the device in place); returns the
        step's loss (latent + action, each already over the accumulation count) as a device tensor."""
        if len(batches) != self.trainer.gradient_accumulation_steps:
            raise ValueError(f"{len(batches)} micro-batches for gradient_accumulation_steps "
                             f"{self.trainer.gradient_accumulation_steps}")
        total = None
        for idx, batch in enumerate(batches):
            losses = self.trainer._train_step(dict(batch), idx)
            part = losses["latent_loss"] + losses["action_loss"]
            total = part if total is None else total + part
        assert losses["should_log"], "the last micro-batch must step the optimizer"  # internal invariant
        return total
