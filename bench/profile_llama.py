"""Where a llama decode (or prompt) step spends its time, node by node, in the compiled loop.

    PYTHONPATH=. .venv/bin/python bench/profile_llama.py MODEL.gguf [--tokens 1] [--steps 20]

Loads the model at 1 thread, evaluates a 64-token prompt, then times --steps reused steps (wall
time per step): decode steps of one token, or with --tokens N > 1 the first N tokens of the prompt
evaluated again from position 0 (a prompt of N). Then it sets the last graph's inputs and runs its compiled
program once more per step with a copy of graph_compute_thread that reads the time-stamp counter around every
task, and prints the time per op kind (MUL_MAT by weight type and shape), the sum over tasks, and
what is left of a step outside the tasks (the Python around the compute, the inputs, the logits).
A diagnostic: it reaches into ggml_lite's internals (the prepared program of
backends/cpu/compute.py), so it follows the current code, not a stable API.
"""
import argparse
import collections
import sys
import time
from pathlib import Path

import numpy as np
from numba import njit

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from ggml_lite import Op, Type, llama  # noqa: E402
from ggml_lite.backends.cpu import compute as C  # noqa: E402
from ggml_lite.backends.cpu import program as P  # noqa: E402
from ggml_lite.backends.cpu.atomics import cycle_counter  # noqa: E402


@njit(nogil=True)
def _timed_program(prog, fp, state, owner, slot, ticks):
    """graph_compute_thread on one thread, with the counter read around every task."""
    for k in range(prog.shape[0]):
        t0 = cycle_counter()
        if P.run_task(prog, fp, k, 0, 1, state, owner, slot) != 0:
            return k + 1
        ticks[k] += cycle_counter() - t0
    return 0


def _ticks_per_second():
    t0, c0 = time.perf_counter(), _now()
    time.sleep(1.0)
    return (_now() - c0) / (time.perf_counter() - t0)


@njit
def _now():
    return cycle_counter()


def _label(node):
    op = Op(node.op).name
    if op == "MUL_MAT":
        w = node.src[0]
        return f"MUL_MAT {Type(w.type).name} {w.ne[0]}x{w.ne[1]}" + (f"x{w.ne[2]}" if w.ne[2] > 1 else "")
    return op


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model")
    ap.add_argument("--tokens", type=int, default=1)
    ap.add_argument("--steps", type=int, default=20)
    args = ap.parse_args()
    m = llama.load(args.model, n_ctx=256, n_threads=1, n_batch=64, progress=False)
    prompt = list(range(10, 74))
    m.eval(prompt, 0, logits_all=False)
    n = args.tokens
    # decode: each step one position further; a prompt (n > 1): evaluated again from 0
    at = (lambda i: 64 + i) if n == 1 else (lambda i: 0)
    for i in range(3):
        m.eval(prompt[:n], at(i), logits_all=False)
    t0 = time.perf_counter()
    for i in range(3, 3 + args.steps):
        m.eval(prompt[:n], at(i), logits_all=False)
    step = (time.perf_counter() - t0) / args.steps
    n_past = at(3 + args.steps)
    gf = m.runner.sched.splits[0].graph
    prepared = C._PREPARED[gf]
    native = prepared.native
    ticks = np.zeros(native.prog.shape[0], np.int64)
    st = native.state
    st[P.ABORT], st[P.STOPPED], st[P.N_BARRIER], st[P.N_THREADS], st[P.HAS_ABORT] = 0, 0, 0, 1, 0
    native.cplan = m.runner.backends[0].plan[4]
    for _ in range(args.steps):
        m.last_graph.set_inputs(prompt[:n], n_past)    # the allocator reuses input memory
        failed = _timed_program(native.prog, native.fp, st, native.owner, native.slot, ticks)
        if failed:
            raise SystemExit(f"task {failed - 1} failed: {native.errors}")
    hz = _ticks_per_second()
    per_kind, count = collections.defaultdict(float), collections.Counter()
    kinds = {getattr(P, n): n[5:].lower() for n in dir(P) if n.startswith("TASK_")}
    for k, task in enumerate(native.tasks):
        key = f"{_label(task.node)} [{kinds[int(native.prog[k, P.KIND])]}]"
        per_kind[key] += ticks[k] / hz / args.steps
        count[key] += 1
    total = sum(per_kind.values())
    print(f"{Path(args.model).name}: {n} token(s) per step, {len(gf.nodes)} nodes, "
          f"{native.prog.shape[0]} tasks ({native.native_tasks()} compiled)")
    print(f"step (wall, reused graph) {step * 1e3:8.3f} ms")
    print(f"tasks (sum)               {total * 1e3:8.3f} ms")
    print(f"outside the tasks         {(step - total) * 1e3:8.3f} ms")
    for key, t in sorted(per_kind.items(), key=lambda kv: -kv[1]):
        print(f"  {t * 1e3:8.3f} ms  {count[key]:4d} x {t * 1e6 / count[key]:8.1f} us  {key}")


if __name__ == "__main__":
    main()
