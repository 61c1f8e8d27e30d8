"""``flexpack export RUN OUT``: a run's newest checkpoint as a folder the ecosystem loads, in a format its
model family can be written in: ``diffusers`` (WanVA: a diffusers folder plus the action stream), ``lerobot``
(lingbot-va: a LeRobot ``lingbot_va`` policy folder) or ``lingbot-upstream`` (lingbot-va: upstream LingBot-VA's
``transformer/`` folder) (:func:`flexpack.tools.export.export_run`). A LoRA run exports its adapters merged into the
weights (the names of a run without LoRA); ``--adapter DIR`` also writes them alone as a peft adapter folder."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from flexpack.commands.common import add_set


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("run", type=Path, help="a run folder (runtime.out_dir of flexpack train: its newest intact "
                        "checkpoint) or a checkpoint folder")
    parser.add_argument("out", type=Path, help="new or empty folder to write")
    parser.add_argument("--format", dest="fmt", default=None, metavar="FORMAT",
                        help="diffusers (wanva), lerobot (lingbot-va: a LeRobot lingbot_va policy folder) or "
                             "lingbot-upstream (lingbot-va: upstream LingBot-VA's transformer/ folder, "
                             "diffusers-style, with flexpack_export.json); default: the run's model family's first "
                             "format")
    parser.add_argument("--ema", action="store_true", help="also write the EMA weights (OUT/ema/, same layout)")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                        help="dtype of the exported weights")
    add_set(parser, of="the checkpoint's config", example="data.root=DATASET")
    parser.add_argument("--no-policy", action="store_true",
                        help="skip the LeRobot-style policy folder (OUT/lerobot_policy; --format diffusers)")
    parser.add_argument("--wan-pretrained-path", default=None, metavar="PATH",
                        help="--format lerobot: the policy's wan_pretrained_path, a Hub repo or local folder with "
                             "vae/, text_encoder/, tokenizer/ (default: LeRobot's, robbyant/lingbot-va-base)")
    parser.add_argument("--allow-unrunnable", action="store_true",
                        help="--format lerobot: write the policy even where LeRobot could not run it as trained "
                             "(latents or texts of the pool / hash stand-in encoders, a VAE or text encoder at "
                             "--wan-pretrained-path of another width); refused otherwise, naming why")

    parser.add_argument("--dataset", default=None, metavar="NAME",
                        help="a run on a lingbot-bundle: the bundle's dataset (its folder under the bundle root, e.g. "
                             "robotwin/a) whose cameras (frame sizes, latent grids, frame_ids stride) the export "
                             "describes, needed only where the datasets' cameras differ; the datasets of one bundle "
                             "share its action statistics (pooled over the whole bundle, or data.norm_stat). A run on "
                             "a mixture ([[data.datasets]]): the entry (its name; ENTRY/DATASET for one dataset of "
                             "its bundle) whose q01 / q99 as trained, action channels (used_action_channel_ids) and "
                             "cameras the export writes, needed where the entries differ in any of them")
    parser.add_argument("--adapter", type=Path, default=None, metavar="DIR",
                        help="a LoRA run (lora.rank > 0): also write its adapters to DIR (new or empty) as a peft "
                             "adapter folder (adapter_config.json, adapter_model.safetensors: "
                             "PeftModel.from_pretrained(base_model, DIR)); OUT gets the merged weights either way")
    parser.add_argument("--push-to-hub", metavar="REPO", default=None,
                        help="upload OUT to this Hugging Face model repo (org/name) once written")
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repo private")


def run(args: argparse.Namespace) -> int:
    from flexpack.errors import UserError, one_line

    if args.push_to_hub:
        try:
            import huggingface_hub  # noqa: F401
        except ImportError:
            raise UserError("--push-to-hub needs huggingface_hub: pip install 'flexpack[hub]'") from None
    import torch

    from flexpack.tools.export import export_run

    out = export_run(args.run, args.out, ema=args.ema, dtype=getattr(torch, args.dtype), overrides=args.overrides,
                     policy=not args.no_policy, fmt=args.fmt, wan_pretrained_path=args.wan_pretrained_path,
                     allow_unrunnable=args.allow_unrunnable, dataset=args.dataset, adapter=args.adapter)
    fmt = json.loads((out / "export.json").read_text())["format"]
    from flexpack.models.registry import family

    trained = json.loads((out / "flexpack_config.json").read_text())
    load = family(trained["model"]["family"]).exports[fmt].load
    print(f"exported {args.run} -> {out} ({fmt}; load: {load.format(out=str(out))})")
    if args.push_to_hub:
        from flexpack.tools.export_extras import push_to_hub

        try:
            where = push_to_hub(out, args.push_to_hub, private=args.private)
        except Exception as exc:  # network, auth, offline mode: the export itself is complete
            raise UserError(f"{out} is exported, but the upload to {args.push_to_hub} failed ({type(exc).__name__}: "
                            f"{one_line(exc)}); retry with: python -c \"from flexpack.tools.export_extras import "
                            f"push_to_hub; push_to_hub('{out}', '{args.push_to_hub}')\" (HF_HUB_OFFLINE unset, "
                            "logged in with hf auth login)") from exc
        print(f"pushed {out} -> {args.push_to_hub}: {where}")
    return 0
