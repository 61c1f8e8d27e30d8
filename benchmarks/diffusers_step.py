"""diffusers' ``WanTransformer3DModel`` trained one episode per step: ``train_step.py``'s ``diffusers-*`` variants.

``diffusers-compiled``: ``torch.compile(model, dynamic=True)``; ``diffusers-regional``: diffusers' own recipe
(``compile_repeated_blocks``, dynamic shapes); ``diffusers-eager``. ``diffusers-float8-{compiled,regional,eager}``:
the same after torchao's float8 training conversion (``convert_to_float8_training``, tensorwise) of the
layers flexpack converts in its own blocks: :func:`convert_float8` judges every diffusers module by its
flexpack name (:func:`flexpack.families.wan.convert.rename`) with :func:`flexpack.parallel.float8.layer_filter`,
so both sides run float8 GEMMs in the same layers (self-attention q/k/v/o, cross-attention q/o, the FFN;
not the cross-attention k/v, embeddings, time MLP or head). A float8 step needs an sm89+ GPU.

Same shape as the flexpack variants (the config's Wan2.2-5B preset at ``--layers``), fp32 weights with bf16
autocast, fused AdamW, grad clip 1.0, the same episodes as the packed variants' timed packs.
"""

from __future__ import annotations

import statistics

import numpy as np
import torch
from torch import nn

from flexpack.parallel import float8
from flexpack.run.resolve import model_config_of
from flexpack.run.root import geometry_for
from flexpack.training.observe.flops import useful_flops
from train_step import _event_times, _host_and_wall, _medians, _peak_gb, _peak_reset, _sync, config

COMPILES = {"compiled": "whole", "regional": "regional", "eager": False}


def variant(name: str) -> tuple[str, str | bool]:
    """(parallel.float8 mode, compile) of a ``diffusers-*`` variant name: ``diffusers-float8-compiled`` ->
    ``("tensorwise", "whole")``; ``ValueError`` for a name that is none of them."""
    parts = name.split("-")
    f8 = len(parts) == 3 and parts[1] == "float8"
    if parts[0] != "diffusers" or len(parts) != 2 + f8 or parts[-1] not in COMPILES:
        raise ValueError(f"{name!r} is not a diffusers variant (diffusers-[float8-]compiled|regional|eager)")
    return ("tensorwise" if f8 else "off"), COMPILES[parts[-1]]


def flexpack_name(fqn: str) -> str:
    """A diffusers module's name as flexpack's WanVA names the same layer (itself where there is none)."""
    from flexpack.families.wan.convert import rename

    got = rename(fqn + ".weight")
    return got.removesuffix(".weight") if got else fqn


def convert_float8(model: nn.Module, mode: str, *, emulate: bool = False, min_dim: int | None = None) -> list[str]:
    """torchao float8 training for the linears of diffusers' Wan that flexpack converts in its own blocks;
    returns their (diffusers) names. ``emulate``/``min_dim``: as :func:`flexpack.parallel.float8.convert`."""
    return float8.convert(model, mode, emulate=emulate, min_dim=min_dim, name_of=flexpack_name)


def run_diffusers(args, name: str, lengths: list[int], batches: list[list[int]], items, device: torch.device,
                  peak: float) -> dict:
    import diffusers

    mode, compile_ = variant(name)
    train_cfg = config(args, "pack", False)
    cfg = model_config_of(train_cfg)
    geometry = geometry_for(cfg, items.shape[1:], train_cfg)  # the flexpack variants' tokens per frame
    torch.manual_seed(0)
    with device:
        model = diffusers.WanTransformer3DModel(
            patch_size=cfg.patch_size, num_attention_heads=cfg.num_heads, attention_head_dim=cfg.head_dim,
            in_channels=cfg.in_channels, out_channels=cfg.out_dim, text_dim=cfg.text_dim, freq_dim=cfg.freq_dim,
            ffn_dim=cfg.ffn_dim, num_layers=cfg.num_layers, cross_attn_norm=cfg.cross_attn_norm,
            qk_norm="rms_norm_across_heads", eps=cfg.eps, rope_max_seq_len=1024)
    model.train()
    converted = convert_float8(model, mode, emulate=device.type != "cuda") if mode != "off" else []
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, betas=(0.9, 0.95), weight_decay=0.01,
                            fused=device.type == "cuda")
    fwd = model
    # each variant of each set compiles a new model with the same forward code: past dynamo's default limit of 8
    # entries per code object it would fall back to eager silently
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    if compile_ == "whole":  # after the float8 conversion, as flexpack compiles its converted blocks
        fwd = torch.compile(model, dynamic=True)
    elif compile_ == "regional":  # diffusers' own recipe: each repeated block, dynamic shapes
        model.compile_repeated_blocks(fullgraph=True, dynamic=True)
    tpf = geometry.tokens_per_frame

    inputs: dict[int, tuple] = {}

    def load(i: int) -> tuple:  # made before timing, as the packs are collated before timing
        if i not in inputs:
            it = items[i]
            inputs[i] = (it["latent"][None].to(device).float(), it["text"][None].to(device))
        return inputs[i]

    def step(i: int) -> torch.Tensor:
        x, text = load(i)
        noise = torch.randn_like(x)
        sigma = torch.rand((), device=device)
        x_t = (1 - sigma) * x + sigma * noise
        with torch.autocast(device.type, torch.bfloat16):
            pred = fwd(hidden_states=x_t, timestep=(sigma * 1000)[None], encoder_hidden_states=text,
                       return_dict=False)[0]
        loss = (pred.float() - (noise - x)).square().mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    # warm-up: several different lengths (a dynamic-shape compile settles after the second shape)
    warm_eps = sorted({i for b in batches[: args.warmup] for i in b}, key=lambda i: lengths[i])
    for i in warm_eps[:: max(1, len(warm_eps) // 6)]:
        step(i)
    _sync(device)
    graphs0 = _dynamo_graphs()
    _peak_reset(device)
    timed = batches[args.warmup:]
    for b in timed:
        for i in b:
            load(i)
    # pass 1, as flexpack's: every timed episode once, a sync around each step. It gives the host
    # time to queue one episode step, and it is the first step at each episode length: PyTorch
    # builds per-shape state then (attention plans, kernel specializations), which a training run
    # pays once per length; the timed pass 2 runs on warm lengths, as flexpack's pass 2 does.
    first = [[_host_and_wall(lambda: step(i), device) for i in b] for b in timed]  # (host, wall) per episode
    first_host = [h for pack in first for h, _ in pack]
    first_wall = [sum(w for _, w in pack) for pack in first]
    host = [_host_and_wall(lambda: step(i), device)[0] for i in timed[0][:3]]  # at warm lengths
    # the same episodes as the timed packs, one optimizer step each, queued without syncs
    times, losses = _event_times(lambda k: [step(i) for i in timed[k]], len(timed), device)
    losses = [float(x) for group in losses for x in group]
    tokens = [sum(lengths[i] for i in b) * tpf for b in timed]
    flops = [useful_flops(cfg, [lengths[i] for i in b], items.L, video_tokens=geometry.video_tokens,
                          action_tokens=geometry.action_tokens, copies=geometry.copies) for b in timed]
    out = _medians(times, host, tokens, flops, peak)
    out.update(first_pass_tokens_per_s=statistics.median(n / t for n, t in zip(tokens, first_wall)),
               first_pass_host_ms=1e3 * statistics.median(first_host),
               peak_mem_gb=_peak_gb(device), finite=all(np.isfinite(losses)), episodes=sum(len(b) for b in timed),
               recompiles_after_warmup=_dynamo_graphs() - graphs0, compile=compile_ or "eager", float8=mode,
               float8_layers=len(converted))
    return out


def _dynamo_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])
