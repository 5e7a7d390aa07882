"""The numpy side: what a numpy user would write for each workload.

- F32 mul_mat: `x @ w.T` (numpy calls its BLAS, OpenBLAS here: sgemm).
- Weights of a quantized or F16 type, two figures:
  `resident`: the weights dequantized to float32 once, before timing; each call is `x @ w32.T`
  (sgemv for one column, sgemm for 32). It keeps 4 bytes per weight in memory (Q4_0 keeps 0.56).
  `dequant`: the weights kept packed; each call dequantizes all of them, then multiplies:
  `x @ gguf.quants.dequantize(q, type).T` (the `gguf` package's numpy dequantizers, one thread),
  or `x @ w16.astype(np.float32).T` for F16.
- add chain: `cur = cur + b` 1000 times in a Python loop (numpy's element-wise ops use no threads).

BLAS threads: the parent sets OPENBLAS_NUM_THREADS (and OMP_NUM_THREADS) before this process
imports numpy, and `blas_threads` below also calls OpenBLAS's own set_num_threads, as threadpoolctl
would; `blas_info` reads back what OpenBLAS reports (threads, the kernel it chose).
"""
import ctypes
import os
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from common import activations, measure, nmse, reference, weights, workloads  # noqa: E402


def _openblas():
    """numpy's OpenBLAS as a ctypes library (found in this process's memory map), and its symbol
    prefix; (None, None) if numpy does not use OpenBLAS."""
    with open("/proc/self/maps") as f:
        paths = {line.split()[-1] for line in f if "openblas" in line.lower() and line.split()[-1].startswith("/")}
    for path in sorted(paths):
        lib = ctypes.CDLL(path)
        for prefix in ("scipy_openblas", "openblas"):
            for suffix in ("64_", ""):
                if hasattr(lib, f"{prefix}_get_num_threads{suffix}"):
                    return lib, (prefix, suffix)
    return None, None


def blas_threads(n):
    lib, (prefix, suffix) = _openblas()
    if lib is not None:
        getattr(lib, f"{prefix}_set_num_threads{suffix}")(ctypes.c_int(n))


def blas_info():
    """What numpy's BLAS is and reports now."""
    cfg = np.show_config(mode="dicts")["Build Dependencies"]["blas"]
    out = dict(name=cfg.get("name"), version=cfg.get("version"), build_config=cfg.get("openblas configuration"),
               env={k: os.environ.get(k) for k in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS",
                                                  "OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")})
    lib, (prefix, suffix) = _openblas()
    if lib is not None:
        getattr(lib, f"{prefix}_get_corename{suffix}").restype = ctypes.c_char_p
        getattr(lib, f"{prefix}_get_config{suffix}").restype = ctypes.c_char_p
        out["runtime_threads"] = int(getattr(lib, f"{prefix}_get_num_threads{suffix}")())
        out["runtime_corename"] = getattr(lib, f"{prefix}_get_corename{suffix}")().decode()
        out["runtime_config"] = getattr(lib, f"{prefix}_get_config{suffix}")().decode().strip()
    return out


def _packed(type_name, w):
    """The packed weights and the per-call dequantizer numpy would use."""
    if type_name == "F16":
        return w.astype(np.float16), lambda q: q.astype(np.float32)
    from gguf import GGMLQuantizationType as GT
    from gguf import quants as gq
    import ggml_lite   # only to pack the weights (byte-identical to ggml's quantizers); not timed
    q = ggml_lite.quantize_chunk(ggml_lite.Type[type_name], w)
    return q, lambda q: gq.dequantize(q, GT[type_name])


def mul_mat(type_name, m, n, k, quick=False, w=None):
    w = weights(m, k) if w is None else w
    x = activations(n, k)
    ref = reference(w, x)
    if type_name == "F32":
        r = measure(lambda: x @ w.T, quick)
        r["nmse_vs_f32"] = nmse(x @ w.T, ref)
        return dict(plain=r)
    q, deq = _packed(type_name, w)
    w32 = deq(q)
    resident = measure(lambda: x @ w32.T, quick)
    resident["nmse_vs_f32"] = nmse(x @ w32.T, ref)
    dequant = measure(lambda: x @ deq(q).T, quick, min_time=0.3, min_reps=3)
    dequant["nmse_vs_f32"] = resident["nmse_vs_f32"]
    return dict(resident=resident, dequant=dequant)


def add_chain(n_nodes, ne0, quick=False):
    x, b = np.ones(ne0, np.float32), np.ones(ne0, np.float32)

    def chain():
        cur = x
        for _ in range(n_nodes):
            cur = cur + b
        return cur
    r = measure(chain, quick)
    r["check"] = float(chain()[0]) == 1.0 + n_nodes
    return dict(plain=r)


def run(n_threads, quick=False):
    blas_threads(n_threads)
    res, cache = {}, {}
    for wl in workloads():
        if wl["kind"] == "mul_mat":
            w = cache.setdefault((wl["m"], wl["k"]), weights(wl["m"], wl["k"]))
            res[wl["key"]] = mul_mat(wl["type"], wl["m"], wl["n"], wl["k"], quick, w)
        else:
            res[wl["key"]] = add_chain(wl["n_nodes"], wl["ne0"], quick)
    return res


if __name__ == "__main__":
    print(blas_info())
    for key, r in run(int(os.environ.get("OPENBLAS_NUM_THREADS", "1")), quick="--quick" in sys.argv).items():
        print(f"{key:32s} " + "  ".join(f"{how} {v['best'] * 1e3:9.3f} ms" for how, v in r.items()))
