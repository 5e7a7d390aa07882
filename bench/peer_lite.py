"""The ggml_lite side: the same graphs as peer_ggml.py, built with ggml_lite's API.

Each workload builds its graph once, fills the weights with `t.numpy()[...] =
ggml.quantize_chunk(type, w)`, makes the plan once (`ggml.graph_plan(gf, n_threads)`, its work
buffer allocated once), and times `ggml.graph_compute(gf, plan)`: a graph computed again and again
with one plan, as a user who reuses a graph does. The warm-up calls of common.measure absorb numba's
compile (or cache load) and the start of the thread pool.
"""
import sys
from pathlib import Path

import numpy as np

import ggml_lite as ggml

sys.path.insert(0, str(Path(__file__).parent))
from common import activations, measure, nmse, reference, weights, workloads  # noqa: E402


def _fill(t, data):
    """Copy the bytes of data (already in t's storage format) into t."""
    arr = t.numpy()
    arr.reshape(-1).view(np.uint8)[:] = np.ascontiguousarray(data).reshape(-1).view(np.uint8)


def _packed(type_name, w):
    if type_name == "F32":
        return w
    if type_name == "F16":
        return w.astype(np.float16)
    return ggml.quantize_chunk(ggml.Type[type_name], w)


def _plan(gf, n_threads):
    plan = ggml.graph_plan(gf, n_threads)
    plan.work_data = np.zeros(plan.work_size, np.uint8)
    return plan


def mul_mat(type_name, m, n, k, n_threads, quick=False, w=None, packed=None):
    w = weights(m, k) if w is None else w
    packed = _packed(type_name, w) if packed is None else packed
    x = activations(n, k)
    t = ggml.Type[type_name]
    mem = ggml.row_size(t, k) * m + n * k * 4 + m * n * 4 + 8 * ggml.tensor_overhead() + ggml.graph_overhead() + (1 << 20)
    ctx = ggml.init(mem_size=mem)
    try:
        a = ggml.new_tensor_2d(ctx, t, k, m)
        b = ggml.new_tensor_2d(ctx, ggml.Type.F32, k, n)
        out = ggml.mul_mat(ctx, a, b)
        gf = ggml.new_graph(ctx)
        ggml.build_forward_expand(gf, out)
        _fill(a, packed)
        _fill(b, x)
        plan = _plan(gf, n_threads)
        r = measure(lambda: ggml.graph_compute(gf, plan), quick)
        r["work_size"] = int(plan.work_size)
        r["nmse_vs_f32"] = nmse(out.numpy().reshape(n, m), reference(w, x))
        return r
    finally:
        ggml.free(ctx)


def add_chain(n_nodes, ne0, n_threads, quick=False):
    mem = (n_nodes + 4) * (ggml.tensor_overhead() + ne0 * 4 + 64) + ggml.graph_overhead_custom(n_nodes + 8) + (1 << 20)
    ctx = ggml.init(mem_size=mem)
    try:
        x = ggml.new_tensor_1d(ctx, ggml.Type.F32, ne0)
        b = ggml.new_tensor_1d(ctx, ggml.Type.F32, ne0)
        x.numpy()[...] = 1.0
        b.numpy()[...] = 1.0
        cur = x
        for _ in range(n_nodes):
            cur = ggml.add(ctx, cur, b)
        gf = ggml.new_graph_custom(ctx, n_nodes + 8)
        ggml.build_forward_expand(gf, cur)
        plan = _plan(gf, n_threads)
        r = measure(lambda: ggml.graph_compute(gf, plan), quick)
        r["check"] = float(cur.numpy().reshape(-1)[0]) == 1.0 + n_nodes
        return r
    finally:
        ggml.free(ctx)


def run(n_threads, quick=False):
    res, cache = {}, {}
    for wl in workloads():
        if wl["kind"] == "mul_mat":
            w = cache.setdefault((wl["m"], wl["k"]), weights(wl["m"], wl["k"]))
            packed = cache.setdefault((wl["type"], wl["m"], wl["k"]), _packed(wl["type"], w))
            res[wl["key"]] = mul_mat(wl["type"], wl["m"], wl["n"], wl["k"], n_threads, quick, w, packed)
        else:
            res[wl["key"]] = add_chain(wl["n_nodes"], wl["ne0"], n_threads, quick)
    return res


if __name__ == "__main__":
    for nt in (1, 2):
        for key, r in run(nt, quick="--quick" in sys.argv).items():
            print(f"threads={nt}  {key:32s} {r['best'] * 1e3:9.3f} ms  (foreign load {r['foreign_load']})")
