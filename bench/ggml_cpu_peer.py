"""ggml_lite's CPU backend against llama.cpp's own ggml-cpu, op by op, in one process.

    PYTHONPATH=. .venv/bin/python bench/ggml_cpu_peer.py --llama-python /path/to/venv/bin/python
        [--threads 1] [--rounds 3] [--out bench/results/ggml_cpu.json] [CASE ...]

The peer is the libggml-base / libggml-cpu that llama-cpp-python ships (built with
GGML_LLAMAFILE on, as llama.cpp builds ggml: tinyBLAS for F32, F16 and Q8_0 products, and the
CPU_REPACK extra buffer type for Q4_0 weights), loaded with ctypes. Both sides run the same
one-node graph through their backend API: the weight in a CPU buffer, or in CPU_REPACK for the
"repacked" cases (set_tensor repacks it), the activations in a CPU buffer, then
backend_graph_compute on a CPU backend with --threads threads (ggml_lite's with
backend_cpu_set_llamafile on, as llama.cpp's ggml is built). Same shapes, same bytes.
Rounds alternate the two sides; a side's figure is its best call over all rounds (hot cache).
Prints a table with the ratio ggml time / ggml_lite time (above 1: ggml_lite is faster) and
writes every time to --out. The #28 targets: F32 1024^3 and F16 products >= 0.8, the
4096x4096 Q4_0 x 32 product through CPU_REPACK >= 1.0.
"""
import argparse
import ctypes as C
import glob
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
import ggml_lite as L  # noqa: E402
from ggml_lite import Type  # noqa: E402
from ggml_lite.backends.cpu.backend import backend_cpu_set_llamafile  # noqa: E402
from run import _cpu_model  # noqa: E402

F32, F16, Q4_0, Q8_0, I32 = 0, 1, 2, 8, 26
LT = {F32: Type.F32, F16: Type.F16, Q4_0: Type.Q4_0, Q8_0: Type.Q8_0, I32: Type.I32}
BLOCK = {Q4_0: 18, Q8_0: 34}


def _libs(python):
    """llama-cpp-python's libggml-base and libggml-cpu, found through its interpreter."""
    out = subprocess.run([python, "-c", "import llama_cpp, os; print(os.path.dirname("
                          "llama_cpp.__file__))"], capture_output=True, text=True, check=True)
    lib = os.path.join(out.stdout.strip(), "lib")
    base = C.CDLL(os.path.join(lib, "libggml-base.so"), mode=C.RTLD_GLOBAL)
    cpu = C.CDLL(glob.glob(os.path.join(lib, "libggml-cpu*.so"))[0], mode=C.RTLD_GLOBAL)
    vp, i64, sz = C.c_void_p, C.c_int64, C.c_size_t

    class Params(C.Structure):
        _fields_ = [("mem_size", sz), ("mem_buffer", vp), ("no_alloc", C.c_bool)]
    sigs = {"ggml_init": (vp, [Params]), "ggml_new_tensor_1d": (vp, [vp, C.c_int, i64]),
            "ggml_new_tensor_2d": (vp, [vp, C.c_int, i64, i64]),
            "ggml_new_tensor_3d": (vp, [vp, C.c_int, i64, i64, i64]),
            "ggml_view_3d": (vp, [vp, vp, i64, i64, i64, sz, sz, sz]),
            "ggml_permute": (vp, [vp, vp, C.c_int, C.c_int, C.c_int, C.c_int]),
            "ggml_mul_mat": (vp, [vp, vp, vp]), "ggml_cont": (vp, [vp, vp]),
            "ggml_soft_max_ext": (vp, [vp, vp, vp, C.c_float, C.c_float]),
            "ggml_swiglu_split": (vp, [vp, vp, vp]), "ggml_rms_norm": (vp, [vp, vp, C.c_float]),
            "ggml_new_graph": (vp, [vp]), "ggml_build_forward_expand": (None, [vp, vp]),
            "ggml_nbytes": (sz, [vp]), "ggml_free": (None, [vp]),
            "ggml_backend_alloc_ctx_tensors": (vp, [vp, vp]),
            "ggml_backend_alloc_ctx_tensors_from_buft": (vp, [vp, vp]),
            "ggml_backend_tensor_set": (None, [vp, vp, sz, sz]),
            "ggml_backend_graph_compute": (C.c_int, [vp, vp]),
            "ggml_backend_get_device": (vp, [vp]), "ggml_backend_dev_backend_reg": (vp, [vp]),
            "ggml_backend_reg_get_proc_address": (vp, [vp, C.c_char_p]),
            "ggml_backend_buft_name": (C.c_char_p, [vp]),
            "ggml_backend_buffer_free": (None, [vp])}
    for name, (res, args) in sigs.items():
        f = getattr(base, name)
        f.restype, f.argtypes = res, args
    cpu.ggml_backend_cpu_init.restype = vp
    cpu.ggml_backend_cpu_set_n_threads.argtypes = [vp, C.c_int]
    return base, cpu, Params


class Peer:
    """One side's graph-building calls, ggml's names: real ggml through ctypes."""

    def __init__(self, libs, n_threads):
        self.base, self.cpu, self.Params = libs
        self.backend = self.cpu.ggml_backend_cpu_init()
        self.cpu.ggml_backend_cpu_set_n_threads(self.backend, n_threads)
        dev = self.base.ggml_backend_get_device(self.backend)
        reg = self.base.ggml_backend_dev_backend_reg(dev)
        fn = C.CFUNCTYPE(C.POINTER(C.c_void_p), C.c_void_p)(
            self.base.ggml_backend_reg_get_proc_address(reg, b"ggml_backend_dev_get_extra_bufts"))
        bufts, k = fn(dev), 0
        self.repack = None
        while bufts[k]:
            if self.base.ggml_backend_buft_name(bufts[k]) == b"CPU_REPACK":
                self.repack = bufts[k]
            k += 1
        self.ctx = self.base.ggml_init(self.Params(64 << 20, None, True))
        self.weights = self.base.ggml_init(self.Params(1 << 20, None, True))

    def new(self, t, *ne, weight=False):
        f = getattr(self.base, f"ggml_new_tensor_{len(ne)}d")
        return f(self.weights if weight else self.ctx, t, *ne)

    def __getattr__(self, name):
        f = getattr(self.base, "ggml_" + name)
        return lambda *a: f(self.ctx, *a)

    def run(self, out, data, repacked):
        """Allocate, set every leaf's bytes, return a callable computing the graph."""
        buft = self.repack if repacked else None
        if buft is not None:
            self.base.ggml_backend_alloc_ctx_tensors_from_buft(self.weights, buft)
        elif any(w for w, _ in data.values()):
            self.base.ggml_backend_alloc_ctx_tensors(self.weights, self.backend)
        gf = self.base.ggml_new_graph(self.ctx)
        self.base.ggml_build_forward_expand(gf, out)
        self.base.ggml_backend_alloc_ctx_tensors(self.ctx, self.backend)
        for t, (_, b) in data.items():
            self.base.ggml_backend_tensor_set(t, b.ctypes.data, 0, b.nbytes)
        return lambda: self.base.ggml_backend_graph_compute(self.backend, gf)


class Lite:
    """The same calls on ggml_lite."""

    def __init__(self, n_threads):
        self.backend = L.backend_cpu_init()
        L.backend_cpu_set_n_threads(self.backend, n_threads)
        backend_cpu_set_llamafile(self.backend, True)     # as the peer is built
        reg = L.backend_cpu_reg()
        dev = L.backend_reg_dev_get(reg, 0)
        bufts = L.backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts")(dev)
        self.repack = next(b for b in bufts if L.backend_buft_name(b) == "CPU_REPACK")
        self.ctx = L.init(mem_size=1 << 20, no_alloc=True)
        self.weights = L.init(mem_size=1 << 16, no_alloc=True)

    def new(self, t, *ne, weight=False):
        f = getattr(L, f"new_tensor_{len(ne)}d")
        return f(self.weights if weight else self.ctx, LT[t], *ne)

    def __getattr__(self, name):
        f = getattr(L, name)
        return lambda *a: f(self.ctx, *a)

    def run(self, out, data, repacked):
        if repacked:
            L.backend_alloc_ctx_tensors_from_buft(self.weights, self.repack)
        elif any(w for w, _ in data.values()):
            L.backend_alloc_ctx_tensors(self.weights, self.backend)
        gf = L.new_graph(self.ctx)
        L.build_forward_expand(gf, out)
        L.backend_alloc_ctx_tensors(self.ctx, self.backend)
        for t, (_, b) in data.items():
            L.backend_tensor_set(t, b.view(np.uint8).reshape(-1))
        return lambda: L.backend_graph_compute(self.backend, gf)


def _bytes(t, n, rng):
    """n elements' worth of valid bytes of type t (quantized: random quants, scale 0.01)."""
    if t == F32:
        return rng.standard_normal(n).astype(np.float32)
    if t == F16:
        return rng.standard_normal(n).astype(np.float16)
    if t == I32:
        return np.arange(n, dtype=np.int32)
    b = rng.integers(0, 256, (n // 32, BLOCK[t]), dtype=np.uint8)
    b[:, :2] = np.array([0.01], np.float16).view(np.uint8)
    return b.reshape(-1)


def mul_mat(t, k, m, n, repacked=False):
    def build(A, rng):
        w, x = A.new(t, k, m, weight=True), A.new(F32, k, n)
        return A.mul_mat(w, x), {w: (True, _bytes(t, k * m, rng)), x: (False, _bytes(F32, k * n, rng))}
    return build, repacked


def kq(n_kv=256, hd=64, nh=12, nt=64):
    def build(A, rng):
        k, q = A.new(F16, hd * nh, n_kv), A.new(F32, hd, nh, nt)
        kv = A.view_3d(k, hd, n_kv, nh, hd * nh * 2, hd * 2, 0)
        return A.mul_mat(kv, A.permute(q, 0, 2, 1, 3)), {
            k: (False, _bytes(F16, hd * nh * n_kv, rng)), q: (False, _bytes(F32, hd * nh * nt, rng))}
    return build, False


def kqv(n_kv=256, hd=64, nh=12, nt=64):
    def build(A, rng):
        v, s = A.new(F16, n_kv * hd * nh), A.new(F32, n_kv, nt, nh)
        vv = A.view_3d(v, n_kv, hd, nh, n_kv * 2, n_kv * hd * 2, 0)
        return A.mul_mat(vv, s), {v: (False, _bytes(F16, n_kv * hd * nh, rng)),
                                  s: (False, _bytes(F32, n_kv * nt * nh, rng))}
    return build, False


def soft_max(n_kv=256, nh=12, nt=64):
    def build(A, rng):
        x, m = A.new(F32, n_kv, nt, nh), A.new(F32, n_kv, nt)
        return A.soft_max_ext(x, m, 0.125, 0.0), {x: (False, _bytes(F32, n_kv * nt * nh, rng)),
                                                  m: (False, _bytes(F32, n_kv * nt, rng))}
    return build, False


def swiglu(n=2048, nt=64):
    def build(A, rng):
        a, b = A.new(F32, n, nt), A.new(F32, n, nt)
        return A.swiglu_split(a, b), {a: (False, _bytes(F32, n * nt, rng)), b: (False, _bytes(F32, n * nt, rng))}
    return build, False


def cont(hd=64, nh=12, nt=64):
    def build(A, rng):
        x = A.new(F32, hd, nh, nt)
        return A.cont(A.permute(x, 0, 2, 1, 3)), {x: (False, _bytes(F32, hd * nh * nt, rng))}
    return build, False


CASES = {
    "mul_mat F32 1024x1024 n=1024": mul_mat(F32, 1024, 1024, 1024),
    "mul_mat F16 4096x4096 n=32": mul_mat(F16, 4096, 4096, 32),
    "mul_mat F16 1024x1024 n=1024": mul_mat(F16, 1024, 1024, 1024),
    "mul_mat Q8_0 4096x4096 n=32": mul_mat(Q8_0, 4096, 4096, 32),
    "mul_mat Q4_0 4096x4096 n=32 repacked": mul_mat(Q4_0, 4096, 4096, 32, repacked=True),
    "mul_mat Q4_0 4096x4096 n=1 repacked": mul_mat(Q4_0, 4096, 4096, 1, repacked=True),
    "prompt: Q8_0 768x2048 n=64": mul_mat(Q8_0, 768, 2048, 64),
    "prompt: Q4_0 768x2048 n=64 repacked": mul_mat(Q4_0, 768, 2048, 64, repacked=True),
    "prompt: K.Q F16 256x64x12 n=64": kq(),
    "prompt: KQ.V F16 256x64x12 n=64": kqv(),
    "prompt: soft_max 256x64x12": soft_max(),
    "prompt: swiglu 2048x64": swiglu(),
    "prompt: cont 64x12x64": cont(),
}


def best(fn, min_time=0.3, min_reps=5):
    fn()
    ts = []
    while len(ts) < min_reps or sum(ts) < min_time:
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return min(ts)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("cases", nargs="*", help="case names (default: all)")
    ap.add_argument("--llama-python", default=os.environ.get("LLAMA_CPP_PYTHON"), required=False)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench/results/ggml_cpu.json"))
    args = ap.parse_args()
    if not args.llama_python:
        ap.error("--llama-python (an interpreter where `import llama_cpp` works) is needed")
    libs = _libs(args.llama_python)
    rows = []
    print(f"{'case':40s} {'ggml ms':>9s} {'lite ms':>9s} {'ratio':>6s}", flush=True)
    for name in args.cases or list(CASES):
        build, repacked = CASES[name]
        calls = {}
        for side, make in (("ggml", lambda: Peer(libs, args.threads)), ("ggml_lite", lambda: Lite(args.threads))):
            A = make()
            out, data = build(A, np.random.default_rng(0))
            calls[side] = A.run(out, data, repacked)
        times = {s: [] for s in calls}
        for _ in range(args.rounds):
            for s, fn in calls.items():
                times[s].append(best(fn))
        g, lt = min(times["ggml"]), min(times["ggml_lite"])
        rows.append(dict(case=name, threads=args.threads, ggml_s=times["ggml"], ggml_lite_s=times["ggml_lite"],
                         ratio=g / lt))
        print(f"{name:40s} {g * 1e3:9.3f} {lt * 1e3:9.3f} {g / lt:6.2f}", flush=True)
    load = os.getloadavg()
    Path(args.out).write_text(json.dumps(dict(
        date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), machine=platform.processor() or platform.machine(),
        cpu=_cpu_model(), loadavg=load, rounds=args.rounds, rows=rows), indent=1) + "\n")
    print(f"wrote {args.out} (load average {load[0]:.2f})")


if __name__ == "__main__":
    main()
