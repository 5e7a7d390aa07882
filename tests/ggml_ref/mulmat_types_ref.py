"""Fixture for tests/test_cpu_kernels.py: ggml 0.15.3's CPU mul_mat of Q5_0, Q5_1, Q2_K, Q3_K and
Q5_K weights.

Runs under ggml-python alone (numpy and ggml, no ggml_lite): seeded standard-normal weights of 128
rows, quantized by ggml's own `ggml_quantize_chunk`, with row lengths 256 and 640 (Q5_0, Q5_1) or
256 and 768 (the K-quants), times 1, 4 and 20 seeded activation columns, computed by ggml's CPU
mul_mat (`ggml_graph_compute_with_ctx`) with 1 and with 2 threads. The script checks that both
thread counts give the same bits and stores, per type and row length, the weights' bytes, the
activations and the 1-, 4- and 20-column products in tests/data/mulmat_types_ref.npz:

    $GGMLPY tests/ggml_ref/mulmat_types_ref.py
"""
import ctypes
import sys
from pathlib import Path

import ggml
import numpy as np

CASES = {"Q5_0": (256, 640), "Q5_1": (256, 640), "Q2_K": (256, 768), "Q3_K": (256, 768),
         "Q5_K": (256, 768)}
N, COLS = 128, (1, 4, 20)
OUT = Path(__file__).resolve().parents[1] / "data" / "mulmat_types_ref.npz"


def quantize(t, w):
    """w (rows, k) float32 -> the bytes of ggml_quantize_chunk (no importance matrix)."""
    gt = getattr(ggml, f"GGML_TYPE_{t}")
    rows, k = w.shape
    rs = ggml.ggml_row_size(gt, k)
    out = np.zeros((rows, rs), np.uint8)
    done = ggml.ggml_quantize_chunk(gt, w.ctypes.data_as(ctypes.POINTER(ctypes.c_float)),
                                    out.ctypes.data_as(ctypes.c_void_p), 0, rows, k, None)
    assert done == out.nbytes, (done, out.nbytes)
    return out


def mul_mat(t, q, x, nth):
    """ggml_mul_mat(q as type t [k, N], x [k, m]) on ggml's CPU with nth threads: (m, N) float32."""
    m, k = x.shape
    ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=64 * 2**20, mem_buffer=None, no_alloc=False))
    a = ggml.ggml_new_tensor_2d(ctx, getattr(ggml, f"GGML_TYPE_{t}"), k, q.shape[0])
    b = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, k, m)
    ctypes.memmove(ggml.ggml_get_data(a), q.ctypes.data, q.nbytes)
    ctypes.memmove(ggml.ggml_get_data(b), x.ctypes.data, x.nbytes)
    c = ggml.ggml_mul_mat(ctx, a, b)
    gf = ggml.ggml_new_graph(ctx)
    ggml.ggml_build_forward_expand(gf, c)
    ggml.ggml_graph_compute_with_ctx(ctx, gf, nth)
    out = ctypes.cast(ggml.ggml_get_data(c), ctypes.POINTER(ctypes.c_float))
    res = np.ctypeslib.as_array(out, shape=(m, q.shape[0])).copy()
    ggml.ggml_free(ctx)
    return res


def main():
    rng = np.random.default_rng(2026)
    data = {}
    for t, ks in CASES.items():
        for k in ks:
            w = rng.standard_normal((N, k)).astype(np.float32)
            x = rng.standard_normal((max(COLS), k)).astype(np.float32)
            q = quantize(t, w)
            data[f"{t}_{k}_w"], data[f"{t}_{k}_x"] = q, x
            for m in COLS:
                one, two = mul_mat(t, q, x[:m], 1), mul_mat(t, q, x[:m], 2)
                assert np.array_equal(one.view(np.uint32), two.view(np.uint32)), (t, k, m)
                data[f"{t}_{k}_out{m}"] = one
    np.savez_compressed(OUT, **data)
    print(f"wrote {OUT}")


if __name__ == "__main__":
    sys.exit(main())
