#!/usr/bin/env python3
"""Run a fixed list of tests/differential_graphs.py graphs through real ggml's CPU backend; write
what ggml computed to tests/data/differential_ref.{json,npz} (for tests/test_differential.py,
which never needs ggml-python).

The list: the graphs of `RandomChooser(seed)` for seeds 0, 1, 2, ... (every unary and GLU kind
allowed), the first N_FIRST of them, then further ones only where they add an op, a weight
type, a unary or GLU kind not yet in the list, skipping graphs whose tensors hold more than
MAX_BYTES. Each is built with ggml's C API (through ggml-python's ctypes bindings) exactly as
ggml_lite builds it: inputs in a no_alloc context placed by ggml_backend_alloc_ctx_tensors and
filled from the shared seeds (quantized inputs by ggml_quantize_chunk), the nodes placed by
ggml_gallocr_alloc_graph, computed by ggml_backend_graph_compute with the spec's thread count.
Stored per graph: the spec, whether ggml's supports_op accepts every node, and per tensor ne,
nb, view_src (index) and view_offs; the npz holds every root tensor's bytes after compute
(key c<graph>_t<tensor>).

To re-run (ggml-python 0.0.45 bundles ggml 0.15.3):

    python3 -m venv /tmp/ggmlpy && /tmp/ggmlpy/bin/pip install ggml-python==0.0.45 numpy
    GGML_NO_BACKTRACE=1 /tmp/ggmlpy/bin/python tests/ggml_ref/differential_ref.py

A larger check, not stored: `--first 2000 --out /tmp/diffbig` writes /tmp/diffbig.{json,npz};
`DIFFERENTIAL_FIXTURE=/tmp/diffbig pytest tests/test_differential.py -k ggml` then runs the
fixture tests on it.
"""
import argparse
import ctypes
import json
import sys
from pathlib import Path

import numpy as np

import ggml.ggml as g

TESTS = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(TESTS))
import differential_graphs as G  # noqa: E402

OUT_JSON = TESTS / "data" / "differential_ref.json"
OUT_NPZ = TESTS / "data" / "differential_ref.npz"
N_FIRST = 96
MAX_SEED = 3000
MAX_BYTES = 48 << 10


class GgmlApi:
    """ggml-python under ggml_lite's names (no prefix, Python strings, enums by name)."""

    def __getattr__(self, name):
        return getattr(g, f"ggml_{name}")

    @staticmethod
    def type(name):
        return getattr(g, f"GGML_TYPE_{name}")

    @staticmethod
    def unary_op(name):
        return getattr(g, f"GGML_UNARY_OP_{name}")

    @staticmethod
    def glu_op(name):
        return getattr(g, f"GGML_GLU_OP_{name}")

    @staticmethod
    def set_name(t, name):
        return g.ggml_set_name(t, name.encode())


API = GgmlApi()


def addr(p):
    return ctypes.cast(p, ctypes.c_void_p).value


def _ptr(a):
    return ctypes.c_void_p(a.ctypes.data)


def input_bytes(spec, i):
    t = spec["tensors"][i]
    data = G.input_data(spec, i)
    if t["type"] not in G.QUANTIZED:
        return G.plain_bytes(t["type"], data)
    rows = np.ascontiguousarray(data.reshape(-1, t["ne"][0]), np.float32)
    out = np.zeros(G.row_size(t["type"], t["ne"][0]) * rows.shape[0], np.uint8)
    g.ggml_quantize_chunk(API.type(t["type"]), rows.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                          _ptr(out), 0, rows.shape[0], rows.shape[1], None)
    return out


def run(spec):
    ents = spec["tensors"]
    n = len(ents)
    backend = g.ggml_backend_cpu_init()
    g.ggml_backend_cpu_set_n_threads(backend, spec["n_threads"])
    mem = (n + 8) * g.ggml_tensor_overhead()
    ctx_in = g.ggml_init(g.ggml_init_params(mem_size=mem, mem_buffer=None, no_alloc=True))
    ctx_gr = g.ggml_init(g.ggml_init_params(mem_size=mem + g.ggml_graph_overhead(), mem_buffer=None,
                                            no_alloc=True))
    ts = G.build(API, spec, ctx_in, ctx_gr)
    gf = g.ggml_new_graph(ctx_gr)
    nodes = G.compute_nodes(spec)
    for i in nodes:
        g.ggml_build_forward_expand(gf, ts[i])
    refused = [i for i in range(n) if ents[i]["op"] != "INPUT" and not g.ggml_backend_supports_op(backend, ts[i])]
    result = {"spec": spec, "supported": not refused, "refused": refused, "tensors": []}
    raws = {}
    if not refused:
        buf = g.ggml_backend_alloc_ctx_tensors(ctx_in, backend)
        for i, t in enumerate(ents):
            if t["op"] == "INPUT":
                raw = input_bytes(spec, i)
                assert raw.size == g.ggml_nbytes(ts[i]), (i, raw.size, g.ggml_nbytes(ts[i]))
                g.ggml_backend_tensor_set(ts[i], _ptr(raw), 0, raw.size)
        galloc = g.ggml_gallocr_new(g.ggml_backend_get_default_buffer_type(backend))
        assert g.ggml_gallocr_alloc_graph(galloc, gf)
        assert g.ggml_backend_graph_compute(backend, gf) == 0
        index = {addr(t): i for i, t in enumerate(ts)}
        for i, t in enumerate(ts):
            c = t.contents
            vs = addr(c.view_src) if c.view_src else None
            result["tensors"].append({"ne": list(c.ne), "nb": list(c.nb),
                                      "view_src": index[vs] if vs else None,
                                      "view_offs": c.view_offs if vs else 0})
            if not vs:
                raw = np.zeros(g.ggml_nbytes(t), np.uint8)
                g.ggml_backend_tensor_get(t, _ptr(raw), 0, raw.size)
                raws[i] = raw
        g.ggml_gallocr_free(galloc)
        g.ggml_backend_buffer_free(buf)
    g.ggml_free(ctx_gr)
    g.ggml_free(ctx_in)
    g.ggml_backend_free(backend)
    return result, raws


def features(spec):
    out = set()
    for t in spec["tensors"]:
        out.add(t["op"])
        if t["op"] == "MUL_MAT":
            out.add("MUL_MAT/" + spec["tensors"][t["src"][0]]["type"])
        if t["op"] == "GET_ROWS":
            out.add("GET_ROWS/" + spec["tensors"][t["src"][0]]["type"])
        if t["op"] == "UNARY":
            out.add(f"UNARY/{t['p']['kind']}")
        if t["op"] == "GLU":
            out.add(f"GLU/{t['p']['kind']}/" + ("fused" if t["src"][1] is None else "split"))
        if t["op"] in G.BINARY + ("ROPE", "UNARY", "GLU", "SOFT_MAX"):
            out.add(f"{t['op']}/{t['type']}/" + "/".join(spec["tensors"][j]["type"] for j in t["src"] if j is not None))
        if t["op"] == "CPY":
            out.add(f"CPY/{t['src_type']}/{t['type']}")
    return out


def size(spec):
    return sum(G.row_size(t["type"], t["ne"][0]) * t["ne"][1] * t["ne"][2] * t["ne"][3] for t in spec["tensors"])


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--first", type=int, default=N_FIRST, help="graphs taken before only new features count")
    ap.add_argument("--out", type=Path, default=None,
                    help="write OUT.json and OUT.npz instead of the fixtures (a larger check run)")
    args = ap.parse_args()
    out_json, out_npz = (OUT_JSON, OUT_NPZ) if args.out is None else \
        (args.out.with_suffix(".json"), args.out.with_suffix(".npz"))
    chosen, seen = [], set()
    for seed in range(max(MAX_SEED, 2 * args.first)):
        spec = G.generate(G.RandomChooser(seed))
        if size(spec) > MAX_BYTES:
            continue
        f = features(spec)
        if len(chosen) < args.first or f - seen:
            chosen.append(spec)
            seen |= f
    cases, arrays = [], {}
    for k, spec in enumerate(chosen):
        result, raws = run(spec)
        cases.append(result)
        for i, raw in raws.items():
            arrays[f"c{k}_t{i}"] = raw
        if not result["supported"]:
            print(f"case {k}: ggml's CPU backend refuses nodes {result['refused']}", flush=True)
    out_json.write_text(json.dumps({"ggml": "0.15.3", "features": sorted(seen), "cases": cases}) + "\n")
    np.savez_compressed(out_npz, **arrays)
    print(f"wrote {out_json} and {out_npz}: {len(cases)} graphs, {len(seen)} features")


if __name__ == "__main__":
    main()
