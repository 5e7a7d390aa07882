"""Run by tests/test_cpu_variants.py in a fresh process (the CPU variant is chosen once per
process, from $GGML_LITE_CPU_VARIANT): computes a few products on the CPU backend and
writes them, with what the process ran on, to the .npz named by argv[1]."""
import json
import sys

import numpy as np
from numba import njit

import ggml_lite as ggml
from ggml_lite import Type
from ggml_lite.backends.cpu import repack as R
from ggml_lite.backends.cpu import variants as V
from ggml_lite.backends.cpu import vec as VEC
from ggml_lite.backends.cpu.simd import AVX2, AVX512_VNNI
from ggml_lite.backends.cpu.backend import ggml_backend_score

K, N, M = 256, 16, 5


def product(wtype, w, x, buft=None):
    cpu = ggml.backend_cpu_init()
    cw = ggml.init(mem_size=2 * ggml.tensor_overhead(), no_alloc=True)
    W = ggml.new_tensor_2d(cw, wtype, K, N)
    if buft is None:
        ggml.backend_alloc_ctx_tensors(cw, cpu)
    else:
        ggml.backend_alloc_ctx_tensors_from_buft(cw, buft)
    ggml.backend_tensor_set(W, w)
    cx = ggml.init(mem_size=4 * ggml.tensor_overhead() + ggml.graph_overhead(),
                   no_alloc=True)
    X = ggml.new_tensor_2d(cx, Type.F32, K, x.shape[0])
    Y = ggml.mul_mat(cx, W, X)
    gf = ggml.new_graph(cx)
    ggml.build_forward_expand(gf, Y)
    ggml.backend_alloc_ctx_tensors(cx, cpu)
    ggml.backend_tensor_set(X, x)
    ggml.backend_cpu_set_n_threads(cpu, 1)
    assert ggml.backend_graph_compute(cpu, gf) == ggml.Status.SUCCESS
    return ggml.backend_tensor_get(Y).reshape(x.shape[0], N)


def main(out):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((N, K)).astype(np.float32)
    x = rng.standard_normal((M, K)).astype(np.float32)
    res = {}
    for t in (Type.F32, Type.F16, Type.Q8_0, Type.Q4_0):
        q = ggml.quantize_chunk(t, w) if t != Type.F32 else w
        if t == Type.F16:
            q = w.astype(np.float16)
        res[t.name] = product(t, q, x)
        res[t.name + "_vec"] = product(t, q, x[:1])
    x12 = rng.standard_normal((12, K)).astype(np.float32)
    for t in (Type.Q4_K, Type.Q6_K):    # 12 columns: ggml's tiled K-quant product (05)
        res[t.name + "_tiled"] = product(t, ggml.quantize_chunk(t, w), x12)
    q40 = ggml.quantize_chunk(Type.Q4_0, w)
    if AVX2:    # ggml repacks Q4_0 only where it has AVX2
        res["Q4_0_repack"] = product(Type.Q4_0, q40, x, R.backend_cpu_repack_buffer_type())
    # the cached dot: the key numba filed and looked it up under (its target is the
    # variant's), and the targets the cache index holds
    y = np.zeros(34 * (K // 32), np.uint8)
    disp = VEC.vec_dot_q8_0_q8_0
    disp(K, y, y)
    sig = disp.signatures[0]
    key = disp._cache._index_key(sig, disp.targetctx.codegen())
    index = disp._cache._cache_file._load_index()
    # the machine code the variant's target gives that dot, compiled afresh
    fresh = njit(nogil=True)(disp.py_func)
    fresh(K, y, y)
    asm = fresh.inspect_asm(fresh.signatures[0])
    info = {"variant": V.cpu_variant(), "score": ggml_backend_score(),
            "ymm": "ymm" in asm, "zmm": "zmm" in asm, "vpdpbusd": "vpdpbusd" in asm,
            "cache_hits": sum(disp.stats.cache_hits.values()),
            "key_target": key[1][2], "index_targets": sorted({k[1][2] for k in index}),
            "avx2": AVX2, "avx512_vnni": AVX512_VNNI}
    np.savez(out, info=json.dumps(info), **res)


if __name__ == "__main__":
    main(sys.argv[1])
