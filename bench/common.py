"""What every side of bench/run.py shares: the workloads, their data, and the timer.

Each side (peer_lite.py, peer_numpy.py, peer_ggml.py) has `run(n_threads, quick)` that returns
{workload key: measurement}. A measurement comes from `measure(fn)`: warm-up calls first (numba
compiles on the first one), then repeated calls, each timed alone with time.perf_counter, until
both `min_reps` calls and `min_time` seconds are done (or `max_reps`). The figure reported is the
best (minimum) time; the median and every time are kept. Around the timed loop the machine's busy
CPU time is read from /proc/stat and this process's own CPU time from time.process_time, so each
measurement also says how much CPU other processes took while it ran (`foreign_load`, in cores).
"""
import os
import subprocess
import time
from pathlib import Path

import numpy as np

MM_TYPES = ("Q4_0", "Q8_0", "Q4_K", "Q6_K", "F16")


def workloads():
    """The benchmark's workloads, in table order. mul_mat: out[n, m] = x[n, k] . W[m, k]^T, W in
    `type` (ggml: a = W with ne = [k, m], b = x with ne = [k, n]); add_chain: x = x + b repeated."""
    out = [dict(key="mul_mat F32 1024x1024 n=1024", kind="mul_mat", type="F32", m=1024, n=1024, k=1024)]
    for n in (1, 32):
        for t in MM_TYPES:
            out.append(dict(key=f"mul_mat {t} 4096x4096 n={n}", kind="mul_mat", type=t, m=4096, n=n, k=4096))
    out.append(dict(key="add chain 1000 x 16", kind="add_chain", n_nodes=1000, ne0=16))
    return out


def weights(m, k, seed=0):
    return np.random.default_rng(seed).uniform(-1, 1, (m, k)).astype(np.float32)


def activations(n, k, seed=1):
    return np.random.default_rng(seed).uniform(-1, 1, (n, k)).astype(np.float32)


def nmse(out, ref):
    """test-backend-ops' error measure: sum((out-ref)^2) / sum(ref^2)."""
    out, ref = np.asarray(out, np.float64), np.asarray(ref, np.float64)
    return float(np.sum((out - ref) ** 2) / np.sum(ref ** 2))


def reference(w, x):
    """float64 x . W^T, what every mul_mat result is compared with."""
    return x.astype(np.float64) @ w.astype(np.float64).T


def _busy_seconds():
    """CPU seconds all cores spent busy since boot (user+nice+system+irq+softirq+steal)."""
    try:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
    except OSError:
        return None
    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) / os.sysconf("SC_CLK_TCK")


def measure(fn, quick=False, min_time=0.5, min_reps=5, max_reps=5000, warmup=2):
    """Time fn(); see the module docstring. Returns a JSON-ready dict, times in seconds."""
    if quick:
        min_time, min_reps, max_reps = 0.05, 2, 5
    for _ in range(warmup):
        fn()
    times = []
    busy0, cpu0, wall0 = _busy_seconds(), time.process_time(), time.perf_counter()
    while len(times) < max_reps and (len(times) < min_reps or sum(times) < min_time):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    wall, cpu, busy1 = time.perf_counter() - wall0, time.process_time() - cpu0, _busy_seconds()
    # /proc/stat counts in clock ticks (10 ms): over less than 0.2 s the figure would be noise
    foreign = None if busy0 is None or wall < 0.2 else max(0.0, (busy1 - busy0) - cpu) / wall
    return dict(best=min(times), median=float(np.median(times)), reps=len(times), times=times,
                own_cpu_per_wall=cpu / wall, foreign_load=foreign)


def git_state():
    """The commit measured, and the files of ggml_lite/ and bench/ (results aside) that differ
    from it in the working tree (a shared checkout may hold others' uncommitted work)."""
    root = Path(__file__).resolve().parent.parent

    def git(*a):
        r = subprocess.run(["git", *a], cwd=root, capture_output=True, text=True)
        return r.stdout if r.returncode == 0 else None
    status = git("status", "--porcelain", "--", "ggml_lite", "bench", ":!bench/results", ":!*__pycache__*")
    changed = None if status is None else [line[3:] for line in status.splitlines() if line.strip()]
    commit = git("rev-parse", "HEAD")
    return dict(commit=commit and commit.strip(), dirty=None if changed is None else bool(changed), changed=changed)
