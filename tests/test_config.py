"""Config tree: shipped configs, unknown keys and bad values rejected by name, overrides, JSON round trip."""

from __future__ import annotations

from pathlib import Path

import pytest

from flexpack.run.config import TrainConfig, apply_overrides, load_config, save_config
from flexpack.run.resolve import checked, model_config_of

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def write(tmp_path: Path, text: str, name: str = "c.toml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_shipped_configs_load_with_their_values():
    tiny = load_config(CONFIGS / "tiny_cpu.toml")
    assert tiny.data.mode == "pack" and tiny.data.max_tokens == 100
    wc = model_config_of(tiny)
    assert (wc.dim, wc.in_channels, wc.text_dim, wc.action_channels, wc.attn_backend) == (256, 48, 64, 6, "dense")
    assert wc.dim > wc.in_channels * wc.patch_volume  # wide enough for the numbers one video token carries
    assert tiny.runtime.device == "cpu" and tiny.optim.accum_steps == 2 and tiny.schedule.rewarmup_steps == 2

    big = load_config(CONFIGS / "wan5b_pack.toml")
    wc = model_config_of(big)
    assert (wc.dim, wc.num_layers, wc.num_heads, wc.in_channels) == (3072, 30, 24, 48)
    assert big.data.mode == "pack" and big.data.max_tokens == 65536
    assert big.optim.betas == (0.9, 0.95) and big.runtime.dtype == "bfloat16"
    assert big.parallel.activation_checkpointing is True


def test_defaults_without_a_file():
    cfg = load_config()
    assert cfg == checked(TrainConfig())  # loading checks (and fills in model.mask); building does not
    assert TrainConfig().model.mask == "" and cfg.model.mask == "document"
    assert cfg.objective.shift == 5.0 and cfg.schedule.decay == "cosine"


@pytest.mark.parametrize("text,key", [
    ("[data]\nbach_size = 3\n", "data.bach_size"),
    ("[optimizer]\nlr = 1.0\n", "optimizer"),
    ("[objective]\nshiftt = 2.0\n", "objective.shiftt"),
])
def test_unknown_keys_are_rejected_naming_file_and_key(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(ValueError) as info:
        load_config(path)
    assert key in str(info.value) and str(path) in str(info.value)


@pytest.mark.parametrize("text,match", [
    ('[optim]\nlr = "fast"\n', r"optim\.lr must be float, got 'fast'"),
    ("[schedule]\nsteps = true\n", r"schedule\.steps must be int, got True"),
    ("[schedule]\nsteps = 0\n", r"schedule\.steps must be positive, got 0"),
    ('[data]\nmode = "zip"\n', r"data\.mode must be one of .* got 'zip'"),
    ("[optim]\nbetas = [0.9]\n", r"optim\.betas must have 2 entries"),
    ("[model]\noverrides = { dimm = 8 }\n", r"unknown WanVAConfig fields \['dimm'\]"),
    ('[model]\npreset = "huge"\n', r"unknown WanVA preset 'huge'"),
    ('[model]\nmask = "chunk_causal"\n', r"needs a positive model\.chunk_size"),
    ("[objective]\nteacher_forcing = true\n", r"teacher_forcing needs model\.mask"),
    ('[model]\nmask = "teacher_forcing"\nchunk_size = 2\n', r"needs objective\.teacher_forcing = true"),
    ("[model]\nchunk_size = 2\n", r"model\.chunk_size=2 has no effect with model\.mask='document'"),
    ("[model]\noverrides = { activation_checkpointing = true }\n[parallel]\nactivation_checkpointing = true\n",
     r"model\.overrides\.activation_checkpointing = True is not a model setting: "
     r"set parallel\.activation_checkpointing"),
    ("[model]\noverrides = { activation_checkpointing = true }\n",
     r"model\.overrides\.activation_checkpointing = True is not a model setting: "
     r"set parallel\.activation_checkpointing"),
    ("[schedule]\nrewarmup_from = 1.5\n", r"rewarmup_from must be in \[0, 1\], got 1.5"),
])
def test_bad_values_are_value_errors_naming_the_field(tmp_path, text, match):
    with pytest.raises(ValueError, match=match):
        load_config(write(tmp_path, text))


def test_overrides_are_parsed_as_toml_values():
    cfg = load_config(CONFIGS / "tiny_cpu.toml", [
        "schedule.steps=7", "data.root=/some/where", "optim.betas=[0.8, 0.9]", "model.overrides.dim=128",
        "data.cameras=['cam0']", "log.progress=false",
    ])
    assert cfg.schedule.steps == 7 and cfg.data.root == "/some/where" and cfg.optim.betas == (0.8, 0.9)
    assert model_config_of(cfg).dim == 128 and model_config_of(cfg).in_channels == 48  # merged, not replaced
    assert cfg.data.cameras == ("cam0",) and cfg.log.progress is False
    with pytest.raises(ValueError, match="not KEY=VALUE"):
        apply_overrides({}, ["schedule.steps"])
    with pytest.raises(ValueError, match="schedule.stepz"):
        load_config(CONFIGS / "tiny_cpu.toml", ["schedule.stepz=3"])


def test_json_round_trip_and_file_errors(tmp_path):
    cfg = load_config(CONFIGS / "wan5b_pack.toml", ["data.root=/d"])
    save_config(cfg, tmp_path / "run" / "config.json")
    assert load_config(tmp_path / "run" / "config.json") == cfg
    assert not list((tmp_path / "run").glob(".*"))  # no temporary file left behind
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    with pytest.raises(ValueError, match=r"must end in \.toml or \.json, got '\.yaml'"):
        load_config(write(tmp_path, "a: 1", "c.yaml"))
    with pytest.raises(ValueError, match="cannot parse"):
        load_config(write(tmp_path, "[data\n"))


def test_wan5b_config_builds_its_model_on_the_meta_device():
    import torch

    from flexpack.run.model import build_model

    cfg = load_config(CONFIGS / "wan5b_pack.toml", ["data.root=/d"])
    with torch.device("meta"):
        model = build_model(cfg)
    n = model.num_parameters()
    print(f"configs/wan5b_pack.toml model: {n:,} parameters")
    assert 4.9e9 < n < 5.1e9 and all(p.is_meta for p in model.parameters())
    assert model.config.action_channels == 30 and model.action_embed.in_features == 30
    assert model.attn.backend == "auto"


def test_runtime_compile_and_checkpoint_counts():
    import torch

    from flexpack.run.root import use_compile

    assert load_config(overrides=[]).parallel.compile == "auto"
    cfg = load_config(overrides=["parallel.compile=true", "parallel.activation_checkpointing=3"])
    assert cfg.parallel.compile is True and cfg.parallel.activation_checkpointing == 3
    assert use_compile(cfg, torch.device("cpu")) is True  # forced on
    auto = load_config(overrides=[])
    assert use_compile(auto, torch.device("cpu")) is False  # auto: CUDA and pack mode only
    assert use_compile(auto, torch.device("cuda")) is True
    assert use_compile(load_config(overrides=["data.mode='pad'"]), torch.device("cuda")) is False
    with pytest.raises(ValueError, match="parallel.compile must be true, false or 'auto', got 'banana'"):
        load_config(overrides=["parallel.compile=banana"])
    with pytest.raises(ValueError, match="parallel.activation_checkpointing must be true, false or a block count"):
        load_config(overrides=["parallel.activation_checkpointing=-1"])
    with pytest.raises(ValueError, match="profile.peak_tflops must be a positive number"):
        load_config(overrides=["profile.peak_tflops=-5.0"])
