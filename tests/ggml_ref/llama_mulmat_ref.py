"""Fixture for tests/test_llama.py: ggml 0.15.3's CPU mul_mat on the weight types of the llama test
models and Q4_0, to tell the llama chapter's gaps to llama.cpp apart from gaps to ggml itself.

With the project's venv it quantizes seeded random weights [256, 512] (Q4_1, Q4_K, Q6_K, BF16,
Q8_0, Q4_0: the gguf package's quantizers, the types chapter's for the K-quants) and 20 activation rows,
then runs its second half under ggml-python (`--peer`), which multiplies them with real ggml
(one thread) and stores everything in tests/data/llama_mulmat_ref.npz:

    PYTHONPATH=. .venv/bin/python tests/ggml_ref/llama_mulmat_ref.py --ggml-python $GGMLPY
"""
import argparse
import ctypes
import os
import subprocess
import sys
from pathlib import Path

TYPES = ["Q4_1", "Q4_K", "Q6_K", "BF16", "Q8_0", "Q4_0"]
K, N, M = 256, 512, 20
OUT = Path(__file__).resolve().parents[1] / "data" / "llama_mulmat_ref.npz"


def inputs(path):
    import gguf
    import numpy as np
    from ggml_lite.types import Type, quantize_chunk
    rng = np.random.default_rng(1212)
    w = rng.standard_normal((N, K)).astype(np.float32)
    arrays = {"x": rng.standard_normal((M, K)).astype(np.float32)}
    for t in TYPES:
        arrays[t] = (quantize_chunk(Type[t], w) if t in ("Q4_K", "Q6_K")
                     else gguf.quants.quantize(w, gguf.GGMLQuantizationType[t]))
    np.savez(path, **arrays)


def peer(path):
    import ggml
    import numpy as np
    data = dict(np.load(path))
    for t in TYPES:
        ctx = ggml.ggml_init(ggml.ggml_init_params(mem_size=64 * 2**20, mem_buffer=None, no_alloc=False))
        a = ggml.ggml_new_tensor_2d(ctx, getattr(ggml, f"GGML_TYPE_{t}"), K, N)
        b = ggml.ggml_new_tensor_2d(ctx, ggml.GGML_TYPE_F32, K, M)
        ctypes.memmove(ggml.ggml_get_data(a), data[t].ctypes.data, data[t].nbytes)
        ctypes.memmove(ggml.ggml_get_data(b), data["x"].ctypes.data, data["x"].nbytes)
        c = ggml.ggml_mul_mat(ctx, a, b)
        gf = ggml.ggml_new_graph(ctx)
        ggml.ggml_build_forward_expand(gf, c)
        ggml.ggml_graph_compute_with_ctx(ctx, gf, 1)
        out = ctypes.cast(ggml.ggml_get_data(c), ctypes.POINTER(ctypes.c_float))
        data[f"{t}_out"] = np.ctypeslib.as_array(out, shape=(M, N)).copy()
        ggml.ggml_free(ctx)
    np.savez_compressed(path, **data)
    print(f"wrote {path}")


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
