"""``flexpack export RUN OUT --format lerobot``: a lingbot-va run as a LeRobot ``lingbot_va`` policy folder.

``OUT`` is what LeRobot's ``LingBotVAPolicy.save_pretrained`` and its processors write, so
``LingBotVAPolicy.from_pretrained(OUT)`` loads it with no missing or unexpected key and ``make_policy`` /
``make_pre_post_processors`` (lerobot's factory) run it::

    config.json                  LeRobot's LingBotVAConfig, written by lerobot's own encoder: the transformer's shape,
                                 the run's training and inference fields (LingbotConfig.lerobot_fields), attn_mode
                                 "torch" (inference), obs_cam_keys (the cameras the latents joined on width, in that
                                 order), height / width (their frames), wan_pretrained_path, the cameras as VISUAL
                                 input features and the action (its dataset columns) as the output feature;
                                 device null (LeRobot picks where it loads)
    model.safetensors            the transformer, transformer.* keys (lingbot_convert.to_lerobot_state_dict)
    policy_preprocessor.json     make_lingbot_va_pre_post_processors' pipelines (their save_pretrained),
    policy_postprocessor.json    whose QUANTILES statistics (q01 / q99 of the dataset's action columns, with their
    + *.safetensors              state files) are those the checkpoint was trained with (data.action_stats: pooled by
                                 default)
    normalization.json           the same statistics as flexpack writes them (flexpack sample OUT reads them)
    ema/                         with --ema: the same policy folder holding the EMA weights

What LeRobot's policy cannot represent is refused in one line before anything is written (:func:`check_config`
before the weights are read, :func:`policy_layout` against the dataset): latents of other than 48 channels (its
sampler draws 48), a noise grid of other than 1000 steps, another temporal stride than the Wan VAE's 4 video
frames per latent frame or another count of action steps per latent frame (its ``select_action`` runs one
action per video frame), actions the run did not normalize with q01 / q99 or whose columns are not the used
channels, cameras of different frame sizes or
sizes off the VAE's 16-pixel grid, a latent cache whose grid is not the cameras' frames / 16, and any
LingbotConfig field LeRobot's config has no place for. The fields of LeRobot's trainer that its config lacks
(``noisy_cond_prob``, ``chunk_range``, ``window_range``) and how flexpack runs (``attn_backend``,
``activation_checkpointing``) shape no inference and stay in ``flexpack_config.json``.

A run on a lingbot-bundle takes its cameras, their composition (``camera_layout`` ``"robotwin_tshape"`` for
upstream's T), frames, statistics and the action steps a latent frame from the bundle instead
(:mod:`flexpack.families.lingbot.export_bundle`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from flexpack.data.formats import is_bundle

if TYPE_CHECKING:
    from flexpack.data.normalization import ActionStats
    from flexpack.run.root import Run

# LingbotConfig fields with no LeRobot counterpart that inference never reads: LeRobot's trainer fixes them as
# constants (noisy_cond_prob 0.5, chunk 1..4, window 4..64), and how flexpack runs the model
TRAINING_ONLY = ("noisy_cond_prob", "chunk_range", "window_range", "attn_backend", "activation_checkpointing")
FIXED = {"num_train_timesteps": 1000, "in_channels": 48, "out_channels": 48}  # what LeRobot's sampler assumes
WHY = {"num_train_timesteps": "its schedulers scale timesteps by 1000",
       "in_channels": "its sampler draws 48-channel latents (the Wan2.2 VAE's)",
       "out_channels": "its sampler draws 48-channel latents (the Wan2.2 VAE's)"}
VAE_STRIDE, VAE_PIXELS = 4, 16  # the Wan2.2 VAE: video frames per latent frame, pixels per latent cell


def check_config(run: Run, options: Any = None) -> None:
    """One line for a lingbot-va config LeRobot's ``lingbot_va`` policy cannot represent (the module docstring)."""
    from lerobot.policies.lingbot_va.configuration_lingbot_va import LingBotVAConfig

    model_cfg = run.model_config
    theirs = {f.name for f in dataclasses.fields(LingBotVAConfig)}
    for f in dataclasses.fields(model_cfg):
        if f.name in FIXED:
            if getattr(model_cfg, f.name) != FIXED[f.name]:
                raise ValueError(f"--format lerobot: {f.name} = {getattr(model_cfg, f.name)!r}, but LeRobot's "
                                 f"lingbot_va policy needs {FIXED[f.name]} ({WHY[f.name]})")
        elif f.name not in theirs and f.name not in TRAINING_ONLY:
            raise ValueError(f"--format lerobot: LeRobot's lingbot_va config has no field {f.name!r} "
                             f"(= {getattr(model_cfg, f.name)!r} here); this model cannot be written as a LeRobot "
                             "policy")
    if is_bundle(run.config.data):  # its frame_ids stride, not data.stride, says how it was encoded (export_bundle)
        from flexpack.families.lingbot.export_bundle import check_steps

        check_steps(run, getattr(options, "dataset", None))
    elif run.config.data.stride != VAE_STRIDE or model_cfg.action_per_frame != VAE_STRIDE:
        raise ValueError(f"--format lerobot: data.stride = {run.config.data.stride} video frames and "
                         f"action_per_frame = "
                         f"{model_cfg.action_per_frame} action steps per latent frame, but LeRobot's lingbot_va policy "
                         f"encodes {VAE_STRIDE} video frames per latent frame and runs one action per video frame")
    if not run.config.data.normalize:
        raise ValueError("--format lerobot: data.normalize = false, but LeRobot's lingbot_va postprocessor maps the "
                         "policy's actions from [-1, 1] with q01 / q99 (QUANTILES); train with data.normalize = true")


def check_export(run: Run, options: Any) -> None:
    """The ``lerobot`` format's check before any weight is read: :func:`check_config`, then whether LeRobot's policy
    could run the export as trained (:func:`unrunnable`), refused in one line unless ``--allow-unrunnable``."""
    check_config(run, options)
    # a bundle's latents and texts are upstream's own Wan2.2 VAE and umT5 extractions: nothing to refuse
    if options is not None and not options.allow_unrunnable and not is_bundle(run.config.data):
        reasons = unrunnable(run, options.wan_pretrained_path)
        if reasons:
            raise ValueError("--format lerobot: LeRobot's lingbot_va policy could not run this export as it trained: "
                             f"{'; '.join(reasons)}; pass --allow-unrunnable to write it anyway")


def unrunnable(run: Run, wan_pretrained_path: str | None) -> list[str]:
    """Why LeRobot's policy, which encodes camera frames with the Wan2.2 VAE and prompts with the UMT5 encoder of
    ``wan_pretrained_path`` (None: LeRobot's default), would not see what the run trained on: latents or texts of
    flexpack's stand-in encoders (``pool``, ``hash``, ``hf:``; the latent cache records its encoder in every file's
    safetensors metadata), or a VAE or text encoder there whose width is not the model's."""
    from flexpack.data import cache

    latent_file, text_file = _cache_files(run)
    reasons = []
    try:
        latent = cache.read_latent_header(latent_file).encoder
    except (OSError, ValueError) as exc:
        raise ValueError(f"{latent_file}: the latent cache the run trained on cannot be read ({exc}); --set "
                         "data.root=DATASET (with its latents)") from None
    if not latent.startswith("wan-vae:"):
        reasons.append(f"its latents came from the {latent!r} encoder ({latent_file}), which LeRobot's policy cannot "
                       "run: it encodes camera frames with the Wan2.2 VAE of wan_pretrained_path (flexpack encode "
                       "--encoder wan-vae:PATH, then train again)")
    if text_file is not None:
        try:
            text = cache.read_text_header(text_file).encoder
        except (OSError, ValueError) as exc:
            raise ValueError(f"{text_file}: the text cache the run trained on cannot be read ({exc})") from None
        if not text.startswith("umt5:"):
            reasons.append(f"its task texts came from the {text!r} encoder ({text_file}), which LeRobot's policy "
                           "cannot run: it encodes prompts with the UMT5 of wan_pretrained_path (flexpack encode "
                           "--text-encoder umt5:PATH, then train again)")
    m = run.model_config
    where, configs = _frozen_configs(wan_pretrained_path)
    for sub, key, field in (("vae", "z_dim", "in_channels"), ("text_encoder", "d_model", "text_dim")):
        theirs = configs.get(sub, {}).get(key)
        if theirs is not None and theirs != getattr(m, field):
            reasons.append(f"wan_pretrained_path {where}/{sub}/config.json has {key} = {theirs}, but the model's "
                           f"{field} = {getattr(m, field)} (set --wan-pretrained-path to the VAE and text encoder the "
                           "run's cache was encoded with)")
    return reasons


def _cache_files(run: Run) -> tuple[Path, Path | None]:
    """(the first episode's latent file, a task text file or None) of the cache the run trained on."""
    from flexpack.data import cache
    from flexpack.data.episodes import EpisodeSource
    from flexpack.data.problems import resolve_cameras

    try:
        src = EpisodeSource(run.config.data.root)
    except (OSError, ValueError) as exc:
        raise ValueError(f"--format lerobot reads the run's dataset and latent cache, but data.root = "
                         f"{run.config.data.root!r} cannot be read ({exc}); --set data.root=DATASET (with its latents)"
                         ) from None
    model_cfg = run.model_config
    given = list(model_cfg.obs_cam_keys) or (list(run.config.data.cameras) if run.config.data.cameras else None)
    cams = resolve_cameras(src.video_keys, given, src.info_file)
    latents = Path(run.config.data.latents_dir) if run.config.data.latents_dir else cache.default_latents_dir(src.root)
    texts = sorted((latents / "text").glob("task_*.safetensors"))
    return cache.latent_path(latents, cams, src.episodes[0]), texts[0] if texts else None


def _frozen_configs(path: str | None) -> tuple[str, dict[str, dict[str, Any]]]:
    """(the path, {"vae": its vae/config.json, "text_encoder": ...}) of ``wan_pretrained_path``: a local folder, or a
    Hub repo in the local Hugging Face cache; what cannot be read here is left out (and said on stderr)."""
    import sys

    from lerobot.policies.lingbot_va.configuration_lingbot_va import LingBotVAConfig

    path = path if path is not None else LingBotVAConfig.wan_pretrained_path
    out: dict[str, dict[str, Any]] = {}
    for sub in ("vae", "text_encoder"):
        file: Path | str | None = Path(path) / sub / "config.json"
        if not Path(file).is_file():
            try:
                from huggingface_hub import try_to_load_from_cache

                file = try_to_load_from_cache(path, f"{sub}/config.json")
            except Exception:  # not a repo id, or no hub library: nothing cached to read
                file = None
        if isinstance(file, (str, Path)) and Path(file).is_file():
            out[sub] = json.loads(Path(file).read_text())
    if len(out) < 2:
        print(f"export: {path}/{{vae,text_encoder}}/config.json not readable here (not a local folder, not in the "
              "Hugging Face cache); the widths of LeRobot's frozen VAE and text encoder are not checked",
              file=sys.stderr)
    return path, out


def policy_layout(run: Run, stats: ActionStats) -> dict[str, Any]:
    """The dataset-side fields of the policy: ``obs_cam_keys``, ``height``, ``width``, the input and output
    features, checked against the latent cache and the checkpoint's statistics (one line each)."""
    from lerobot.configs.types import FeatureType, PolicyFeature

    from flexpack.data import cache
    from flexpack.data.episodes import EpisodeSource
    from flexpack.data.problems import resolve_cameras

    model_cfg = run.model_config
    if stats.mode != "quantile":
        raise ValueError(f"--format lerobot: the run normalized its actions with {stats.mode!r} statistics, but "
                         "LeRobot's lingbot_va postprocessor maps actions with q01 / q99 (QUANTILES); train with "
                         "data.action_stats = 'pooled' (or a meta/stats.json with q01 / q99)")
    if stats.columns != len(model_cfg.used_action_channel_ids):
        raise ValueError(f"--format lerobot: the checkpoint's action statistics cover {stats.columns} columns, but "
                         f"used_action_channel_ids = {list(model_cfg.used_action_channel_ids)} places "
                         f"{len(model_cfg.used_action_channel_ids)}: the actions do not map onto the policy's output")
    src = EpisodeSource(run.config.data.root)
    given = list(model_cfg.obs_cam_keys) or (list(run.config.data.cameras) if run.config.data.cameras else None)
    cams = resolve_cameras(src.video_keys, given, src.info_file)
    shapes = {c: tuple(int(x) for x in src.meta.features[c]["shape"][:2]) for c in cams}  # (H, W, C) -> (H, W)
    if len(set(shapes.values())) != 1 or any(h % VAE_PIXELS or w % VAE_PIXELS for h, w in shapes.values()):
        raise ValueError(f"{src.info_file}: cameras {shapes} (height, width); LeRobot's lingbot_va policy resizes "
                         f"every camera to one height x width, multiples of {VAE_PIXELS} (its VAE's grid), so these "
                         "cameras do not map onto it")
    (h, w), = set(shapes.values())
    latents = Path(run.config.data.latents_dir) if run.config.data.latents_dir else cache.default_latents_dir(src.root)
    file = cache.latent_path(latents, cams, src.episodes[0])
    try:
        head = cache.read_latent_header(file)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{file}: the latent cache the run trained on cannot be read ({exc}); --set data.root=DATASET "
                         "(with its latents)") from None
    want = (h // VAE_PIXELS, len(cams) * (w // VAE_PIXELS))
    if (head.height, head.width) != want:
        raise ValueError(f"{file}: latents of {head.height}x{head.width}, but LeRobot's lingbot_va policy encodes the "
                         f"cameras {cams} ({h}x{w} each) into {want[0]}x{want[1]} (the Wan VAE's {VAE_PIXELS}-pixel "
                         "grid, cameras joined on width)")
    inputs = {c: PolicyFeature(type=FeatureType.VISUAL, shape=(3, h, w)) for c in cams}
    outputs = {"action": PolicyFeature(type=FeatureType.ACTION, shape=(len(model_cfg.used_action_channel_ids),))}
    return {"obs_cam_keys": cams, "height": h, "width": w, "input_features": inputs, "output_features": outputs}


def policy_config(run: Run, layout: dict[str, Any], wan_pretrained_path: str | None) -> Any:
    """LeRobot's ``LingBotVAConfig`` of the run (``wan_pretrained_path`` None: LeRobot's default)."""
    from lerobot.policies.lingbot_va.configuration_lingbot_va import LingBotVAConfig

    fields = run.model_config.lerobot_fields()
    fields.update({"camera_layout": "width_concat", **layout}, patch_size=tuple(fields["patch_size"]),
                  attn_mode="torch", device="cpu")  # device: null in the written config.json
    if wan_pretrained_path is not None:
        fields["wan_pretrained_path"] = wan_pretrained_path
    return LingBotVAConfig(**fields)


def write_policy(folder: Path, config: Any, state_dict: dict[str, torch.Tensor], stats: ActionStats,
                 norm: dict[str, Any], dtype: torch.dtype) -> None:
    """One policy folder: config.json, model.safetensors, the processors (``stats``), normalization.json (``norm``)."""
    import draccus
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.lingbot_va.processor_lingbot_va import make_lingbot_va_pre_post_processors
    from safetensors.torch import save_file

    from flexpack.families.lingbot.convert import to_lerobot_state_dict
    from flexpack.tools.export_extras import stats_tensors

    folder.mkdir(parents=True, exist_ok=True)
    encoded = draccus.encode(config, PreTrainedConfig)  # as PreTrainedConfig._save_pretrained writes it
    encoded["device"] = None  # LeRobot picks the device where the policy loads
    (folder / "config.json").write_text(json.dumps(encoded, indent=4) + "\n")
    weights = to_lerobot_state_dict({k: v.to(dtype) for k, v in state_dict.items()})
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    pre, post = make_lingbot_va_pre_post_processors(config, dataset_stats=stats_tensors(stats, {}, ["action"]))
    pre.save_pretrained(folder)
    post.save_pretrained(folder)
    (folder / "normalization.json").write_text(json.dumps(norm, indent=2) + "\n")


def write_lerobot(job: Any, folder: Path) -> None:
    """The ``lerobot`` format of an :class:`~flexpack.tools.export_io.ExportJob` into ``folder``."""
    import sys

    run, opts = job.composed, job.options
    if (opts.allow_unrunnable and not is_bundle(run.config.data)
            and (reasons := unrunnable(run, opts.wan_pretrained_path))):
        print(f"export: warning: writing a policy LeRobot cannot run as it trained (--allow-unrunnable): "
              f"{'; '.join(reasons)}", file=sys.stderr)
    if is_bundle(run.config.data):  # cameras, layout and frames from the bundle's files (export_bundle)
        from flexpack.families.lingbot.config import lerobot_layout_name
        from flexpack.families.lingbot.export_bundle import lerobot_layout

        layout = lerobot_layout(run, job.stats, opts.dataset)
        layout["camera_layout"] = lerobot_layout_name(layout["camera_layout"])
    else:
        layout = policy_layout(run, job.stats)
    config = policy_config(run, layout, opts.wan_pretrained_path)
    write_policy(folder, config, job.model.state_dict(), job.stats, job.norm, opts.dtype)
    if job.averaged is not None:
        write_policy(folder / "ema", config, job.averaged.full_state_dict(), job.stats, job.norm, opts.dtype)
