"""Quantize / dequantize speed of a 4096x4096 float32 matrix, per type, on one thread.

    .venv/bin/python bench/bench_types.py [--n 4096] [--reps 3] [--ggml-python /tmp/ggmlpy/bin/python]

Columns: ggml_lite (numba row functions, one call over the whole matrix), the `gguf` package's numpy
reference (where it has the type), and real ggml's ggml_quantize_chunk / to_float (through
ggml-python, run in the interpreter given by --ggml-python, or in this one if it imports `ggml`).
Prints a table and writes bench/results/types.json. Times are the best of --reps runs, in ms.
"""
import argparse
import json
import subprocess
import sys
import time
import warnings
from pathlib import Path

import numpy as np

TYPES = ["F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q8_1", "Q2_K", "Q3_K", "Q4_K",
         "Q5_K", "Q6_K", "Q8_K"]


def best_ms(f, reps):
    f()  # warm-up (and numba compile)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        best = min(best, time.perf_counter() - t0)
    return best * 1e3


def weights(n):
    return np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)


def bench_ggml_lite(n, reps):
    import ggml_lite as ggml
    x = weights(n)
    out = {}
    for name in TYPES:
        t = ggml.Type[name]
        q = ggml.quantize_chunk(t, x)
        out[name] = (best_ms(lambda: ggml.quantize_chunk(t, x), reps),
                     best_ms(lambda: ggml.types.dequantize_rows(t, q, n), reps))
    return out


def bench_gguf(n, reps):
    from gguf import GGMLQuantizationType as GT
    from gguf import quants as gq
    x = weights(n)
    out = {}
    with np.errstate(all="ignore"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in TYPES:
            t = GT[name]
            try:
                q = gq.quantize(x, t)
                tq = best_ms(lambda: gq.quantize(x, t), reps)
            except NotImplementedError:
                q, tq = None, None
            try:
                td = best_ms(lambda: gq.dequantize(q, t), reps) if q is not None else None
            except NotImplementedError:
                td = None
            out[name] = (tq, td)
    return out


GGML_CODE = r"""
import ctypes, json, sys, time
import numpy as np
import ggml
n, reps = int(sys.argv[1]), int(sys.argv[2])
x = np.random.default_rng(0).standard_normal((n, n)).astype(np.float32)
ids = {"F16": 1, "BF16": 30, "Q4_0": 2, "Q4_1": 3, "Q5_0": 6, "Q5_1": 7, "Q8_0": 8, "Q8_1": 9,
       "Q2_K": 10, "Q3_K": 11, "Q4_K": 12, "Q5_K": 13, "Q6_K": 14, "Q8_K": 15}
def best(f):
    f(); b = 1e9
    for _ in range(reps):
        t0 = time.perf_counter(); f(); b = min(b, time.perf_counter() - t0)
    return b * 1e3
out = {}
for name, t in ids.items():
    rs = ggml.ggml_row_size(t, n)
    q = np.zeros((n, rs), np.uint8)
    src = x.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
    tq = None
    if name not in ("Q8_1", "Q8_K"):
        tq = best(lambda: ggml.ggml_quantize_chunk(t, src, q.ctypes.data_as(ctypes.c_void_p), 0, n, n, None))
    tr = ggml.ggml_get_type_traits(t).contents
    td = None
    if tq is not None and tr.to_float:
        y = np.zeros((n, n), np.float32)
        td = best(lambda: tr.to_float(q.ctypes.data_as(ctypes.c_void_p), y.ctypes.data_as(ctypes.POINTER(ctypes.c_float)), n * n))
    out[name] = (tq, td)
print(json.dumps(out))
"""


def bench_ggml(n, reps, python):
    r = subprocess.run([python, "-c", GGML_CODE, str(n), str(reps)], capture_output=True, text=True)
    if r.returncode != 0:
        print(f"(real ggml skipped: {r.stderr.strip().splitlines()[-1] if r.stderr.strip() else r.returncode})")
        return {}
    return {k: tuple(v) for k, v in json.loads(r.stdout).items()}


def fmt(v):
    return "–" if v is None else f"{v:8.1f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--ggml-python", default=sys.executable,
                    help="an interpreter where `import ggml` (ggml-python) works")
    args = ap.parse_args()
    lite = bench_ggml_lite(args.n, args.reps)
    ref = bench_gguf(args.n, args.reps)
    real = bench_ggml(args.n, args.reps, args.ggml_python)
    print(f"\n{args.n}x{args.n} float32, one thread, best of {args.reps}, milliseconds\n")
    print(f"| type | ggml_lite quantize | ggml_lite dequantize | gguf quantize | gguf dequantize | ggml quantize | ggml dequantize |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name in TYPES:
        row = [*lite[name], *ref.get(name, (None, None)), *real.get(name, (None, None))]
        print(f"| {name} | " + " | ".join(fmt(v) for v in row) + " |")
    results = Path(__file__).parent / "results"
    results.mkdir(exist_ok=True)
    (results / "types.json").write_text(json.dumps(
        {"n": args.n, "reps": args.reps, "unit": "ms", "ggml_lite": lite, "gguf": ref, "ggml": real}, indent=1))


if __name__ == "__main__":
    main()
