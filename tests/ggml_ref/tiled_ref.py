"""Fixture for tests/test_cpu_kernels.py: ggml's tiled K-quant product (src/ggml-cpu/tiled/, ggml
0.25.3, the ggml of llama-cpp-python 0.3.36), which ggml 0.15.3 does not have.

Runs ggml through ctypes, from the libraries llama-cpp-python installs (built for AVX2 without
`-march=native`: CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON
-DGGML_F16C=ON -DGGML_BMI2=ON"); numpy only besides. The weights and activations are those of
tests/data/mulmat_types_ref.npz (Q2_K, Q3_K, Q5_K, rows of 256 and 768, quantized by ggml) and
tests/data/llama_mulmat_ref.npz (Q4_K and Q6_K, rows of 256): each times its first 8 and its 20
activation columns with 1 and 2 threads (the script checks that both give the same bits, and that
the tiled row differs from the one-column dot product), and, in a second process with
GGML_CPU_TILED_MM_FORCE=1, times 4 columns. The products only are stored, in tests/data/tiled_ref.npz
(the operands stay in the two fixtures they come from):

    $LLAMAPY tests/ggml_ref/tiled_ref.py        # $LLAMAPY: the python of that llama-cpp-python
"""
import ctypes as C
import os
import subprocess
import sys
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "data"
OUT = DATA / "tiled_ref.npz"
TYPE_ID = {"Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14}


def load_ggml():
    import llama_cpp
    lib = Path(llama_cpp.__file__).parent / "lib"
    base = C.CDLL(str(lib / "libggml-base.so"), mode=C.RTLD_GLOBAL)
    cpu = C.CDLL(str(lib / "libggml-cpu.so"), mode=C.RTLD_GLOBAL)
    vp = C.c_void_p

    class Params(C.Structure):
        _fields_ = [("mem_size", C.c_size_t), ("mem_buffer", vp), ("no_alloc", C.c_bool)]
    base.ggml_init.restype, base.ggml_init.argtypes = vp, [Params]
    base.ggml_free.argtypes = [vp]
    base.ggml_new_tensor_2d.restype = vp
    base.ggml_new_tensor_2d.argtypes = [vp, C.c_int, C.c_int64, C.c_int64]
    base.ggml_mul_mat.restype, base.ggml_mul_mat.argtypes = vp, [vp, vp, vp]
    base.ggml_new_graph.restype, base.ggml_new_graph.argtypes = vp, [vp]
    base.ggml_build_forward_expand.argtypes = [vp, vp]
    base.ggml_get_data.restype, base.ggml_get_data.argtypes = vp, [vp]
    cpu.ggml_graph_compute_with_ctx.argtypes = [vp, vp, C.c_int]
    return base, cpu, Params


def mul_mat(g, t, w, x, nth):
    """ggml_mul_mat(w as type t [k, rows], x [k, m]) on ggml's CPU: (m, rows) float32."""
    base, cpu, Params = g
    (m, k), rows = x.shape, w.shape[0]
    ctx = base.ggml_init(Params(64 << 20, None, False))
    a = base.ggml_new_tensor_2d(ctx, TYPE_ID[t], k, rows)
    b = base.ggml_new_tensor_2d(ctx, 0, k, m)
    C.memmove(base.ggml_get_data(a), w.ctypes.data, w.nbytes)
    C.memmove(base.ggml_get_data(b), np.ascontiguousarray(x, np.float32).ctypes.data, x.nbytes)
    y = base.ggml_mul_mat(ctx, a, b)
    gf = base.ggml_new_graph(ctx)
    base.ggml_build_forward_expand(gf, y)
    assert cpu.ggml_graph_compute_with_ctx(ctx, gf, nth) == 0
    out = np.empty((m, rows), np.float32)
    C.memmove(out.ctypes.data, base.ggml_get_data(y), out.nbytes)
    base.ggml_free(ctx)
    return out


def cases():
    types_ref, llama_ref = np.load(DATA / "mulmat_types_ref.npz"), np.load(DATA / "llama_mulmat_ref.npz")
    for t in ("Q2_K", "Q3_K", "Q5_K"):
        for k in (256, 768):
            yield f"{t}_{k}", t, types_ref[f"{t}_{k}_w"], types_ref[f"{t}_{k}_x"]
    for t in ("Q4_K", "Q6_K"):
        yield f"{t}_256", t, llama_ref[t], llama_ref["x"]


def main():
    g = load_ggml()
    if sys.argv[1:] == ["--forced"]:      # a process of its own: ggml reads the switch once
        out = {key: mul_mat(g, t, w, x[:4], 1) for key, t, w, x in cases()}
        np.savez(sys.argv[0] + ".forced.npz", **out)
        return
    store = {}
    for key, t, w, x in cases():
        for m in (8, 20):
            one, two = mul_mat(g, t, w, x[:m], 1), mul_mat(g, t, w, x[:m], 2)
            assert np.array_equal(one.view(np.uint32), two.view(np.uint32)), (key, m)
            store[f"{key}_out{m}"] = one
        # the tiled sums are not the dot products': the fixture must tell them apart
        assert not np.array_equal(mul_mat(g, t, w, x[:1], 1)[0], store[f"{key}_out8"][0]), key
    env = dict(os.environ, GGML_CPU_TILED_MM_FORCE="1")
    subprocess.run([sys.executable, __file__, "--forced"], env=env, check=True)
    forced = np.load(__file__ + ".forced.npz")
    for key in forced.files:
        store[f"{key}_out4_forced"] = forced[key]
    os.remove(__file__ + ".forced.npz")
    np.savez_compressed(OUT, **store)
    print(f"wrote {OUT} ({OUT.stat().st_size} bytes): {len(store)} arrays")


if __name__ == "__main__":
    main()
