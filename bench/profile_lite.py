"""Where ggml_lite's time goes: the add chain taken apart, and mul_mat's kernel measured alone.

    .venv/bin/python bench/profile_lite.py [--out FILE]   # default bench/results/profile.json
    (bench/run.py runs it after the side-by-side measurement, next to its own JSON)

1. Per node of a 1000-node add chain (16 floats each), the cost of each layer: graph_compute as
   a whole at 1 and 2 threads (and at 2 threads with plan.min_work_per_node = 0, ggml's schedule:
   every node on both threads, a barrier after each) - the compiled loop; graph_compute at 1
   thread with plan.python_loop (the readable Python loop); then on one thread: the Python loop
   with the pool's kickoff left out (the prepared tasks called in a plain Python loop); one task call (a lambda, forward_add's checks, numba's dispatch,
   the kernel); forward_add called directly; numba's dispatch of the kernel alone; the kernel
   alone (called 1000 times from inside numba, so no dispatch); and per compute, the cost of
   checking that the prepared tasks still fit the graph (the tasks key) and a pool round trip
   (kickoff to the last barrier of an empty compiled program, what graph_compute pays; and of a
   Python job, what the Python loop pays).
2. For each weight type, 4096x4096 times one column: graph_compute at 1 thread, the same without
   ggml_lite's Python layers (mul_mat's chunk kernel over every row, called once from Python),
   the src1 conversion alone, and nanoseconds per block of 32 weights.
These are diagnostics, not part of the side-by-side table (bench/run.py); they reach into
ggml_lite's internal (underscore) functions, so they follow its current code, not a stable API.
"""
import argparse
import datetime
import json
import sys
import time
from pathlib import Path

import numpy as np
from numba import njit

import ggml_lite as ggml
from ggml_lite.backends.cpu import compute as C
from ggml_lite.backends.cpu import binary_ops
from ggml_lite.backends.cpu import program as P
from ggml_lite.backends.cpu import vec as V

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from common import _busy_seconds, activations, git_state, weights  # noqa: E402


def best(fn, reps=200, warmup=3, min_time=0.3):
    for _ in range(warmup):
        fn()
    times = []
    while len(times) < reps or sum(times) < min_time:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        if len(times) > 20 * reps:
            break
    return min(times)


@njit(cache=True, nogil=True)
def _binary_loop(count, a, b, d, ta, tb, td):
    for _ in range(count):
        binary_ops.binary_kernel(0, a, b, d, ta, tb, td, 0, 1)


def _prepared(gf, plan):
    """The tasks graph_compute prepared for gf on its first compute (ggml_lite internals)."""
    return C._PREPARED[gf]


def add_chain(n_nodes=1000, ne0=16):
    ctx = ggml.init(mem_size=(n_nodes + 4) * (ggml.tensor_overhead() + ne0 * 4 + 64)
                    + ggml.graph_overhead_custom(n_nodes + 8) + (1 << 20))
    x = ggml.new_tensor_1d(ctx, ggml.Type.F32, ne0)
    b = ggml.new_tensor_1d(ctx, ggml.Type.F32, ne0)
    x.numpy()[...] = 1.0
    b.numpy()[...] = 1.0
    cur = x
    for _ in range(n_nodes):
        cur = ggml.add(ctx, cur, b)
    gf = ggml.new_graph_custom(ctx, n_nodes + 8)
    ggml.build_forward_expand(gf, cur)
    out = {}
    for nt in (1, 2):
        plan = ggml.graph_plan(gf, nt)
        plan.work_data = np.zeros(plan.work_size, np.uint8)
        out[f"graph_compute, {nt} thread{'s' if nt > 1 else ''}"] = best(lambda: ggml.graph_compute(gf, plan), 20) / n_nodes
    plan = ggml.graph_plan(gf, 2)
    plan.work_data = np.zeros(plan.work_size, np.uint8)
    plan.min_work_per_node = 0      # ggml's own schedule: every node on both threads, a barrier after each
    out["graph_compute, 2 threads, every node on both"] = best(lambda: ggml.graph_compute(gf, plan), 5) / n_nodes
    plan = ggml.graph_plan(gf, 1)
    plan.work_data = np.zeros(plan.work_size, np.uint8)
    plan.python_loop = True           # the readable loop in Python, for comparison
    out["graph_compute, 1 thread, Python loop"] = best(lambda: ggml.graph_compute(gf, plan), 5) / n_nodes
    plan.python_loop = False
    ggml.graph_compute(gf, plan)
    prepared = _prepared(gf, plan)
    tasks = prepared.tasks

    def loop():
        for t in tasks:
            t.run(0, 1)
    out["task loop, no pool kickoff"] = best(loop, 20) / n_nodes
    t0 = tasks[0]
    out["one task call"] = best(lambda: t0.run(0, 1))
    a, bb, d = x.numpy(), b.numpy(), cur.numpy()
    out["forward_add called directly"] = best(lambda: binary_ops.forward_add(a, bb, d, 0, 1))
    a4, b4, d4 = a.reshape(1, 1, 1, -1), bb.reshape(1, 1, 1, -1), d.reshape(1, 1, 1, -1)
    out["numba dispatch + kernel"] = best(lambda: binary_ops.binary_kernel(0, a4, b4, d4, 0, 0, 0, 0, 1))
    out["kernel alone (inside numba)"] = best(lambda: _binary_loop(n_nodes, a4, b4, d4, 0, 0, 0), 20) / n_nodes
    per_compute = {"prepared-tasks check": best(lambda: prepared.fits(gf, plan), 20)}
    for nt in (1, 2):
        tp = C._default_pool(nt)
        state = np.zeros(P.STATE_SIZE, np.int64)
        state[P.N_THREADS] = nt
        empty = (np.zeros((0, P.ROW_SIZE), np.int64), np.zeros((0, P.N_FPARAMS), np.float32), state,
                 np.zeros(0, np.int32), 0)
        s = "s" if nt > 1 else ""
        # what graph_compute pays to start and finish: a program of no tasks, kickoff to last barrier
        per_compute[f"pool round trip, {nt} thread{s}"] = best(lambda: tp.run_program(*empty))
        per_compute[f"pool round trip, {nt} thread{s}, Python job"] = best(lambda: tp.run(lambda ith: None))
    ggml.free(ctx)
    return dict(per_node_s=out, per_compute_s=per_compute, n_nodes=n_nodes, ne0=ne0)


def matvec(types=("Q4_0", "Q8_0", "Q4_K", "Q6_K", "F16", "F32"), m=4096, k=4096):
    w, x = weights(m, k), activations(1, k)
    out = {}
    for name in types:
        t = ggml.Type[name]
        ctx = ggml.init(mem_size=ggml.row_size(t, k) * m + 8 * k + 4 * m + 8 * ggml.tensor_overhead()
                        + ggml.graph_overhead() + (1 << 20))
        a = ggml.new_tensor_2d(ctx, t, k, m)
        b = ggml.new_tensor_2d(ctx, ggml.Type.F32, k, 1)
        o = ggml.mul_mat(ctx, a, b)
        gf = ggml.new_graph(ctx)
        ggml.build_forward_expand(gf, o)
        packed = {"F32": w, "F16": w.astype(np.float16)}.get(name)
        packed = ggml.quantize_chunk(t, w) if packed is None else packed
        a.numpy().reshape(-1).view(np.uint8)[:] = np.ascontiguousarray(packed).reshape(-1).view(np.uint8)
        b.numpy()[...] = x.reshape(b.numpy().shape)
        plan = ggml.graph_plan(gf, 1)
        plan.work_data = np.zeros(plan.work_size, np.uint8)
        src0, src1, dst, wd = a.numpy(), b.numpy(), o.numpy(), plan.work_data
        fns = {"graph_compute": lambda: ggml.graph_compute(gf, plan),
               "src1 conversion": lambda: V.forward_mul_mat_src1(t, src1, wd, 0, 1),
               "chunk kernel over all rows": lambda: V.forward_mul_mat_chunk(t, src0, src1, dst, wd, 0, m, 0, 1)}
        r = {key: float("inf") for key in fns}
        for _ in range(5):            # interleaved rounds, so a noisy moment hits all three alike
            for key, fn in fns.items():
                r[key] = min(r[key], best(fn, 10, min_time=0.05))
        r["ns per 32 weights"] = r["chunk kernel over all rows"] / (m * k / 32) * 1e9
        r["weight bytes"] = int(ggml.row_size(t, k) * m)
        r["GB/s"] = r["weight bytes"] / r["graph_compute"] / 1e9
        out[name] = r
        ggml.free(ctx)
    return out


def measure_all():
    load = [float(v) for v in open("/proc/loadavg").read().split()[:3]]
    busy0, cpu0, wall0 = _busy_seconds(), time.process_time(), time.perf_counter()
    doc = dict(date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
               git=git_state(), add_chain=add_chain(), matvec=matvec(), loadavg=load)
    wall = time.perf_counter() - wall0
    doc["foreign_load"] = max(0.0, (_busy_seconds() - busy0) - (time.process_time() - cpu0)) / wall
    doc["loadavg_after"] = [float(v) for v in open("/proc/loadavg").read().split()[:3]]
    return doc


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results" / "profile.json"))
    args = ap.parse_args()
    doc = None
    for attempt in range(1, 4):       # as bench/run.py: again if other processes took > 0.25 core
        d = measure_all()
        print(f"attempt {attempt}: other processes took {d['foreign_load']:.2f} core on average", flush=True)
        if doc is None or d["foreign_load"] < doc["foreign_load"]:
            doc = d
        if d["foreign_load"] <= 0.25:
            break
        time.sleep(15)
    for k, v in doc["add_chain"]["per_node_s"].items():
        print(f"add chain, per node: {k:32s} {v * 1e6:8.2f} µs")
    for k, v in doc["add_chain"]["per_compute_s"].items():
        print(f"add chain, per compute: {k:29s} {v * 1e6:8.2f} µs")
    for name, r in doc["matvec"].items():
        print(f"{name:5s} matvec: graph_compute {r['graph_compute'] * 1e3:7.3f} ms, kernel alone "
              f"{r['chunk kernel over all rows'] * 1e3:7.3f} ms, src1 conversion {r['src1 conversion'] * 1e6:6.1f} µs, "
              f"{r['ns per 32 weights']:5.2f} ns per 32 weights, {r['GB/s']:5.1f} GB/s of weights")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out} (load average {doc['loadavg']})")


if __name__ == "__main__":
    main()
