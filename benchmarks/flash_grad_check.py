"""Does FlexAttention's FLASH (FA4) backend give correct gradients on our document masks?

Compares FLASH and Triton flex gradients with a float64 reference, for block masks from
``FlexAttnFunc`` and from ``create_block_mask``, at head dims 16 and 128. CUDA only; prints a
table and writes JSON to $OUT (or the current folder).
"""

import json
import os
import random

import torch
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from flexpack.attention.flex import FlexAttnFunc
from flexpack.attention.masks import dense_mask, make_mask
from flexpack.packing.layout import SequenceLayout


def ref(q, k, v, mask):
    s = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    has = mask.any(-1, keepdim=True)
    s = s.masked_fill(~mask, float("-inf")).masked_fill(~has, 0.0)
    return (s.softmax(-1) * has) @ v


def main() -> None:
    rng = random.Random(0)
    lens = [rng.randint(20, 90) for _ in range(6)]
    lay = SequenceLayout.from_rows([lens], sum(lens) + 37).tokens(5, 2).to("cuda")
    T = lay.num_tokens
    mod = make_mask(lay, "document")
    dense = dense_mask(mod, T, T, "cuda")
    ours = FlexAttnFunc("flex").prepare(lay, "document").block_mask()
    theirs = create_block_mask(mod, None, None, T, T, device="cuda")
    rows = []
    for D in (16, 128):
        g = torch.Generator(device="cuda").manual_seed(D)
        q, k, v = (torch.randn(1, 4, T, D, device="cuda", generator=g) for _ in range(3))
        w = torch.randn(1, 4, T, D, device="cuda", generator=g)
        q64, k64, v64 = (t.double().requires_grad_(True) for t in (q, k, v))
        (ref(q64, k64, v64, dense) * w.double()).sum().backward()
        for name, bm in (("ours", ours), ("create_block_mask", theirs)):
            for backend, opts in (("triton", None), ("flash", {"BACKEND": "FLASH"})):
                qb, kb, vb = (t.bfloat16().requires_grad_(True) for t in (q, k, v))
                try:
                    out = torch.compile(flex_attention, dynamic=False)(qb, kb, vb, block_mask=bm, kernel_options=opts)
                    (out.float() * w).sum().backward()
                    err = {n: float((a.grad.double() - b.grad).norm() / b.grad.norm())
                           for n, a, b in (("dq", qb, q64), ("dk", kb, k64), ("dv", vb, v64))}
                except Exception as e:  # report, do not hide
                    err = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
                rows.append({"D": D, "mask": name, "backend": backend, **err})
                print(rows[-1], flush=True)
    path = os.path.join(os.environ.get("OUT", "."), "flash_grad_check.json")
    with open(path, "w") as f:
        json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
