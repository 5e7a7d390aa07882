"""The peer: the same workloads on real ggml, through ggml-python's C API (ctypes).

Each workload builds its graph once in a ggml context, fills the inputs (weights quantized by
ggml's own ggml_quantize_chunk), makes the plan once with ggml_graph_plan (work buffer allocated
here, once), and times ggml_graph_compute(gf, &plan): the same reuse as the ggml_lite side.
ggml-python's ggml is built with OpenMP: n_threads threads of an OpenMP team run each compute.

    python bench/peer_ggml.py [--quick]      # a table on its own, 1 and 2 threads
"""
import ctypes
import sys
from pathlib import Path

import numpy as np

import ggml

sys.path.insert(0, str(Path(__file__).parent))
from common import activations, measure, nmse, reference, weights, workloads  # noqa: E402

TYPES = {"F32": ggml.GGML_TYPE_F32, "F16": ggml.GGML_TYPE_F16, "Q4_0": ggml.GGML_TYPE_Q4_0,
         "Q8_0": ggml.GGML_TYPE_Q8_0, "Q4_K": ggml.GGML_TYPE_Q4_K, "Q6_K": ggml.GGML_TYPE_Q6_K}


def info():
    """What ggml this is and what it was built with."""
    has = {f: bool(getattr(ggml, f"ggml_cpu_has_{f}")()) for f in ("avx2", "avx512", "f16c", "fma")}
    lib = Path(ggml.__file__).parent / "lib" / "libggml-cpu.so"
    openmp = lib.exists() and b"GOMP_parallel" in lib.read_bytes()
    return dict(ggml_python=getattr(ggml, "__version__", None), ggml_version=_str(ggml.ggml_version()),
                ggml_commit=_str(ggml.ggml_commit()), cpu_features=has, openmp=openmp)


def _str(s):
    return s.decode() if isinstance(s, bytes) else s


def _ctx(mem_size):
    buf = (ctypes.c_uint8 * mem_size)()
    params = ggml.ggml_init_params(mem_size=mem_size, mem_buffer=ctypes.cast(buf, ctypes.c_void_p), no_alloc=False)
    return ggml.ggml_init(params), buf


def _fill_f32(t, x):
    dst = ctypes.cast(ggml.ggml_get_data(t), ctypes.POINTER(ctypes.c_float))
    ctypes.memmove(dst, np.ascontiguousarray(x, dtype=np.float32).ctypes.data, x.size * 4)


def _read_f32(t, shape):
    p = ctypes.cast(ggml.ggml_get_data(t), ctypes.POINTER(ctypes.c_float))
    return np.ctypeslib.as_array(p, shape=shape).copy()


def _fill_weights(t, type_name, w):
    """Quantize (or convert) float weights into t with ggml's own ggml_quantize_chunk."""
    w = np.ascontiguousarray(w, dtype=np.float32)
    if type_name == "F32":
        _fill_f32(t, w)
    elif type_name == "F16":
        data = w.astype(np.float16)
        ctypes.memmove(ggml.ggml_get_data(t), data.ctypes.data, data.nbytes)
    else:
        nrows, n = w.shape
        ggml.ggml_quantize_chunk(TYPES[type_name], w.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                 ggml.ggml_get_data(t), 0, nrows, n, None)


class _Plan:
    """ggml_graph_plan once, its work buffer allocated once; __call__ = one ggml_graph_compute."""

    def __init__(self, gf, n_threads):
        self.gf = gf
        self.plan = ggml.ggml_graph_plan(gf, n_threads, None)
        self.work = (ctypes.c_uint8 * max(1, self.plan.work_size))()
        self.plan.work_data = ctypes.cast(self.work, ctypes.POINTER(ctypes.c_uint8))

    def __call__(self):
        status = ggml.ggml_graph_compute(self.gf, ctypes.byref(self.plan))
        if status != 0:
            raise RuntimeError(f"ggml_graph_compute returned status {status}")


def mul_mat(type_name, m, n, k, n_threads, quick=False, w=None):
    """out[n, m] = mul_mat(W[m, k] of type_name, X[n, k] f32): a measurement (see common.measure)."""
    w = weights(m, k) if w is None else w
    x = activations(n, k)
    rs = ggml.ggml_row_size(TYPES[type_name], k)
    ctx, buf = _ctx(rs * m + n * k * 4 + m * n * 4 + 8 * ggml.ggml_tensor_overhead() + ggml.ggml_graph_overhead() + (1 << 20))
    try:
        a = ggml.ggml_new_tensor_2d(ctx, TYPES[type_name], k, m)
        b = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, k, n)
        out = ggml.ggml_mul_mat(ctx, a, b)
        gf = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(gf, out)
        _fill_weights(a, type_name, w)
        _fill_f32(b, x)
        compute = _Plan(gf, n_threads)
        r = measure(compute, quick)
        r["work_size"] = compute.plan.work_size
        r["nmse_vs_f32"] = nmse(_read_f32(out, (n, m)), reference(w, x))
        return r
    finally:
        ggml.ggml_free(ctx)
        del buf


def add_chain(n_nodes, ne0, n_threads, quick=False):
    """x = x + b repeated n_nodes times on vectors of ne0 floats: a measurement of the whole graph."""
    ctx, buf = _ctx((n_nodes + 4) * (ggml.ggml_tensor_overhead() + ne0 * 4 + 64)
                    + ggml.ggml_graph_overhead_custom(n_nodes + 8, False) + (1 << 20))
    try:
        x = ggml.ggml_new_tensor_1d(ctx, ggml.GGML_TYPE_F32, ne0)
        b = ggml.ggml_new_tensor_1d(ctx, ggml.GGML_TYPE_F32, ne0)
        _fill_f32(x, np.ones(ne0, np.float32))
        _fill_f32(b, np.ones(ne0, np.float32))
        cur = x
        for _ in range(n_nodes):
            cur = ggml.ggml_add(ctx, cur, b)
        gf = ggml.ggml_new_graph_custom(ctx, n_nodes + 8, False)
        ggml.ggml_build_forward_expand(gf, cur)
        compute = _Plan(gf, n_threads)
        r = measure(compute, quick)
        r["check"] = float(_read_f32(cur, (ne0,))[0]) == 1.0 + n_nodes
        return r
    finally:
        ggml.ggml_free(ctx)
        del buf


def run(n_threads, quick=False):
    """Every workload of common.workloads() at n_threads: {key: measurement}."""
    res, cache = {}, {}
    for wl in workloads():
        if wl["kind"] == "mul_mat":
            w = cache.setdefault((wl["m"], wl["k"]), weights(wl["m"], wl["k"]))
            res[wl["key"]] = mul_mat(wl["type"], wl["m"], wl["n"], wl["k"], n_threads, quick, w)
        else:
            res[wl["key"]] = add_chain(wl["n_nodes"], wl["ne0"], n_threads, quick)
    return res


if __name__ == "__main__":
    print(info())
    for nt in (1, 2):
        for key, r in run(nt, quick="--quick" in sys.argv).items():
            print(f"threads={nt}  {key:32s} {r['best'] * 1e3:9.3f} ms  (foreign load {r['foreign_load']})")
