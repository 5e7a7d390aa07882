#!/usr/bin/env python3
"""What real ggml's BLAS device answers to supports_op on a grid of nodes; written to
tests/data/blas_ref.json for tests/test_backend.py, which builds the same nodes with ggml_lite
(through `build`, below) and compares. Importing this module does not import ggml.

The grid (`cases()`): MUL_MAT with every weight type ggml_lite has and I32 (no to_float), at
shapes around ggml-blas's `min_batch = 32` on each of ne0 (= src0.ne1), ne1 (= src1.ne1) and
ne10 (the shared row length); src1 F32 and F16; contiguous, strided, permuted and transposed
operands; batched and broadcast weights. OUT_PROD in F32 and F16, matrices and not, contiguous,
transposed and strided. The view ops and a few ops BLAS does not compute.

To re-run, with a ggml-python built with BLAS (see next to it in README.md; ggml-python 0.0.45
bundles ggml 0.15.3), from the repository root:

    GGML_NO_BACKTRACE=1 $GGMLPY tests/ggml_ref/blas_ref.py

where $GGMLPY is that venv's python.
"""
import json
import sys
from pathlib import Path

OUT = Path(__file__).parent.parent / "data" / "blas_ref.json"

MM_TYPES = ["F32", "F16", "BF16", "Q4_0", "Q4_1", "Q8_0", "Q8_1", "Q4_K", "Q6_K", "Q8_K", "I32"]
BLOCK = {"Q4_0": 32, "Q4_1": 32, "Q8_0": 32, "Q8_1": 32, "Q4_K": 256, "Q6_K": 256, "Q8_K": 256}


def cases():
    """Each case: a dict {op, a: operand, b: operand} (an operand: type, ne, layout)."""
    out = []

    def mm(t, K, M, N, a_layout="contiguous", b_layout="contiguous", b_type="F32", wb=(1, 1), xb=(1, 1)):
        out.append({"op": "MUL_MAT", "a": {"type": t, "ne": [K, M, *wb], "layout": a_layout},
                    "b": {"type": b_type, "ne": [K, N, *xb], "layout": b_layout}})

    edges = [1, 31, 32, 33, 64]
    for K in edges:                          # F32: every combination around the boundary
        for M in edges:
            for N in edges:
                mm("F32", K, M, N)
    for t in MM_TYPES[1:]:
        K = BLOCK.get(t, 32)
        for M in (31, 32, 33):
            for N in (1, 31, 32, 33):
                mm(t, K, M, N)
        if K == 32:
            mm(t, 64, 32, 32)
    for K in (31, 32, 33):                    # the shared length of non-block types
        mm("F16", K, 40, 40)
        mm("BF16", K, 40, 40)
    for t in ("F32", "F16", "Q4_0"):
        mm(t, 64, 40, 40, b_type="F16")
        mm(t, 64, 40, 40, a_layout="strided")
        mm(t, 64, 40, 40, a_layout="permuted", wb=(2, 3), xb=(2, 3))
        mm(t, 64, 40, 40, b_layout="transposed")
        mm(t, 64, 40, 40, b_layout="strided")
        mm(t, 64, 40, 40, b_layout="permuted", wb=(2, 3), xb=(2, 3))
        mm(t, 64, 40, 40, wb=(2, 1), xb=(4, 3))
        mm(t, 64, 40, 40, wb=(1, 2), xb=(3, 2))
        mm(t, 64, 40, 1, wb=(2, 1), xb=(4, 3))

    def op2(t0, ne0, t1, ne1, l0="contiguous", l1="contiguous"):
        out.append({"op": "OUT_PROD", "a": {"type": t0, "ne": ne0, "layout": l0},
                    "b": {"type": t1, "ne": ne1, "layout": l1}})

    for t0 in ("F32", "F16", "Q8_0"):
        for t1 in ("F32", "F16"):
            op2(t0, [64, 40, 1, 1], t1, [48, 40, 1, 1])
    op2("F32", [8, 4, 1, 1], "F32", [6, 4, 1, 1])        # no size rule for OUT_PROD
    op2("F32", [64, 40, 1, 1], "F32", [48, 40, 1, 1], l1="transposed")
    op2("F32", [64, 40, 1, 1], "F32", [48, 40, 1, 1], l1="strided")
    op2("F32", [64, 40, 1, 1], "F32", [48, 40, 1, 1], l0="strided")
    op2("F32", [64, 40, 2, 1], "F32", [48, 40, 2, 1])
    op2("F32", [64, 40, 1, 1], "F32", [48, 40, 3, 1])
    for name in ("ADD", "MUL", "SCALE", "CPY", "SOFT_MAX", "NONE", "VIEW", "RESHAPE", "PERMUTE", "TRANSPOSE"):
        out.append({"op": name, "a": {"type": "F32", "ne": [64, 64, 1, 1], "layout": "contiguous"},
                    "b": {"type": "F32", "ne": [64, 64, 1, 1], "layout": "contiguous"}})
    return out


def case_id(c):
    a, b = c["a"], c["b"]
    return (f"{c['op']}-{a['type']}{a['ne']}{a['layout'][:5]}-{b['type']}{b['ne']}{b['layout'][:5]}"
            .replace(" ", ""))


def operand(api, ctx, d):
    """An operand as its layout says: contiguous; strided (rows of a twice-as-wide tensor);
    permuted (dims 2 and 3 swapped); transposed (the transpose of a contiguous [ne1, ne0])."""
    T = getattr(api.Type, d["type"])
    ne0, ne1, ne2, ne3 = d["ne"]
    layout = d["layout"]
    if layout == "contiguous":
        return api.new_tensor_4d(ctx, T, ne0, ne1, ne2, ne3)
    if layout == "strided":
        big = api.new_tensor_4d(ctx, T, 2 * ne0, ne1, ne2, ne3)
        nb = big.contents.nb if hasattr(big, "contents") else big.nb      # ggml-python: a pointer
        return api.view_4d(ctx, big, ne0, ne1, ne2, ne3, nb[1], nb[2], nb[3], 0)
    if layout == "permuted":
        return api.permute(ctx, api.new_tensor_4d(ctx, T, ne0, ne1, ne3, ne2), 0, 1, 3, 2)
    if layout == "transposed":
        return api.transpose(ctx, api.new_tensor_4d(ctx, T, ne1, ne0, ne2, ne3))
    raise ValueError(layout)


def build(api, c, out_prod):
    """The case's node, built with api (ggml_lite, or graph_ref's GgmlPy wrapper of ggml-python);
    out_prod(ctx, a, b) makes an OUT_PROD node (ggml_lite has no constructor for it)."""
    ctx = api.init(16 * api.tensor_overhead(), None, True)
    a, b = operand(api, ctx, c["a"]), operand(api, ctx, c["b"])
    op = c["op"]
    node = {"MUL_MAT": lambda: api.mul_mat(ctx, a, b), "OUT_PROD": lambda: out_prod(ctx, a, b),
            "ADD": lambda: api.add(ctx, a, b), "MUL": lambda: api.mul(ctx, a, b),
            "SCALE": lambda: api.scale(ctx, a, 2.0), "CPY": lambda: api.cpy(ctx, a, b),
            "SOFT_MAX": lambda: api.soft_max(ctx, a), "NONE": lambda: a,
            "VIEW": lambda: api.view_1d(ctx, a, 64, 0), "RESHAPE": lambda: api.reshape_1d(ctx, a, 64 * 64),
            "PERMUTE": lambda: api.permute(ctx, a, 1, 0, 2, 3), "TRANSPOSE": lambda: api.transpose(ctx, a)}[op]()
    return ctx, node


def main():
    import ggml.ggml as g
    sys.path.insert(0, str(Path(__file__).parent))
    from graph_ref import GgmlPy

    dev = g.ggml_backend_dev_by_name(b"BLAS")
    if not dev:
        sys.exit("this ggml-python has no BLAS device: build it with -DGGML_BLAS=ON (README.md)")
    api = GgmlPy()
    answers, keep = [], []
    for c in cases():
        ctx, node = build(api, c, g.ggml_out_prod)
        answers.append({"case": c, "id": case_id(c), "supports_op": bool(g.ggml_backend_dev_supports_op(dev, node))})
        keep.append(ctx)
    ref = {"ggml": "0.15.3 (ggml-python 0.0.45, GGML_BLAS=ON, OpenBLAS)", "device": "BLAS", "cases": answers}
    head = json.dumps({k: v for k, v in ref.items() if k != "cases"})[:-1]
    OUT.write_text(head + ', "cases": [\n' + ",\n".join(json.dumps(a) for a in answers) + "\n]}\n")
    print(f"wrote {OUT}: {len(answers)} cases, {sum(a['supports_op'] for a in answers)} supported")


if __name__ == "__main__":
    main()
