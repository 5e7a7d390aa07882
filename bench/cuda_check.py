#!/usr/bin/env python3
"""The CUDA backend on a real GPU, in one run (about 2-4 minutes on an H200):

1. the oracle harness (tests/backend_ops_cases.py, test-backend-ops' cases and error limits)
   through the CUDA backend: every case whose nodes it claims must pass, every other is counted;
2. a scheduler over CUDA + CPU with weights on both (if ggml_lite.sched is in this checkout):
   splits and copies recorded, results compared with the CPU alone;
3. the benchmark: Q4_0 / Q8_0 / Q4_K / Q6_K 4096x4096 mat-vec in GB/s (the kernel alone, replayed
   from a CUDA graph, and the whole node through backend_graph_compute), an F16 4096^3 GEMM through
   the backend against cupy.matmul on the same F16 arrays, and the cost of one node launched from
   Python (a graph of 256 small ADDs);
4. the chapter's code cells, executed in order in one namespace (their outputs are not stored:
   `make outputs NB=book/11_cuda.ipynb` does that, and needs nbclient and ipykernel there);
5. the paths of the chapter's section "One launch per graph": Q4_0 / Q8_0 mat-vecs of 14336 x 4096
   and 4096 x 14336 (33 and 62 MB of weights, 4x the 4096 x 4096 of part 3) in GB/s; the 256-node graph node by node and replayed as
   one CUDA graph (microseconds per node, the same bits); the 110 M llama files of
   bench/llama_bench.py in Q4_0 and Q8_0 (and Gemma 3 270M when ggml_lite.llama.fetch has it on
   disk; never fetched here) on CUDA + CPU: prompt and decode tokens/s with CUDA graphs on and off.

With --emulated the same run goes through the emulated CUDA device (GGML_LITE_CUDA_EMU=1, no GPU,
a C++ compiler): every result is checked, the GPU-only timings (CUDA events) are left out, and the
report, marked EMULATED, goes to the temporary directory, never to bench/results/cuda.json:

    PYTHONPATH=. python3 bench/cuda_check.py --emulated --skip-harness [--skip-chapter]

    PYTHONPATH=. python3 bench/cuda_check.py [--out bench/results/cuda.json] [--skip-harness]
    PYTHONPATH=. python3 bench/cuda_check.py --cpu-dry-run     # the plumbing only, on the CPU backend

Needs numpy, numba, cupy (any cupy-cuda1Nx) and, for the harness, the `gguf` package. Exit status
1 if a claimed harness case fails, a scheduler result differs, a mat-vec result is wrong or a
chapter cell fails.

On a machine whose Python has numpy, numba and cupy but no gguf (no network there), carry gguf as a
wheel: here, `python3 -m pip download --no-deps --only-binary=:all: -d WHEELS gguf` (gguf's other
needs, pyyaml and tqdm, are usually there); there,
`python3 -m pip install -q --no-index --no-deps --target SITE WHEELS/*.whl`, then
`PYTHONPATH=SITE:. PYTHONUNBUFFERED=1 python3 bench/cuda_check.py --out OUTDIR/cuda.json`.
The chapter's stored outputs come from `make outputs NB=book/11_cuda.ipynb` on such a machine,
which needs nbclient and ipykernel as well.
"""
import argparse
import json
import os
import platform
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

import numpy as np  # noqa: E402

import ggml_lite as ggml  # noqa: E402
from ggml_lite import Type  # noqa: E402

H200_BANDWIDTH_GBS = 4800.0


def nmse(got, want):
    want = np.asarray(want, np.float64)
    return float(np.sum((np.asarray(got, np.float64) - want) ** 2) / max(np.sum(want ** 2), 1e-30))


# --- 1. the oracle harness -------------------------------------------------------------------

def run_harness(backend):
    import backend_ops_cases as B
    out = {"cases": 0, "claimed": 0, "passed": 0, "failures": [], "by_op": {}}
    for case in B.make_test_cases():
        out["cases"] += 1
        row = out["by_op"].setdefault(case.op, {"cases": 0, "claimed": 0, "passed": 0})
        row["cases"] += 1
        try:
            v = B.eval_case(case, compute=B.backend_compute(backend), no_alloc=True,
                            alloc=B.backend_alloc(backend), supports=B.backend_supports(backend))
        except Exception as e:
            out["claimed"] += 1
            row["claimed"] += 1
            out["failures"].append({"case": case.name(), "error": f"{type(e).__name__}: {e}"})
            continue
        if not v.supported:
            continue
        out["claimed"] += 1
        row["claimed"] += 1
        if v.ok:
            out["passed"] += 1
            row["passed"] += 1
        else:
            out["failures"].append({"case": case.name(), "verdict": str(v)})
    return out


# --- 2. a scheduler over CUDA + CPU ----------------------------------------------------------

def _layer_weights(buft, n_embd, rng_seed):
    """Two layers' weights (rms_norm gain, F32 and Q8_0 matrices) in one buffer of type buft."""
    ctx = ggml.init(mem_size=16 * ggml.tensor_overhead(), no_alloc=True)
    ws = []
    rng = np.random.default_rng(rng_seed)
    for _ in range(2):
        g = ggml.new_tensor_1d(ctx, Type.F32, n_embd)
        a = ggml.new_tensor_2d(ctx, Type.F32, n_embd, n_embd)
        b = ggml.new_tensor_2d(ctx, Type.Q8_0, n_embd, n_embd)
        ws.append((g, a, b))
    buf = ggml.backend_alloc_ctx_tensors_from_buft(ctx, buft)
    ggml.backend_buffer_set_usage(buf, ggml.BackendBufferUsage.WEIGHTS)
    for g, a, b in ws:
        ggml.backend_tensor_set(g, rng.uniform(0.5, 1.5, n_embd).astype(np.float32))
        ggml.backend_tensor_set(a, (rng.standard_normal((n_embd, n_embd)) / np.sqrt(n_embd)).astype(np.float32))
        rows = (rng.standard_normal((n_embd, n_embd)) / np.sqrt(n_embd)).astype(np.float32)
        ggml.backend_tensor_set(b, ggml.quantize_chunk(Type.Q8_0, rows))
    return ctx, buf, ws


def _layers_graph(layers, n_embd, n_tok):
    ctx = ggml.init(mem_size=64 * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
    x = ggml.new_tensor_2d(ctx, Type.F32, n_embd, n_tok)
    ggml.set_input(x)
    cur = x
    for g, a, b in layers:
        h = ggml.mul(ctx, ggml.rms_norm(ctx, cur, 1e-5), g)
        h = ggml.mul_mat(ctx, b, ggml.silu(ctx, ggml.mul_mat(ctx, a, h)))
        cur = ggml.add(ctx, cur, h)
    ggml.set_output(cur)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, cur)
    return ctx, gf, x, cur


PREDICTED_SPLITS = {1: 2, 64: 4}    # test_stand_in_scheduler_splits_over_cuda_and_cpu, without a GPU


def run_scheduler(gpu, cpu, n_embd=512):
    if not hasattr(ggml, "backend_sched_new"):
        return {"skipped": "ggml_lite has no scheduler (the sched chapter is not in this checkout)"}
    out = {}
    # layer 0's weights in host memory, layer 1's on the GPU (as llama.cpp offloads the last layers)
    wctx0, wbuf0, w0 = _layer_weights(ggml.backend_get_default_buffer_type(cpu), n_embd, 1)
    wctx1, wbuf1, w1 = _layer_weights(ggml.backend_get_default_buffer_type(gpu), n_embd, 1)
    wctxc, wbufc, wc = _layer_weights(ggml.backend_get_default_buffer_type(cpu), n_embd, 1)
    try:
        for n_tok in (1, 64):
            x_data = np.random.default_rng(n_tok).standard_normal((n_tok, n_embd)).astype(np.float32)
            results = {}
            for name, backends, layers in (("mixed", [gpu, cpu], [w0[0], w1[1]]), ("cpu", [cpu], [wc[0], wc[1]])):
                sched = ggml.backend_sched_new(backends, None, len(backends), ggml.DEFAULT_GRAPH_SIZE, False, True)
                ctx, gf, x, y = _layers_graph(layers, n_embd, n_tok)
                assert ggml.backend_sched_alloc_graph(sched, gf)
                ggml.backend_tensor_set(x, x_data)
                status = ggml.backend_sched_graph_compute(sched, gf)
                assert status == ggml.Status.SUCCESS, status
                results[name] = ggml.backend_tensor_get(y)
                if name == "mixed":
                    out[f"n_tok={n_tok}"] = {"n_splits": ggml.backend_sched_get_n_splits(sched),
                                             "n_copies": ggml.backend_sched_get_n_copies(sched)}
                    if hasattr(ggml, "backend_sched_print_assignments"):
                        import io
                        text = io.StringIO()
                        ggml.sched_passes.backend_sched_print_assignments(sched, gf, 1, False, text)
                        out[f"n_tok={n_tok}"]["assignments"] = text.getvalue()
                ggml.backend_sched_free(sched)
                ggml.free(ctx)
            err = nmse(results["mixed"], results["cpu"])
            row = out[f"n_tok={n_tok}"]
            row["nmse_vs_cpu"] = err
            row["predicted_splits"] = PREDICTED_SPLITS[n_tok]      # tests/test_cuda.py derives them
            row["ok"] = err < 5e-4 and row["n_splits"] == PREDICTED_SPLITS[n_tok]
    finally:
        for buf, ctx in ((wbuf0, wctx0), (wbuf1, wctx1), (wbufc, wctxc)):
            ggml.backend_buffer_free(buf)
            ggml.free(ctx)
    return out


# --- 3. the benchmark ------------------------------------------------------------------------

def _gpu_time(fn, reps, stream):
    """Seconds per call of fn() on stream, from CUDA events around reps calls (after one warm-up)."""
    import cupy as cp
    fn()
    stream.synchronize()
    start, end = cp.cuda.Event(), cp.cuda.Event()
    start.record(stream)
    for _ in range(reps):
        fn()
    end.record(stream)
    end.synchronize()
    return cp.cuda.get_elapsed_time(start, end) / 1e3 / reps


def _matvec_node(backend, wtype, n=4096, ncols=1, seed=0):
    ctx = ggml.init(mem_size=8 * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
    w = ggml.new_tensor_2d(ctx, wtype, n, n)
    x = ggml.new_tensor_2d(ctx, Type.F32, n, ncols)
    y = ggml.mul_mat(ctx, w, x)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, y)
    buf = ggml.backend_alloc_ctx_tensors(ctx, backend)
    rng = np.random.default_rng(seed)
    rows = rng.standard_normal((n, n)).astype(np.float32)
    ggml.backend_tensor_set(w, rows.astype(np.float16) if wtype == Type.F16 else ggml.quantize_chunk(wtype, rows))
    ggml.backend_tensor_set(x, rng.standard_normal((ncols, n)).astype(np.float32))
    return ctx, buf, gf, w, x, y


def bench_matvec(gpu, cpu, wtype, reps=200):
    import cupy as cp
    from ggml_lite.backends.cuda import kernels as ck
    ctx, buf, gf, w, x, y = _matvec_node(gpu, wtype)
    res = {"type": ggml.type_name(wtype), "weight_bytes": ggml.nbytes(w)}
    # correctness: the same product on the CPU
    assert ggml.backend_graph_compute(gpu, gf) == ggml.Status.SUCCESS
    got = ggml.backend_tensor_get(y)
    cctx, cbuf, cgf, _, _, cy = _matvec_node(cpu, wtype)
    ggml.backend_graph_compute(cpu, cgf)
    res["nmse_vs_cpu"] = nmse(got, ggml.backend_tensor_get(cy))
    res["ok"] = res["nmse_vs_cpu"] < 5e-4
    ggml.backend_buffer_free(cbuf)
    ggml.free(cctx)
    stream = gpu.stream
    with cp.cuda.Device(gpu.device_id), stream:
        q8, ne10_padded = ck.cuda_quantize_q8_1(gpu, x)
        launch = lambda: ck.cuda_mul_mat_vec_q_launch(gpu, y, q8.data.ptr, ne10_padded)   # noqa: E731
        launch_s = _gpu_time(launch, reps, stream)
        res["kernel_loop_us"] = launch_s * 1e6
        try:                                    # the kernel alone: reps launches replayed as one CUDA graph
            stream.begin_capture()
            for _ in range(reps):
                launch()
            graph = stream.end_capture()
            kernel_s = _gpu_time(lambda: graph.launch(stream), 5, stream) / reps
            res["kernel_method"] = "CUDA graph replay"
        except Exception as e:
            kernel_s = launch_s
            res["kernel_method"] = f"launch loop (graph capture failed: {type(e).__name__}: {e})"
        gpu._scratch.clear()
    res["kernel_us"] = kernel_s * 1e6
    res["kernel_GBps"] = ggml.nbytes(w) / kernel_s / 1e9
    res["fraction_of_4.8TBps"] = res["kernel_GBps"] / H200_BANDWIDTH_GBS
    t = time.perf_counter()
    for _ in range(50):
        ggml.backend_graph_compute(gpu, gf)
    res["node_us"] = (time.perf_counter() - t) / 50 * 1e6      # quantize + mat-vec + Python + synchronize
    ggml.backend_buffer_free(buf)
    ggml.free(ctx)
    return res


def bench_gemm_f16(gpu, n=4096, reps=20):
    import cupy as cp
    ctx = ggml.init(mem_size=8 * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
    w = ggml.new_tensor_2d(ctx, Type.F16, n, n)
    x = ggml.new_tensor_2d(ctx, Type.F32, n, n)
    y = ggml.mul_mat(ctx, w, x)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, y)
    buf = ggml.backend_alloc_ctx_tensors(ctx, gpu)
    rng = np.random.default_rng(0)
    ggml.backend_tensor_set(w, rng.standard_normal((n, n)).astype(np.float16))
    ggml.backend_tensor_set(x, rng.standard_normal((n, n)).astype(np.float32))
    flop = 2.0 * n * n * n
    ours = _gpu_time(lambda: ggml.backend_graph_compute_async(gpu, gf), reps, gpu.stream)
    with cp.cuda.Device(gpu.device_id):
        a = cp.asarray(rng.standard_normal((n, n)).astype(np.float16))
        b = cp.asarray(rng.standard_normal((n, n)).astype(np.float16))
        s = cp.cuda.Stream(non_blocking=True)
        with s:
            ref = _gpu_time(lambda: cp.matmul(a, b), reps, s)
    ggml.backend_buffer_free(buf)
    ggml.free(ctx)
    return {"n": n, "ggml_lite_TFLOPs": flop / ours / 1e12, "cupy_matmul_f16_TFLOPs": flop / ref / 1e12,
            "ggml_lite_ms": ours * 1e3, "cupy_matmul_ms": ref * 1e3,
            "note": "ggml_lite converts src1 F32->F16 and the F16 result to F32 around the same GEMM"}


def bench_launch_overhead(backend, n_nodes=256):
    ctx = ggml.init(mem_size=(2 * n_nodes + 8) * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
    t = ggml.new_tensor_1d(ctx, Type.F32, 1024)
    for _ in range(n_nodes):
        t = ggml.add(ctx, t, t)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, t)
    buf = ggml.backend_alloc_ctx_tensors(ctx, backend)
    ggml.backend_tensor_set(ggml.graph_node(gf, 0).src[0], np.zeros(1024, np.float32))
    ggml.backend_graph_compute(backend, gf)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        ggml.backend_graph_compute(backend, gf)
        best = min(best, time.perf_counter() - start)
    ggml.backend_buffer_free(buf)
    ggml.free(ctx)
    return {"backend": ggml.backend_name(backend), "nodes": n_nodes, "us_per_node": best / n_nodes * 1e6}


# --- 4. the chapter's cells, run in one namespace (a smoke test; make outputs stores them) ----

def run_chapter_cells(path=ROOT / "book" / "11_cuda.ipynb"):
    import contextlib
    import io
    nb = json.loads(path.read_text())
    namespace, done = {"__name__": "__main__"}, []
    for cell in nb["cells"]:
        if cell["cell_type"] != "code":
            continue
        src = "".join(cell["source"]) if isinstance(cell["source"], list) else cell["source"]
        code = "\n".join(l for l in src.splitlines() if not l.startswith("#|"))
        printed = io.StringIO()
        try:
            with contextlib.redirect_stdout(printed):
                exec(compile(code, f"{path.name}#{cell.get('id')}", "exec"), namespace)
        except Exception as e:
            return {"ok": False, "cells_run": done, "failed_cell": cell.get("id"),
                    "error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        done.append({"id": cell.get("id"), "stdout": printed.getvalue()[-2000:]})
    return {"ok": True, "cells_run": done}


# --- 5. the paths of "One launch per graph": graphs, large mat-vecs, GEMM, models ----------

def _graphs_env(on):
    """GGML_CUDA_DISABLE_GRAPHS unset (on) or set (off)."""
    from ggml_lite.backends.cuda import graphs
    if on:
        os.environ.pop(graphs.GRAPHS_ENV, None)
    else:
        os.environ[graphs.GRAPHS_ENV] = "1"


def _sync(backend):
    if backend is not None:
        ggml.backend_synchronize(backend)


def bench_graph_replay(gpu, n_nodes=256, reps=20):
    """The 256-ADD graph of launch_overhead, node by node and replayed as one CUDA graph:
    microseconds per node (host wall time, synchronized), and the replayed result's bits."""
    ctx = ggml.init(mem_size=(2 * n_nodes + 8) * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
    x = ggml.new_tensor_1d(ctx, Type.F32, 1024)
    t = x
    for _ in range(n_nodes):
        t = ggml.add(ctx, t, x)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, t)
    buf = ggml.backend_alloc_ctx_tensors(ctx, gpu)
    ggml.backend_tensor_set(x, np.linspace(-1, 1, 1024, dtype=np.float32))
    out = {"nodes": n_nodes}
    results = {}
    for on in (False, True):
        _graphs_env(on)
        gpu.graph_stats.update(eager=0, captures=0, replays=0, incompatible=0, capture_failed=0)
        for _ in range(3):                                  # warm-up, capture
            ggml.backend_graph_compute(gpu, gf)
        best = float("inf")
        for _ in range(reps):
            start = time.perf_counter()
            ggml.backend_graph_compute(gpu, gf)
            _sync(gpu)
            best = min(best, time.perf_counter() - start)
        key = "graphs_on" if on else "graphs_off"
        out[key] = {"us_per_node": best / n_nodes * 1e6, **gpu.graph_stats}
        results[key] = ggml.backend_tensor_get(t)
    _graphs_env(True)
    out["same_bits"] = bool(np.array_equal(results["graphs_on"], results["graphs_off"]))
    out["ok"] = out["same_bits"] and out["graphs_on"]["replays"] >= reps
    ggml.backend_buffer_free(buf)
    ggml.free(ctx)
    return out


def bench_matvec_large(gpu, cpu, wtype, rows, k, reps, emulated):
    """A rows x k mat-vec (4x the weights of part 3's): the result against the CPU's; on a GPU
    the mat-vec kernel's time from CUDA events around a captured graph of reps launches, as GB/s
    of weights read."""
    def node(backend):
        ctx = ggml.init(mem_size=8 * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
        w, x = ggml.new_tensor_2d(ctx, wtype, k, rows), ggml.new_tensor_2d(ctx, Type.F32, k, 1)
        y = ggml.mul_mat(ctx, w, x)
        gf = ggml.new_graph(ctx)
        ggml.build_forward_expand(gf, y)
        buf = ggml.backend_alloc_ctx_tensors(ctx, backend)
        rng = np.random.default_rng(rows)
        ggml.backend_tensor_set(w, ggml.quantize_chunk(wtype, rng.standard_normal((rows, k)).astype(np.float32)))
        ggml.backend_tensor_set(x, rng.standard_normal((1, k)).astype(np.float32))
        return ctx, buf, gf, w, y

    res = {"type": ggml.type_name(wtype), "rows": rows, "k": k}
    got = {}
    for name, backend in (("gpu", gpu), ("cpu", cpu)):
        ctx, buf, gf, w, y = node(backend)
        ggml.backend_graph_compute(backend, gf)
        got[name] = ggml.backend_tensor_get(y)
        res["weight_bytes"] = ggml.nbytes(w)
        if name == "gpu" and not emulated:
            import cupy as cp
            from ggml_lite.backends.cuda import kernels as ck
            stream = gpu.stream
            with cp.cuda.Device(gpu.device_id), stream:
                q8, ne10_padded = ck.cuda_quantize_q8_1(gpu, y.src[1])
                stream.begin_capture()              # the mat-vec kernel alone, reps times
                for _ in range(reps):
                    ck.cuda_mul_mat_vec_q_launch(gpu, y, q8.data.ptr, ne10_padded)
                graph = stream.end_capture()
                s = _gpu_time(lambda: graph.launch(stream), 5, stream) / reps
                gpu._scratch.clear()
            res["kernel_us"] = s * 1e6
            res["GBps"] = ggml.nbytes(w) / s / 1e9
            res["fraction_of_4.8TBps"] = res["GBps"] / H200_BANDWIDTH_GBS
        ggml.backend_buffer_free(buf)
        ggml.free(ctx)
    res["nmse_vs_cpu"] = nmse(got["gpu"], got["cpu"])
    res["ok"] = res["nmse_vs_cpu"] < 5e-4
    return res


def bench_model(gpu, cpu, path, n_prompt, n_decode, emulated):
    """A llama GGUF on CUDA (all layers) and the CPU under the scheduler: prompt tokens/s (one
    batch) and decode tokens/s, with CUDA graphs on and off; the decode logits' bits compared."""
    from ggml_lite import llama
    m = llama.load(path, n_ctx=256, backends=[gpu, cpu], n_threads=os.cpu_count(), progress=False)
    prompt = [int(t) for t in np.random.default_rng(0).integers(3, m.hparams.n_vocab, n_prompt)]
    out, logits = {"file": Path(path).name, "n_prompt": n_prompt, "n_decode": n_decode}, {}
    try:
        for on in (True, False):
            _graphs_env(on)
            gpu.graph_stats.update(eager=0, captures=0, replays=0, incompatible=0, capture_failed=0)
            m.kv.n_filled = 0
            m.eval(prompt[:4], 0, logits_all=False)                # warm-up: compiles, first graphs
            m.kv.n_filled = 0
            t0 = time.perf_counter()
            last = m.eval(prompt, 0, logits_all=False)[-1]
            _sync(gpu)
            pp = time.perf_counter() - t0
            rows, t0 = [], time.perf_counter()
            for i in range(n_decode):
                last = m.eval([int(np.argmax(last))], n_prompt + i, logits_all=False)[-1]
                rows.append(last)
            _sync(gpu)
            tg = time.perf_counter() - t0
            key = "graphs_on" if on else "graphs_off"
            out[key] = {"prompt_tok_s": n_prompt / pp, "decode_tok_s": n_decode / tg, **gpu.graph_stats}
            logits[key] = np.array(rows)
    finally:
        _graphs_env(True)
        m.free()
    out["same_bits"] = bool(np.array_equal(logits["graphs_on"], logits["graphs_off"]))
    out["ok"] = out["same_bits"]
    return out


def run_new_paths(report, gpu, cpu, emulated, models_dir):
    """Part 5; on the emulated device every figure is a host time of the CPU's emulation."""
    big = [(14336, 4096), (4096, 14336)]
    for wtype in (Type.Q4_0, Type.Q8_0):
        for rows, k in big:
            _part(report, f"matvec_{ggml.type_name(wtype)}_{rows}x{k}", bench_matvec_large, gpu, cpu, wtype, rows,
                  k, 100, emulated)
    _part(report, "graph_replay", bench_graph_replay, gpu, 256, 5 if emulated else 20)
    if emulated:
        _part(report, "gemm_f16_emulated_512", bench_gemm_emulated, gpu, 512)
    sys.path.insert(0, str(ROOT / "bench"))
    from llama_bench import write_models
    models_dir.mkdir(parents=True, exist_ok=True)
    paths, _ = write_models(models_dir)
    n_prompt, n_decode = (16, 4) if emulated else (64, 32)
    for t, path in paths.items():
        _part(report, f"model_110m_{t.lower()}", bench_model, gpu, cpu, path, n_prompt, n_decode, emulated)
    from ggml_lite.llama import fetch
    gemma = fetch.models_dir() / fetch.GEMMA3_270M
    if gemma.exists():                                      # never fetched here: only used when present
        _part(report, "model_gemma3_270m", bench_model, gpu, cpu, gemma, n_prompt, n_decode, emulated)
    else:
        report["model_gemma3_270m"] = {"skipped": f"{gemma.name} is not in {gemma.parent}"}


def bench_gemm_emulated(gpu, n):
    """The F16 product through the backend on the emulated device: its result against numpy's
    (the emulated device's matmul is numpy's; no speed is read from it)."""
    ctx = ggml.init(mem_size=8 * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
    w, x = ggml.new_tensor_2d(ctx, Type.F16, n, n), ggml.new_tensor_2d(ctx, Type.F32, n, n)
    y = ggml.mul_mat(ctx, w, x)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, y)
    buf = ggml.backend_alloc_ctx_tensors(ctx, gpu)
    rng = np.random.default_rng(0)
    a, b = rng.standard_normal((n, n)).astype(np.float16), rng.standard_normal((n, n)).astype(np.float32)
    ggml.backend_tensor_set(w, a)
    ggml.backend_tensor_set(x, b)
    t0 = time.perf_counter()
    ggml.backend_graph_compute(gpu, gf)
    s = time.perf_counter() - t0
    got = ggml.backend_tensor_get(y).reshape(n, n)
    err = nmse(got, b.astype(np.float64) @ a.astype(np.float64).T)
    ggml.backend_buffer_free(buf)
    ggml.free(ctx)
    return {"n": n, "nmse": err, "ok": err < 5e-4, "host_s": s}

# --- the run ---------------------------------------------------------------------------------

def _part(report, name, fn, *args):
    t = time.perf_counter()
    try:
        report[name] = fn(*args)
        if "EMULATED" in report and isinstance(report[name], dict):
            report[name]["EMULATED"] = True         # every time in it is the emulation's, not a GPU's
    except Exception as e:
        report[name] = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
    report.setdefault("seconds", {})[name] = round(time.perf_counter() - t, 1)
    print(f"== {name} ({report['seconds'][name]} s)\n{json.dumps(report[name], indent=1)[:4000]}", flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=None,
                    help="default bench/results/cuda.json; with --emulated a file in the temporary directory")
    ap.add_argument("--skip-harness", action="store_true")
    ap.add_argument("--skip-chapter", action="store_true")
    ap.add_argument("--cpu-dry-run", action="store_true", help="run the harness and scheduler parts on the CPU backend")
    ap.add_argument("--emulated", action="store_true",
                    help="the emulated CUDA device (GGML_LITE_CUDA_EMU=1): results checked, no figure is a GPU's speed")
    ap.add_argument("--models-dir", type=Path, default=Path(tempfile.gettempdir()) / "ggml_lite_bench_models",
                    help="where the 110M llama files are written (once)")
    args = ap.parse_args(argv)
    stored = ROOT / "bench" / "results" / "cuda.json"
    if args.out is None:
        args.out = Path(tempfile.gettempdir()) / "cuda_check_emulated.json" if args.emulated else stored
    if args.emulated and args.out.resolve() == stored.resolve():
        print(f"cuda_check: {stored} holds a GPU's run; emulated figures are not written there", file=sys.stderr)
        return 2
    report = {"machine": platform.node(), "python": platform.python_version(), "numpy": np.__version__}
    if args.emulated:
        os.environ["GGML_LITE_CUDA_EMU"] = "1"
        report["EMULATED"] = ("the emulated CUDA device: every time here is the CPU's emulation of the kernels, "
                              "none is a GPU's speed")
    cpu = ggml.backend_cpu_init()
    if args.cpu_dry_run:
        gpu = cpu
    else:
        ok, why = ggml.backends.cuda.backend.cuda_availability()
        if not ok:
            print(f"cuda_check: the CUDA backend cannot run here: {why}", file=sys.stderr)
            return 2
        gpu = ggml.backend_cuda_init(0)
        report["device"] = ggml.backend_cuda_get_device_description(0)
        if not args.emulated:
            import cupy as cp
            report.update(cupy=cp.__version__, cuda_runtime=cp.cuda.runtime.runtimeGetVersion(),
                          driver=cp.cuda.runtime.driverGetVersion())
    if not args.skip_harness:
        _part(report, "harness", run_harness, gpu)
    if not args.cpu_dry_run:
        _part(report, "scheduler", run_scheduler, gpu, cpu)
        if not args.emulated:
            for wtype in (Type.Q4_0, Type.Q8_0, Type.Q4_K, Type.Q6_K):
                _part(report, f"matvec_{ggml.type_name(wtype)}", bench_matvec, gpu, cpu, wtype)
            _part(report, "gemm_f16", bench_gemm_f16, gpu)
        _part(report, "launch_overhead_cuda", bench_launch_overhead, gpu)
        run_new_paths(report, gpu, cpu, args.emulated, args.models_dir)
    _part(report, "launch_overhead_cpu", bench_launch_overhead, cpu)
    if not args.cpu_dry_run and not args.skip_chapter:
        _part(report, "chapter", run_chapter_cells)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=1) + "\n")
    bad = []
    h = report.get("harness", {})
    if "error" in h or h.get("failures"):
        bad.append(f"harness: {len(h.get('failures', []))} claimed cases failed" if "error" not in h else "harness raised")
    for name, part in report.items():
        if isinstance(part, dict) and ("error" in part or part.get("ok") is False) and name != "harness":
            bad.append(name)
        if name == "scheduler" and isinstance(part, dict):
            bad += [f"scheduler {k}" for k, v in part.items() if isinstance(v, dict) and v.get("ok") is False]
    label = " (EMULATED: no figure is a GPU's speed)" if args.emulated else ""
    print(f"cuda_check: wrote {args.out}{label}; " + ("all checks passed" if not bad else "FAILED: " + ", ".join(bad)))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
