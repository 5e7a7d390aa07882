#!/usr/bin/env python3
"""Fixture generator: what real ggml's GLU constructors record.

Writes tests/data/glu_ctor_ref.json for tests/test_ops.py: for each of ggml.h's sixteen GLU
shorthands (ggml_reglu ... ggml_swiglu_oai), the result's op, ne and its first four op_params
words, on a fused input of rows of 8 and on split inputs of rows of 4 (swiglu_oai with
alpha 1.702, limit 7).

Needs ggml-python (see README.md); from the repository root:

    $GGMLPY tests/ggml_ref/glu_ctor_ref.py
"""
import json
from pathlib import Path

import ggml.ggml as g

OUT = Path(__file__).resolve().parent.parent / "data" / "glu_ctor_ref.json"
KINDS = ["reglu", "geglu", "swiglu", "geglu_erf", "geglu_quick"]
FUSED = KINDS + [k + "_swapped" for k in KINDS]
SPLIT = [k + "_split" for k in KINDS]


def record(t):
    return {"op": int(t.contents.op), "ne": [int(t.contents.ne[i]) for i in range(4)],
            "op_params": [int(t.contents.op_params[i]) & 0xFFFFFFFF for i in range(4)]}


def main():
    params = g.ggml_init_params(mem_size=1 << 20, mem_buffer=None, no_alloc=True)
    ctx = g.ggml_init(params)
    a = g.ggml_new_tensor_2d(ctx, g.GGML_TYPE_F32, 8, 3)
    x = g.ggml_new_tensor_2d(ctx, g.GGML_TYPE_F32, 4, 3)
    y = g.ggml_new_tensor_2d(ctx, g.GGML_TYPE_F32, 4, 3)
    out = {name: record(getattr(g, "ggml_" + name)(ctx, a)) for name in FUSED}
    out.update({name: record(getattr(g, "ggml_" + name)(ctx, x, y)) for name in SPLIT})
    out["swiglu_oai"] = record(g.ggml_swiglu_oai(ctx, x, y, 1.702, 7.0))
    g.ggml_free(ctx)
    OUT.write_text(json.dumps({"ggml": "0.15.3", "constructors": out}, indent=1) + "\n")
    print(f"wrote {OUT} ({len(out)} constructors)")


if __name__ == "__main__":
    main()
