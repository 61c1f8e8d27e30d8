"""FlexAttnFunc backends vs a float64 reference and vs per-episode SDPA (CPU; GPU tests marked)."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from flexpack.attention.flex import FlexAttnFunc, compile_count, has_flash
from flexpack.attention.masks import dense_mask, make_mask
from flexpack.packing.layout import SequenceLayout

H, D = 2, 16
KINDS = ("document", "valid", "chunk_causal", "teacher_forcing", "text")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def reference(q, k, v, mask) -> torch.Tensor:
    """float64 masked softmax attention; rows without keys give exactly 0."""
    q, k, v = q.double(), k.double(), v.double()
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    has = mask.any(-1, keepdim=True)
    s = s.masked_fill(~mask, float("-inf")).masked_fill(~has, 0.0)
    return (s.softmax(-1) * has) @ v


def random_case(rng: random.Random, kind: str, frames: int | None = None, copies: int | None = None):
    """A random layout; with ``frames`` fixed, T is fixed (the compiled-flex shape) and contents vary."""
    copies = copies or (1 if kind == "chunk_causal" else rng.choice([1, 2]))
    budget = frames or rng.randint(4, 30)
    lens, total = [], 0
    while len(lens) < 12 and total < budget - 1:
        n = rng.randint(1, max(1, min(8, budget - total - 1)))
        lens.append(n)
        total += n
    text = [rng.randint(0, 5) for _ in lens]
    if frames is None and rng.random() < 0.3:  # pad mode: padded rows
        sl = SequenceLayout.from_rows([[n] for n in lens], max(lens) + 1, mode="pad", text_len=text)
    else:
        sl = SequenceLayout.from_rows([lens], budget, text_len=text)
    lay = sl.tokens(5, 2, copies=copies)  # 7 tokens per frame: T never a multiple of 128 by design
    kw: dict = {}
    if kind in ("chunk_causal", "teacher_forcing"):
        kw["chunk_size"] = rng.randint(1, 3)
    if kind == "teacher_forcing" and rng.random() < 0.5:
        kw["window"] = rng.randint(0, 2)
    if kind == "text":
        kw["text_tokens"] = 5
    kv_len = 5 * len(lens) if kind == "text" else lay.num_tokens
    return lay, kw, kv_len


def qkv(T: int, K: int, dtype=torch.float64, device="cpu", grad=False, seed=0, d=D):
    g = torch.Generator(device="cpu").manual_seed(seed)
    mk = lambda n: torch.randn(1, H, n, d, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_(grad)  # noqa: E731
    return mk(T), mk(K), mk(K)


@pytest.mark.parametrize("kind", KINDS)
def test_dense_forward_backward_matches_float64_reference(kind: str) -> None:
    rng = random.Random(7)
    attn = FlexAttnFunc("dense")
    for trial in range(6):
        lay, kw, K = random_case(rng, kind)
        q, k, v = qkv(lay.num_tokens, K, grad=True, seed=trial)
        out = attn(q, k, v, lay, kind, **kw)
        mask = dense_mask(make_mask(lay, kind, **kw), lay.num_tokens, K)
        q2, k2, v2 = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
        want = reference(q2, k2, v2, mask)
        torch.testing.assert_close(out, want, rtol=1e-9, atol=1e-9)
        w = torch.randn_like(out)
        (out * w).sum().backward()
        (want * w).sum().backward()
        for a, b in ((q, q2), (k, k2), (v, v2)):
            assert torch.isfinite(a.grad).all()
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-8, atol=1e-9)
        empty = ~mask.any(-1)
        assert out[0, :, empty].eq(0).all() and q.grad[0, :, empty].eq(0).all()
        if kind != "text":
            assert empty.equal(~lay.valid)  # exactly the pads: every valid token sees itself
            assert out[0, :, ~lay.valid].eq(0).all()


def test_dense_float32_pad_rows_zero_not_nan() -> None:
    lay = SequenceLayout.from_rows([[2], [3]], 5, mode="pad").tokens(3, 1)
    q, k, v = qkv(lay.num_tokens, lay.num_tokens, dtype=torch.float32, grad=True)
    out = FlexAttnFunc("dense")(q, k, v, lay)
    out.square().sum().backward()
    assert not out.isnan().any() and out[0, :, ~lay.valid].eq(0).all()
    assert torch.isfinite(q.grad).all() and torch.isfinite(k.grad).all()


@pytest.mark.parametrize("seed", range(4))
def test_document_backends_match_independent_per_episode_sdpa(seed: int) -> None:
    rng = random.Random(100 + seed)
    lay, _, _ = random_case(rng, "document", copies=rng.choice([1, 2]))
    q, k, v = qkv(lay.num_tokens, lay.num_tokens, seed=seed)
    want = torch.zeros_like(q)
    for e in range(lay.text_len.numel()):  # one SDPA per episode, located from doc ids alone
        idx = (lay.doc == e).nonzero().reshape(-1)
        want[:, :, idx] = F.scaled_dot_product_attention(q[:, :, idx], k[:, :, idx], v[:, :, idx])
    for backend in ("dense", "sdpa-loop"):
        torch.testing.assert_close(FlexAttnFunc(backend)(q, k, v, lay), want, rtol=1e-10, atol=1e-10)


# ------------------------------------------------------------------ compiled flex (CPU: forward only)
FRAMES = 40  # fixed shape: T = 40 frames x 7 tokens x copies; contents vary


@pytest.mark.parametrize("kind", KINDS)
def test_compiled_flex_forward_matches_reference(kind: str) -> None:
    rng = random.Random(300 + KINDS.index(kind))
    attn = FlexAttnFunc("flex")
    for trial in range(3):
        lay, kw, K = random_case(rng, kind, frames=FRAMES, copies=2 if kind == "teacher_forcing" else 1)
        if kind == "text":  # text kv length depends on the episode count: keep it fixed
            lay, kw, K = random_case(random.Random(5), kind, frames=FRAMES, copies=1)
        q, k, v = qkv(lay.num_tokens, K, dtype=torch.float32, seed=trial)
        with torch.no_grad():
            prep = attn.prepare(lay, kind, **kw)
            out = attn(q, k, v, prep)
        want = reference(q, k, v, dense_mask(prep.mask_mod, lay.num_tokens, K))
        torch.testing.assert_close(out.double(), want, rtol=2e-5, atol=2e-5)
        assert not out.isnan().any()


def test_no_recompiles_after_warmup_with_varying_lengths() -> None:
    attn = FlexAttnFunc("flex")
    rng = random.Random(3)

    def step(seed: int) -> None:
        lay, _, _ = random_case(rng, "document", frames=FRAMES, copies=1)
        q, k, v = qkv(lay.num_tokens, lay.num_tokens, dtype=torch.float32, seed=seed)
        with torch.no_grad():
            out = attn(q, k, v, attn.prepare(lay, "document"))
        assert out[0, :, ~lay.valid].eq(0).all()

    step(0)  # warm-up (may compile; shares the shape of the test above)
    start = compile_count()
    for s in range(1, 9):
        step(s)
    assert compile_count() == start, "FlexAttention recompiled for a new layout of the same shape"
    assert attn.compile_count == start


def test_prepared_mask_is_shared_and_checked() -> None:
    lay = SequenceLayout.from_rows([[2, 3]], 6).tokens(4)
    attn = FlexAttnFunc("dense")
    prep = attn.prepare(lay, "chunk_causal", chunk_size=1)
    q, k, v = qkv(lay.num_tokens, lay.num_tokens)
    torch.testing.assert_close(attn(q, k, v, prep), attn(q, k, v, lay, "chunk_causal", chunk_size=1))
    with pytest.raises(ValueError, match="already fixes"):
        attn(q, k, v, prep, "teacher_forcing")
    with pytest.raises(ValueError, match="Tq="):
        attn(q[:, :, :-1], k, v, prep)
    with pytest.raises(ValueError, match="unknown backend"):
        FlexAttnFunc("fast")
    with pytest.raises(ValueError, match="unknown mask"):
        attn.prepare(lay, "causal")
    with pytest.raises(ValueError, match="document/valid"):
        FlexAttnFunc("sdpa-loop")(q, k, v, prep)
    with pytest.raises(ValueError, match="no CPU backward"):
        FlexAttnFunc("flex")(q.float().requires_grad_(), k.float(), v.float(), lay)


def test_auto_on_cpu_picks_dense_for_training() -> None:
    lay = SequenceLayout.from_rows([[2, 3]], 6).tokens(4)
    q, k, v = qkv(lay.num_tokens, lay.num_tokens, grad=True)
    attn = FlexAttnFunc()
    out = attn(q, k, v, lay)
    out.sum().backward()  # would raise on the CPU flex path
    assert attn._pick(attn.prepare(lay), needs_grad=True) == "dense"


def test_auto_on_cpu_uses_flex_for_long_forward_only_calls_without_a_dense_mask(monkeypatch) -> None:
    import flexpack.attention.flex as attention

    monkeypatch.setattr(attention, "CPU_FLEX_MIN_TOKENS", 256)  # stands in for 16k tokens: small and fast
    lay = SequenceLayout.from_rows([[15, 12, 9]], FRAMES).tokens(5, 2)  # 280 tokens: the shape compiled above
    q, k, v = qkv(lay.num_tokens, lay.num_tokens, dtype=torch.float32)
    attn = FlexAttnFunc()
    prep = attn.prepare(lay)
    assert "dense" not in prep._cache  # a T x T bool mask (4 GB at 65k tokens) nobody would use
    with torch.no_grad():
        out = attn(q, k, v, prep)
    assert "dense" not in prep._cache and "block" in prep._cache
    torch.testing.assert_close(out, FlexAttnFunc("dense")(q, k, v, lay), rtol=1e-5, atol=1e-5)
    qg = q.clone().requires_grad_()
    attn(qg, k, v, prep).sum().backward()  # training on CPU still takes the dense path
    assert "dense" in prep._cache and torch.isfinite(qg.grad).all()


# ------------------------------------------------------------------ GPU (run on the H200)
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("backend", ["flex", pytest.param("flex-flash", marks=pytest.mark.fa4), "sdpa-loop", "varlen"])
@pytest.mark.parametrize("kind", KINDS)
def test_gpu_backends_forward_backward(backend: str, kind: str) -> None:
    if backend == "flex-flash" and not has_flash():
        pytest.skip("FA4 (flash_attn.cute) not installed")
    if backend in ("sdpa-loop", "varlen") and kind not in ("document", "valid"):
        pytest.skip("document masks only")
    if backend == "flex-flash" and kind not in ("document", "teacher_forcing", "text"):
        pytest.skip("FLASH: one document-like and one chunked mask suffice (compiles are slow)")
    rng = random.Random(11)
    attn = FlexAttnFunc(backend)
    lay, kw, K = random_case(rng, kind, frames=300, copies=2 if kind == "teacher_forcing" else 1)
    lay = lay.to("cuda")
    # FLASH is used only at verified head dims (FLASH_HEAD_DIMS): its dq is wrong at D=16
    d = 128 if backend == "flex-flash" else D
    q, k, v = qkv(lay.num_tokens, K, dtype=torch.bfloat16, device="cuda", grad=True, d=d)
    prep = attn.prepare(lay, kind, **kw)
    out = attn(q, k, v, prep)
    w = torch.randn_like(out)
    (out.float() * w).sum().backward()
    mask = dense_mask(prep.mask_mod, lay.num_tokens, K)
    q2, k2, v2 = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    want = reference(q2, k2, v2, mask)
    (want * w.double()).sum().backward()
    torch.testing.assert_close(out.double(), want, rtol=2e-2, atol=2e-2)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert torch.isfinite(a.grad).all()
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=5e-2, atol=5e-2)
    assert out[0, :, ~mask.any(-1)].eq(0).all()


def test_flash_refuses_unverified_head_dims() -> None:
    lay = SequenceLayout.from_lengths([5, 7], pad_to=16).tokens()
    q, k, v = qkv(16, 16, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"head dims \(128,\), got 16"):
        FlexAttnFunc("flex-flash")(q, k, v, lay)


def test_flash_takes_16_bit_inputs_only_auto_moves_float32_to_triton() -> None:
    """FA4 rejects float32 inside the kernel (an assert deep in the CuTe code): a float32 run on
    CUDA under ``auto`` runs Triton flex, an explicit ``flex-flash`` says what to change."""
    from flexpack.attention.flex import BoundAttention, _flash_for

    assert _flash_for("flex-flash", torch.float32, strict=False) == "flex"
    assert _flash_for("flex-flash", torch.bfloat16, strict=True) == "flex-flash"
    assert _flash_for("sdpa-loop", torch.float32, strict=True) == "sdpa-loop"
    lay = SequenceLayout.from_lengths([5, 7], pad_to=16).tokens()
    q, k, v = qkv(16, 16, dtype=torch.float32, d=128)
    with torch.no_grad(), pytest.raises(ValueError, match=r"bfloat16 or float16 inputs, got torch.float32.*'flex'"):
        FlexAttnFunc("flex-flash")(q, k, v, lay)
    prep = FlexAttnFunc("dense").prepare(lay)
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        BoundAttention("flex-flash", prep, strict=True)(q, k, v)


def test_text_slots_keep_the_key_length_fixed_without_recompiles() -> None:
    """Pack mode varies the episode count per micro-batch; padded text slots keep one shape."""
    from flexpack.attention.masks import text_slots

    assert [text_slots(n) for n in (0, 1, 2, 3, 4, 5, 9)] == [1, 1, 2, 4, 4, 8, 16]
    attn, L, slots = FlexAttnFunc("flex"), 5, 4
    rng = random.Random(9)
    counts = []
    for trial, n_eps in enumerate((3, 2, 4, 3, 1)):
        lens = [rng.randint(1, 6) for _ in range(n_eps)]
        lay = SequenceLayout.from_rows([lens], 30, text_len=[rng.randint(0, L) for _ in lens]).tokens(5, 2)
        q, k, v = qkv(lay.num_tokens, slots * L, dtype=torch.float32, seed=trial)
        prep = attn.prepare(lay, "text", text_tokens=L, text_slots=slots)
        assert prep.kv_len == slots * L
        with torch.no_grad():
            out = attn(q, k, v, prep)
        mask = dense_mask(prep.mask_mod, lay.num_tokens, slots * L)
        assert not mask[:, n_eps * L:].any(), "empty slots must be invisible"
        torch.testing.assert_close(out.double(), reference(q, k, v, mask), rtol=1e-4, atol=1e-4)
        counts.append(compile_count())
    assert len(set(counts[1:])) == 1, f"recompiled as the episode count changed: {counts}"
    lay = SequenceLayout.from_rows([[2, 2, 2]], 8, text_len=[1, 1, 1]).tokens()
    with pytest.raises(ValueError, match="text_slots=2 is fewer"):
        attn.prepare(lay, "text", text_tokens=L, text_slots=2)
