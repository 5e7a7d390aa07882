#!/usr/bin/env python3
"""Fixture generator: real ggml's CPU computes every GLU kind on fixed inputs.

Writes tests/data/glu_ref.npz for tests/test_cpu_kernels.py: for each kind (REGLU, GEGLU, SWIGLU,
SWIGLU_OAI, GEGLU_ERF, GEGLU_QUICK), each type ggml's CPU computes it in (F32, F16; SWIGLU_OAI
F32 only) and each form (fused, fused and swapped, split), the inputs and ggml's output, all as
raw element bits (float32, or uint16 for F16), shaped (ne3, ne2, ne1, ne0). Gates and values are
uniform in [-12, 12], so GEGLU's thresholds at ±10 and SWIGLU_OAI's limit are crossed.
SWIGLU_OAI uses alpha = 1.702, limit = 7.

Needs ggml-python (ggml 0.15.3 in ggml-python 0.0.45, see README.md); from the repository root:

    $GGMLPY tests/ggml_ref/glu_ref.py

where $GGMLPY is that venv's python. The tests never need ggml-python.
"""
import ctypes
from pathlib import Path

import numpy as np
import ggml.ggml as g

OUT = Path(__file__).resolve().parent.parent / "data" / "glu_ref.npz"
KINDS = ["REGLU", "GEGLU", "SWIGLU", "SWIGLU_OAI", "GEGLU_ERF", "GEGLU_QUICK"]
ALPHA, LIMIT = 1.702, 7.0
NE = (33, 4, 3, 1)                   # fused: rows of 33 (odd: the last element is never read)


def new(ctx, typ, ne, values):
    t = g.ggml_new_tensor_4d(ctx, typ, *ne)
    arr = host(t, typ, ne)
    arr[...] = values
    return t


def host(t, typ, ne):
    ctype = ctypes.c_float if typ == g.GGML_TYPE_F32 else ctypes.c_uint16
    ptr = ctypes.cast(g.ggml_get_data(t), ctypes.POINTER(ctype))
    return np.ctypeslib.as_array(ptr, shape=tuple(reversed(ne)))


def bits(values, typ):
    v = values.astype(np.float32)
    return v if typ == g.GGML_TYPE_F32 else v.astype(np.float16).view(np.uint16)


def run(kind, typ, form, rng):
    op = getattr(g, f"GGML_GLU_OP_{kind}")
    ctx = g.ggml_init(g.ggml_init_params(mem_size=16 << 20, mem_buffer=None, no_alloc=False))
    ne_in = NE if form != "split" else (NE[0] // 2,) + NE[1:]
    x = bits(rng.uniform(-12, 12, tuple(reversed(ne_in))), typ)
    y = bits(rng.uniform(-12, 12, tuple(reversed(ne_in))), typ) if form == "split" else None
    a = new(ctx, typ, ne_in, x)
    b = new(ctx, typ, ne_in, y) if y is not None else None
    swapped = form == "swapped"
    if kind == "SWIGLU_OAI":
        out = g.ggml_swiglu_oai(ctx, a, b, ALPHA, LIMIT)
        out.contents.op_params[1] = int(swapped)          # ggml_glu_impl's swapped word
    elif b is None:
        out = g.ggml_glu(ctx, a, op, swapped)
    else:
        out = g.ggml_glu_split(ctx, a, b, op)
    gf = g.ggml_new_graph(ctx)
    g.ggml_build_forward_expand(gf, out)
    assert g.ggml_graph_compute_with_ctx(ctx, gf, 2) == 0
    ne_out = tuple(out.contents.ne[i] for i in range(4))
    got = host(out, typ, ne_out).copy()
    g.ggml_free(ctx)
    res = {"x": x, "out": got}
    if y is not None:
        res["y"] = y
    return res


def main():
    rng = np.random.default_rng(20261203)
    arrays = {}
    for kind in KINDS:
        for tname, typ in (("f32", g.GGML_TYPE_F32), ("f16", g.GGML_TYPE_F16)):
            if kind == "SWIGLU_OAI" and tname == "f16":
                continue                                   # ggml's CPU: F32 only
            for form in ("fused", "swapped", "split"):
                for k, v in run(kind, typ, form, rng).items():
                    arrays[f"{kind}/{tname}/{form}/{k}"] = v
    np.savez_compressed(OUT, **arrays)
    print(f"wrote {OUT}: {len(arrays)} arrays")


if __name__ == "__main__":
    main()
