"""Fixture for tests/test_repack.py: ggml 0.15.3's CPU_REPACK extra buffer type (src/ggml-cpu/repack.cpp)
on an AVX2 x86 build: a Q4_0 weight written into it is repacked to block_q4_0x8, and a MUL_MAT with F32
activations runs ggml_gemm_q4_0_8x8_q8_0 (4 activation rows at a time; on an AVX-512 build 16, then 4,
two groups of 8 weight rows per zmm register) and ggml_gemv_q4_0_8x8_q8_0 (the rest). Also what the CPU
device's supports_op answers for ops whose weight lies in that buffer. The stored fixture was made with
ggml-python 0.0.45 built natively on an AVX-512 Xeon (repack_ref.json: "avx512"); on a CPU with AMX that
build also lists an "AMX" extra buffer type, which repack_ref.json leaves out (ggml_lite has none).

With the project's venv it quantizes seeded random weights (the gguf package's Q4_0 quantizer) and
activations, then runs its second half under ggml-python (`--peer`), which places the weights in the
buffer type the CPU reg hands out through "ggml_backend_dev_get_extra_bufts", computes with 1 and 2
threads, reads the repacked bytes back through the buffer's base, and stores everything in
tests/data/repack_ref.npz (+ repack_ref.json for the supports_op answers):

    PYTHONPATH=. .venv/bin/python tests/ggml_ref/repack_ref.py --ggml-python $GGMLPY
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
from pathlib import Path

K, N = 512, 64                      # weight [K, N]: 16 blocks a row, 8 groups of 8 rows
COLS = (1, 3, 4, 7, 13, 21)         # activation columns: gemv only, gemm only, both;
                                    # 21: on an AVX-512 build, 16 rows in its zmm body too
DATA = Path(__file__).resolve().parents[1] / "data"
OUT, OUT_JSON = DATA / "repack_ref.npz", DATA / "repack_ref.json"


def inputs(path):
    import gguf
    import numpy as np
    rng = np.random.default_rng(2828)
    w = rng.standard_normal((N, K)).astype(np.float32)
    arrays = {"w": gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q4_0)}
    for m in COLS:
        arrays[f"x{m}"] = (rng.standard_normal((m, K)) * rng.uniform(0.1, 4.0, (m, 1))).astype(np.float32)
    np.savez(path, **arrays)


def _extra_bufts(ggml, reg, dev):
    p = ggml.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts")
    f = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(p)
    arr, out = f(dev), []
    while arr[len(out)]:
        out.append(arr[len(out)])
    return out


def _cpu_buffer_type(ggml):
    """ggml_backend_cpu_buffer_type() (ggml-python's binding truncates the pointer to 32 bits)."""
    lib = ctypes.CDLL(os.path.join(os.path.dirname(ggml.__file__), "lib", "libggml-cpu.so"))
    lib.ggml_backend_cpu_buffer_type.restype = ctypes.c_void_p
    return lib.ggml_backend_cpu_buffer_type()


def _ctx(ggml):
    return ggml.ggml_init(ggml.ggml_init_params(mem_size=1 << 20, mem_buffer=None, no_alloc=True))


def _mul_mat(ggml, backend, buft, wbytes, wtype, kn, x, n_threads):
    """dst = mul_mat(w, x) with w in buft, x and dst in the CPU buffer type; (dst, w's bytes as stored)."""
    import numpy as np
    cw, cx = _ctx(ggml), _ctx(ggml)
    w = ggml.ggml_new_tensor_2d(cw, wtype, *kn)
    bw = ggml.ggml_backend_alloc_ctx_tensors_from_buft(cw, buft)
    ggml.ggml_backend_tensor_set(w, wbytes.ctypes.data, 0, wbytes.nbytes)
    b = ggml.ggml_new_tensor_2d(cx, ggml.GGML_TYPE_F32, x.shape[1], x.shape[0])
    c = ggml.ggml_mul_mat(cx, w, b)
    gf = ggml.ggml_new_graph(cx)
    ggml.ggml_build_forward_expand(gf, c)
    bx = ggml.ggml_backend_alloc_ctx_tensors(cx, backend)
    ggml.ggml_backend_tensor_set(b, x.ctypes.data, 0, x.nbytes)
    ggml.ggml_backend_cpu_set_n_threads(backend, n_threads)
    assert ggml.ggml_backend_graph_compute(backend, gf) == 0
    out = np.empty((x.shape[0], kn[1]), np.float32)
    ggml.ggml_backend_tensor_get(c, out.ctypes.data, 0, out.nbytes)
    stored = np.ctypeslib.as_array(ctypes.cast(ggml.ggml_get_data(w), ctypes.POINTER(ctypes.c_uint8)),
                                   shape=(wbytes.nbytes,)).copy()
    for buf in (bw, bx):
        ggml.ggml_backend_buffer_free(buf)
    ggml.ggml_free(cw)
    ggml.ggml_free(cx)
    return out, stored


def _supports(ggml, dev, repack, case):
    """What ggml_backend_dev_supports_op says for one op whose src0 lies in the repack buffer."""
    wtype, ne, op, src1_type, n_dims = case
    cw, cx = _ctx(ggml), _ctx(ggml)
    w = (ggml.ggml_new_tensor_2d(cw, getattr(ggml, f"GGML_TYPE_{wtype}"), *ne[:2]) if n_dims == 2 else
         ggml.ggml_new_tensor_3d(cw, getattr(ggml, f"GGML_TYPE_{wtype}"), *ne))
    bw = ggml.ggml_backend_alloc_ctx_tensors_from_buft(cw, repack)
    if op == "MUL_MAT":
        b = ggml.ggml_new_tensor_3d(cx, getattr(ggml, f"GGML_TYPE_{src1_type}"), ne[0], 5, ne[2] if n_dims == 3 else 1)
        node = ggml.ggml_mul_mat(cx, w, b)
    else:
        idx = ggml.ggml_new_tensor_1d(cx, ggml.GGML_TYPE_I32, 3)
        node = ggml.ggml_get_rows(cx, w, idx)
    r = bool(ggml.ggml_backend_dev_supports_op(dev, node))
    ggml.ggml_backend_buffer_free(bw)
    ggml.ggml_free(cw)
    ggml.ggml_free(cx)
    return r


SUPPORTS = [("Q4_0", [K, N], "MUL_MAT", "F32", 2), ("Q4_0", [K, 12], "MUL_MAT", "F32", 2),
            ("Q4_0", [K, 8], "MUL_MAT", "F32", 2), ("Q4_0", [K, N], "MUL_MAT", "F16", 2),
            ("Q4_0", [K, N], "GET_ROWS", "I32", 2), ("Q4_0", [K, N, 2], "MUL_MAT", "F32", 3),
            ("Q8_0", [K, N], "MUL_MAT", "F32", 2), ("Q4_1", [K, N], "MUL_MAT", "F32", 2),
            ("F32", [K, N], "MUL_MAT", "F32", 2), ("F16", [K, N], "MUL_MAT", "F32", 2),
            ("Q4_K", [K, N], "MUL_MAT", "F32", 2), ("Q6_K", [K, N], "MUL_MAT", "F32", 2)]


def peer(path):
    import ggml
    import numpy as np
    data = dict(np.load(path))
    reg = ggml.ggml_backend_cpu_reg()
    dev = ggml.ggml_backend_reg_dev_get(reg, 0)
    extra = _extra_bufts(ggml, reg, dev)
    names = [ggml.ggml_backend_buft_name(b).decode() for b in extra]
    repack = extra[names.index("CPU_REPACK")]
    backend = ggml.ggml_backend_cpu_init()
    cpu = _cpu_buffer_type(ggml)
    for m in COLS:
        x = data[f"x{m}"]
        for nt in (1, 2):
            out, stored = _mul_mat(ggml, backend, repack, data["w"], ggml.GGML_TYPE_Q4_0, (K, N), x, nt)
            assert nt == 1 or np.array_equal(out, data[f"out{m}"]), "thread count changed the bits"
            data[f"out{m}"] = out
        data[f"plain{m}"], _ = _mul_mat(ggml, backend, cpu, data["w"], ggml.GGML_TYPE_Q4_0, (K, N), x, 1)
    data["repacked"] = stored
    meta = {"extra_bufts": names, "avx2": bool(ggml.ggml_cpu_has_avx2()),
            "avx512": bool(ggml.ggml_cpu_has_avx512()),
            "repack_buft": {"name": ggml.ggml_backend_buft_name(repack).decode(),
                            "is_host": bool(ggml.ggml_backend_buft_is_host(repack)),
                            "alignment": int(ggml.ggml_backend_buft_get_alignment(repack)),
                            "supported_by_cpu_device": bool(ggml.ggml_backend_dev_supports_buft(dev, repack))},
            "supports_op": [{"case": list(c), "supported": _supports(ggml, dev, repack, c)} for c in SUPPORTS]}
    ggml.ggml_backend_free(backend)
    np.savez_compressed(path, **data)
    OUT_JSON.write_text(json.dumps(meta, indent=1) + "\n")
    print(f"wrote {path} and {OUT_JSON}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", metavar="NPZ")
    ap.add_argument("--ggml-python", default=os.environ.get("GGMLPY"))
    args = ap.parse_args()
    if args.peer:
        return peer(args.peer)
    if not args.ggml_python:
        ap.error("--ggml-python (or $GGMLPY) is needed")
    inputs(OUT)
    subprocess.run([args.ggml_python, __file__, "--peer", str(OUT)], check=True)


if __name__ == "__main__":
    sys.exit(main())
