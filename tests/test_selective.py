"""parallel.activation_checkpointing = "selective": matmul and attention outputs kept, elementwise
ops recomputed; the same gradients as no checkpointing, memory between none and full."""

from __future__ import annotations

import pytest
import torch
from torch.utils.checkpoint import CheckpointPolicy

from flexpack.attention.flex import FlexAttnFunc
from flexpack.families.wan.config import wan_config
from flexpack.families.wan.model import WanVA
from flexpack.flow.noise import episode_flow_sample
from flexpack.flow.objective import FlowMatchingConfig, flow_loss
from flexpack.packing.collate import PackCollate
from flexpack.parallel import selective
from flexpack.parallel.parallelize import ParallelOptions, parallelize


def _items(lens, seed):
    g = torch.Generator().manual_seed(seed)
    return [{"latent": torch.randn(4, F, 4, 4, generator=g), "text": torch.randn(6, 32, generator=g),
             "action": torch.randn(7, F, 2, generator=g), "action_mask": torch.ones(7, F, 2, dtype=torch.bool),
             "episode_index": i} for i, F in enumerate(lens)]


def _run(ac, compile_=False):
    """(bytes autograd saved outside checkpoints, loss, gradients) of one step of a 2-block tiny model."""
    torch.manual_seed(0)
    model = WanVA(wan_config("tiny", num_layers=2), attn=FlexAttnFunc("dense"))
    keys = list(model.state_dict())
    parallelize(model, device=torch.device("cpu"),
                options=ParallelOptions(activation_checkpointing=ac, compile=compile_))
    assert list(model.state_dict()) == keys  # the wrapper keeps checkpoints loadable into plain models
    cfg = FlowMatchingConfig()
    batch = PackCollate(8)(_items([5, 3], 0))
    sample = episode_flow_sample(batch, cfg, [0, 1])
    saved = []

    def pack(t):
        saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = flow_loss(model(sample.inputs, **sample.model_kwargs(), text_slots=4), sample, batch, cfg).loss
    loss.backward()
    return sum(saved), float(loss.detach()), [p.grad.clone() for p in model.parameters()], model


def test_policy_saves_matmuls_and_attention_and_recomputes_the_rest():
    aten = torch.ops.aten
    for op in (aten.mm.default, aten.addmm.default, aten._scaled_mm.default, torch.ops.higher_order.flex_attention,
               aten._scaled_dot_product_flash_attention_for_cpu.default):
        assert selective.policy(None, op) == CheckpointPolicy.MUST_SAVE, op
    for op in (aten.add.Tensor, aten.mul.Tensor, aten.native_layer_norm.default, aten.gelu.default,
               aten._to_copy.default):
        assert selective.policy(None, op) == CheckpointPolicy.PREFER_RECOMPUTE, op


def test_selective_eager_gives_the_same_gradients(one_thread, monkeypatch):
    _, l0, g0, _ = _run(False)
    seen = []
    policy = selective.policy
    monkeypatch.setattr(selective, "policy", lambda ctx, func, *a, **k: seen.append(func) or policy(ctx, func, *a, **k))
    _, l1, g1, model = _run("selective")
    # the policy ran on the blocks' ops
    assert torch.ops.aten.mm.default in seen or torch.ops.aten.addmm.default in seen
    assert all(type(b).__name__ == "CheckpointWrapper" for b in model.blocks)
    assert l1 == l0
    for a, b in zip(g1, g0):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_selective_is_a_config_value():
    from flexpack.run.config import load_config

    assert (load_config(overrides=["parallel.activation_checkpointing='selective'"]).parallel.activation_checkpointing
            == "selective")
    want = "parallel.activation_checkpointing must be true, false, a block count >= 0 or 'selective', got 'some'"
    with pytest.raises(ValueError, match=want):
        load_config(overrides=["parallel.activation_checkpointing='some'"])


@pytest.mark.slow
def test_selective_compiled_saves_between_none_and_full_with_the_same_gradients(one_thread):
    """Compiled blocks: the policy is traced, the partitioner keeps matmul/attention outputs only."""
    none, l0, g0, _ = _run(False, compile_=True)
    sel, l1, g1, _ = _run("selective", compile_=True)
    full, l2, g2, _ = _run(True, compile_=True)
    assert full < sel < none, (full, sel, none)
    for g in (g1, g2):
        for a, b in zip(g, g0):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
