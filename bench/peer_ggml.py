"""The peer: the same workloads on real ggml, through ggml-python's C API (ctypes).

Each function builds its graph once in a ggml context, fills the inputs, and returns the best
wall time of `reps` calls to ggml_graph_compute_with_ctx, in seconds.
"""
import ctypes
import time

import numpy as np

import ggml

TYPES = {"F32": ggml.GGML_TYPE_F32, "F16": ggml.GGML_TYPE_F16, "Q4_0": ggml.GGML_TYPE_Q4_0,
         "Q8_0": ggml.GGML_TYPE_Q8_0, "Q4_K": ggml.GGML_TYPE_Q4_K}


def _ctx(mem_size):
    buf = (ctypes.c_uint8 * mem_size)()
    params = ggml.ggml_init_params(mem_size=mem_size, mem_buffer=ctypes.cast(buf, ctypes.c_void_p), no_alloc=False)
    return ggml.ggml_init(params), buf


def _fill_f32(t, x):
    dst = ctypes.cast(ggml.ggml_get_data(t), ctypes.POINTER(ctypes.c_float))
    ctypes.memmove(dst, np.ascontiguousarray(x, dtype=np.float32).ctypes.data, x.size * 4)


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


def _time(ctx, gf, n_threads, reps):
    ggml.ggml_graph_compute_with_ctx(ctx, gf, n_threads)  # warm-up
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        ggml.ggml_graph_compute_with_ctx(ctx, gf, n_threads)
        best = min(best, time.perf_counter() - t0)
    return best


def mul_mat(type_name, m, n, k, n_threads, reps=5, seed=0):
    """out[n, m] = mul_mat(W[m, k] of type_name, X[n, k] f32): seconds per compute."""
    rng = np.random.default_rng(seed)
    w = rng.uniform(-1, 1, (m, k)).astype(np.float32)
    x = rng.uniform(-1, 1, (n, k)).astype(np.float32)
    ctx, buf = _ctx(m * k * 4 + n * k * 4 + m * n * 4 + 64 * 1024 * 1024)
    a = ggml.ggml_new_tensor_2d(ctx, TYPES[type_name], k, m)
    b = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, k, n)
    out = ggml.ggml_mul_mat(ctx, a, b)
    gf = ggml.ggml_new_graph(ctx)
    ggml.ggml_build_forward_expand(gf, out)
    _fill_weights(a, type_name, w)
    _fill_f32(b, x)
    try:
        return _time(ctx, gf, n_threads, reps)
    finally:
        ggml.ggml_free(ctx)
        del buf


def add_chain(n_nodes, n_threads, reps=5, ne0=16):
    """A chain x = x + b repeated n_nodes times on tiny tensors: seconds per compute."""
    ctx, buf = _ctx(n_nodes * (ggml.ggml_tensor_overhead() + ne0 * 4 + 64) + ggml.ggml_graph_overhead_custom(n_nodes + 8, False) + (1 << 20))
    x = ggml.ggml_new_tensor_1d(ctx, ggml.GGML_TYPE_F32, ne0)
    b = ggml.ggml_new_tensor_1d(ctx, ggml.GGML_TYPE_F32, ne0)
    _fill_f32(x, np.ones(ne0, np.float32))
    _fill_f32(b, np.ones(ne0, np.float32))
    cur = x
    for _ in range(n_nodes):
        cur = ggml.ggml_add(ctx, cur, b)
    gf = ggml.ggml_new_graph_custom(ctx, n_nodes + 8, False)
    ggml.ggml_build_forward_expand(gf, cur)
    try:
        return _time(ctx, gf, n_threads, reps)
    finally:
        ggml.ggml_free(ctx)
        del buf


if __name__ == "__main__":
    for nt in (1, 2):
        print(f"threads={nt}")
        print("  F32 1024^3      ", f"{2 * 1024**3 / mul_mat('F32', 1024, 1024, 1024, nt) / 1e9:.1f} GFLOP/s")
        for t in ("Q4_0", "Q8_0", "Q4_K", "F16"):
            for n in (1, 32):
                print(f"  {t:5s} 4096x4096 n={n:2d}", f"{mul_mat(t, 4096, n, 4096, nt) * 1e3:.3f} ms")
        print("  add chain 1000  ", f"{add_chain(1000, nt) / 1000 * 1e6:.2f} us/node")
