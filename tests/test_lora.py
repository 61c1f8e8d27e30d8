"""LoRA fine-tuning (``[lora]``, :mod:`flexpack.run.lora`) on tiny random models of both families, on the CPU: only the
adapters train, the base stays as loaded, a run resumes exactly, exports hold the merged weights under the names of a
run without LoRA, the adapter folder loads back through peft, ``flexpack sample`` reads a LoRA run, bad inputs fail in
one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from flexpack.commands.train import train
from flexpack.flow.noise import noise_seeds
from flexpack.run import lora
from flexpack.run.compose import build_run
from flexpack.run.config import load_config
from flexpack.run.resolve import config_family, model_config_of
from helpers import LINGBOT_TINY, TINY, run_cli, sample_run_and_export, tiny_config

pytest.importorskip("peft")
pytest.importorskip("lerobot")

LORA = ["lora.rank=4", "lora.alpha=8.0", "lora.base_dtype='float32'"]
FAMILIES = {"wanva": [], "lingbot-va": LINGBOT_TINY}


def _fixed_step(cfg, model, *, step: int = 0):
    """(prediction, loss) of ``model`` on the run's first micro-batch with the noise of ``step``: the same inputs for
    every model compared."""
    run = build_run(cfg)
    batch = run.collate([run.dataset[i] for i in next(iter(run.sampler))])
    sample = run.objective.sample(batch, noise_seeds(batch.layout, cfg.runtime.seed, step))
    with torch.no_grad(), run.autocast():
        pred = run.forward(model, sample)
    return pred, float(run.objective.loss(pred, sample, batch).loss)


def _base(cfg) -> torch.nn.Module:
    """The model a run of ``cfg`` starts from, without LoRA (its random init, or model.pretrained)."""
    from flexpack.run.model import build_model

    return build_model(cfg)


def _assert_close(a, b, tol: float = 1e-5) -> None:
    for x, y in ((a.video, b.video), (a.action, b.action)):
        assert (x is None) == (y is None)
        if x is not None:
            torch.testing.assert_close(x.float(), y.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_only_the_adapters_train_the_base_stays_and_the_loss_falls(family, tiny_dataset, tmp_path, one_thread):
    cfg = tiny_config(tiny_dataset, tmp_path / "run", *FAMILIES[family], *LORA, "schedule.steps=8",
                      "schedule.warmup_steps=1", "optim.lr=1e-2")
    base = _base(cfg)
    before = {k: v.clone() for k, v in base.state_dict().items()}
    result = train(cfg)
    model = result.model
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained and all(lora.is_adapter(n) for n in trained)
    assert len(trained) == 2 * len(lora.lora_layers(model)) == 2 * 10 * model.config.num_layers  # every block's 10
    state = model.state_dict()
    for name, p in state.items():
        if lora.is_adapter(name):
            assert p.dtype == torch.float32
            if ".lora_B." in name:
                assert p.abs().max() > 0, name  # started at zero, moved
        else:
            assert torch.equal(p, before[lora.base_name(name)]), name  # frozen: bit for bit the start
    assert {lora.base_name(n) for n in state if not lora.is_adapter(n)} == set(before)
    # the loss of one fixed batch and noise: the base model's against the trained adapters'
    _, start = _fixed_step(cfg, base)
    _, end = _fixed_step(cfg, model)
    assert end < 0.95 * start, (start, end)
    saved = json.loads((result.checkpoint / "train_state.json").read_text())["extra"]["lora"]
    assert saved == {"rank": 4, "alpha": 8.0, "dropout": 0.0, "base_dtype": "float32",
                     "targets": list(config_family(cfg).lora_targets)}


def test_bf16_base_is_cast_and_trains_under_autocast(tiny_dataset, tmp_path, one_thread):
    cfg = tiny_config(tiny_dataset, tmp_path / "run", "lora.rank=2", "runtime.dtype='bfloat16'", "schedule.steps=2")
    base = _base(cfg)
    result = train(cfg)
    dtypes = {n: p.dtype for n, p in result.model.named_parameters()}
    assert {d for n, d in dtypes.items() if lora.is_adapter(n)} == {torch.float32}
    assert {d for n, d in dtypes.items() if not lora.is_adapter(n)} == {torch.bfloat16}
    for name, p in result.model.state_dict().items():
        if not lora.is_adapter(name):
            assert torch.equal(p, base.state_dict()[lora.base_name(name)].to(torch.bfloat16)), name
    assert all(torch.isfinite(torch.tensor(result.losses)))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_resume_is_exact_and_other_lora_options_are_refused(family, tiny_dataset, tmp_path, one_thread):
    sets = [*FAMILIES[family], *LORA, "schedule.steps=4", "schedule.rewarmup_steps=0", "lora.dropout=0.1"]
    straight = train(tiny_config(tiny_dataset, tmp_path / "a", *sets))
    cfg = tiny_config(tiny_dataset, tmp_path / "b", *sets)
    first = train(cfg, stop_after=2)
    assert first.step == 2
    second = train(cfg)
    assert second.start_step == 2 and second.step == 4
    assert first.losses + second.losses == straight.losses
    want, got = straight.model.state_dict(), second.model.state_dict()
    assert set(want) == set(got)
    for name in want:
        assert torch.equal(want[name], got[name]), name

    for change, says in (("lora.rank=8", "lora.rank is 4 there and 8 now"),
                         ("lora.targets=['ffn.fc1']", "lora.targets is"),
                         ("lora.rank=0", "trained with LoRA (lora.rank = 4) and lora.rank = 0 now")):
        other = tiny_config(tiny_dataset, tmp_path / "b", *sets, "schedule.steps=6", change)
        with pytest.raises(ValueError, match="cannot resume from") as err:
            train(other)
        assert says in str(err.value) and "\n" not in str(err.value)
    plain = tiny_config(tiny_dataset, tmp_path / "c", *FAMILIES[family], "schedule.steps=1")
    train(plain)
    again = tiny_config(tiny_dataset, tmp_path / "c", *FAMILIES[family], *LORA, "schedule.steps=2")
    with pytest.raises(ValueError, match=r"trained without LoRA and lora.rank = 4 now"):
        train(again)


def test_merged_diffusers_export_has_plain_names_and_the_trained_outputs(tiny_dataset, tmp_path, capsys, one_thread):
    from safetensors.torch import load_file

    from flexpack.families.wan.export import load_export

    sets = ["objective.chunk_size=2", "model.chunk_size=2", "model.mask='chunk_causal'", "schedule.steps=3"]
    cfg = tiny_config(tiny_dataset, tmp_path / "run", *LORA, *sets)
    result = train(cfg)
    plain = tiny_config(tiny_dataset, tmp_path / "plain", *sets, "schedule.steps=1")
    train(plain)
    for name, run in (("lora", tmp_path / "run"), ("plain_export", tmp_path / "plain")):
        code, err = run_cli(capsys, "export", str(run), str(tmp_path / name), "--no-policy")
        assert code == 0, err
    for f in ("diffusion_pytorch_model.safetensors", "action_stream.safetensors"):
        assert set(load_file(tmp_path / "lora" / f)) == set(load_file(tmp_path / "plain_export" / f))
    assert not any("lora" in k or "base_layer" in k for k in load_file(tmp_path / "lora" / "action_stream.safetensors"))
    _assert_close(_fixed_step(cfg, load_export(tmp_path / "lora"))[0], _fixed_step(cfg, result.model)[0])
    # sample reads the run (its checkpoint merged on load) as it reads the export
    for src, out in ((tmp_path / "run", "s_run"), (tmp_path / "lora", "s_export")):
        code, err = run_cli(capsys, "sample", str(src), "--horizon", "2", "--plots", "0", "--samples", "1",
                            "--steps", "2", "--out", str(tmp_path / out))
        assert code == 0, err
    run_m, exp_m = (json.loads((tmp_path / o / "metrics.json").read_text()) for o in ("s_run", "s_export"))
    assert run_m["latent_mse"] == pytest.approx(exp_m["latent_mse"], rel=1e-5)
    assert run_m["action_mse"] == pytest.approx(exp_m["action_mse"], rel=1e-5)


@pytest.fixture(scope="module")
def lingbot_lora(tiny_dataset, tmp_path_factory):
    """(config, train result, folder): a lingbot-va-tiny LoRA run of 3 steps from a tiny LeRobot policy."""
    from helpers import save_policy

    base = tmp_path_factory.mktemp("lingbot_lora")
    save_policy(base / "policy")
    cfg = tiny_config(tiny_dataset, base / "run", *LINGBOT_TINY, *LORA, f'model.pretrained="{base / "policy"}"',
                      "schedule.steps=3", "optim.lr=1e-2")
    torch.set_num_threads(1)
    return cfg, train(cfg), base


def test_lingbot_export_adapter_loads_back_through_peft_and_sample_agrees(lingbot_lora, capsys):
    from peft import PeftModel

    cfg, result, base = lingbot_lora
    run, out, adapter = base / "run", base / "upstream", base / "adapter"
    shutil.rmtree(out, ignore_errors=True), shutil.rmtree(adapter, ignore_errors=True)
    code, err = run_cli(capsys, "export", str(run), str(out), "--format", "lingbot-upstream", "--adapter",
                        str(adapter))
    assert code == 0, err
    assert sorted(p.name for p in adapter.iterdir()) == sorted(lora.ADAPTER_FILES)
    assert json.loads((adapter / "adapter_config.json").read_text())["r"] == 4
    trained, _ = _fixed_step(cfg, result.model)
    with pytest.raises(AssertionError):  # the adapters moved the outputs away from the base model's
        _assert_close(_fixed_step(cfg, _base(cfg))[0], trained)
    # the adapters on the base model built from the same pretrained weights, through peft's own loader
    peft_model = PeftModel.from_pretrained(_base(cfg), str(adapter)).eval()
    _assert_close(_fixed_step(cfg, peft_model)[0], trained)
    # the merged export: the upstream transformer folder, read back by the family
    merged = config_family(cfg).load_checkpoint(str(out / "transformer"), model_config_of(cfg))
    _assert_close(_fixed_step(cfg, merged)[0], trained)
    got = sample_run_and_export(capsys, run, out, base / "samples")
    assert got["export"]["action_mse"] == pytest.approx(got["run"]["action_mse"], rel=1e-5)
    assert got["export"]["latent_mse"] == pytest.approx(got["run"]["latent_mse"], rel=1e-5)


def test_float8_converts_the_frozen_base_layers_never_the_adapters(one_thread):
    pytest.importorskip("torchao")
    from flexpack.parallel import float8

    cfg = load_config(TINY, ['data.root="unused"', *LORA])
    model = lora.apply(config_family(cfg).build(model_config_of(cfg)), cfg)
    names = float8.convert(model, "tensorwise", emulate=True, min_dim=16)
    assert names and all(n.endswith(".base_layer") for n in names)
    assert not any(n.startswith(("blocks.0.cross_attn.k", "blocks.0.cross_attn.v")) for n in names)  # float8.SKIP
    assert all(type(layer.base_layer).__name__ == "Float8Linear" for n, layer in lora.lora_layers(model)
               if f"{n}.base_layer" in names)
    assert sorted(n for n, p in model.named_parameters() if p.requires_grad) == sorted(
        n for n in model.state_dict() if lora.is_adapter(n))


def test_bad_lora_inputs_fail_in_one_line(tiny_dataset, tmp_path, capsys):
    def error(*sets: str) -> str:
        with pytest.raises(ValueError) as err:
            load_config(TINY, ['data.root="unused"', *sets])
        assert "\n" not in str(err.value)
        return str(err.value)

    assert "lora.rank must be an integer >= 0" in error("lora.rank=-1")
    assert "lora.alpha must be a positive number" in error(*LORA, "lora.alpha=0.0")
    assert "lora.dropout must be in [0, 1)" in error(*LORA, "lora.dropout=1.0")
    assert "lora.base_dtype must be one of" in error(*LORA, "lora.base_dtype='float16'")
    text = error("lora.rank=4")
    assert "lora.base_dtype = 'bfloat16' needs runtime.dtype = 'bfloat16'" in text
    text = error(*LORA, "lora.targets=['to_q', 'ffn.fc1']")
    assert "lora.targets ['to_q'] match no module of the wanva model" in text and "blocks.0.ffn.fc1" in text
    assert "match modules that are not linear layers: ['blocks.0.ffn (MLP)'" in error(*LORA, "lora.targets=['ffn']")
    assert "an EMA of the LoRA weights is not supported" in error(*LORA, "optim.ema_decay=0.5")
    # --adapter on a run without LoRA: one line, nothing written
    train(tiny_config(tiny_dataset, tmp_path / "plain", "schedule.steps=1"))
    capsys.readouterr()  # what training printed is not the export's
    code, err = run_cli(capsys, "export", str(tmp_path / "plain"), str(tmp_path / "out"), "--adapter",
                        str(tmp_path / "adapter"))
    assert code == 2 and "trained without LoRA" in err and err.strip().count("\n") == 0, err
    assert not (tmp_path / "out").exists() and not (tmp_path / "adapter").exists()


@pytest.mark.slow  # two torchrun ranks: ~15 s
@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed is not built in")
def test_fsdp2_lora_from_pretrained_starts_as_one_process_and_trains_the_adapters_only(tmp_path):
    """Under FSDP2 (2 CPU ranks over gloo) a LoRA model is built on the meta device, sharded, filled from
    model.pretrained and its adapters drawn: the start equals a single process's; training moves the adapters only."""
    pytest.importorskip("diffusers")
    from flexpack.data.encode import encode_dataset
    from flexpack.data.synthetic import make_synthetic_dataset
    from flexpack.run.config import save_config
    from flexpack.run.state import checkpoint
    from helpers import torchrun_worker
    from hf_tiny import tiny_diffusers

    root = make_synthetic_dataset(tmp_path / "ds", lengths=[25, 21, 17, 13, 9, 9], seed=6)
    encode_dataset(root, progress=False)
    tiny_diffusers(seed=8).save_pretrained(tmp_path / "transformer")
    cfg = tiny_config(root, tmp_path / "run", "lora.rank=4", "runtime.dtype='bfloat16'",
                      f'model.pretrained="{tmp_path / "transformer"}"', "parallel.activation_checkpointing=true",
                      "schedule.steps=3", "schedule.warmup_steps=1")
    save_config(cfg, tmp_path / "cfg.json")
    torchrun_worker("dist_pretrained_worker.py", tmp_path / "cfg.json", tmp_path, cwd=tmp_path)
    r0 = json.loads((tmp_path / "rank0.json").read_text())
    assert r0["param_types"] == ["DTensor"] and r0["steps"] == 3

    single = lora.apply(_base(cfg), cfg).state_dict()
    loaded = torch.load(tmp_path / "loaded.pt", weights_only=True)
    assert set(loaded) == set(single)
    for name, value in single.items():
        assert loaded[name].dtype == value.dtype and torch.equal(loaded[name], value), name
    final = checkpoint.read_tensors(checkpoint.latest(tmp_path / "run" / "checkpoints"))
    moved = {n for n in final if not torch.equal(final[n], single[n])}
    assert moved and all(lora.is_adapter(n) for n in moved)
    assert any(".lora_B." in n for n in moved)


@pytest.mark.slow  # compiles the blocks on the CPU: ~50 s
def test_compiled_checkpointed_lora_blocks_train_as_eager_ones(tiny_dataset, tmp_path, one_thread):
    from flexpack.parallel.parallelize import compiled_graphs

    sets = [*LORA, "schedule.steps=2", "parallel.activation_checkpointing=true"]
    eager = train(tiny_config(tiny_dataset, tmp_path / "eager", *sets, "parallel.compile=false"))
    graphs = compiled_graphs()
    compiled = train(tiny_config(tiny_dataset, tmp_path / "compiled", *sets, "parallel.compile=true"))
    assert compiled_graphs() > graphs  # the peft-wrapped blocks went through torch.compile
    assert compiled.losses == pytest.approx(eager.losses, rel=1e-5)
    for name, value in eager.model.state_dict().items():
        torch.testing.assert_close(compiled.model.state_dict()[name], value, rtol=1e-4, atol=1e-6)
