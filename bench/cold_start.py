"""Cold and warm starts: how long a first computation waits for numba to compile, and how
long the same process takes once its compiled code is cached.

Each case runs in a fresh Python process. "cold": an empty numba cache (a fresh
NUMBA_CACHE_DIR; numba writes its cache there instead of next to the modules) and fresh
Python bytecode (a fresh PYTHONPYCACHEPREFIX), as after a fresh clone. "warm": the same
process again, with the caches the cold run filled. The cases:

* add: a one-node graph (add of two 1024-float vectors) through graph_compute_with_ctx;
* matvec: one Q8_0 mat-vec (4096 x 1024 weight, one F32 column) through graph_compute_with_ctx;
* cli: `python -m ggml_lite.llama tests/data/llama_q8_0.gguf -p "Once upon a time" -n 16`;
* llama110m: load the 110 M-parameter Q8_0 model of bench/llama_bench.py (written first, not
  timed), evaluate a 64-token prompt, decode 16 tokens, then evaluate the prompt again.

    PYTHONPATH=. python bench/cold_start.py --label after [--src DIR] [--repeat 2]
        [--cases add matvec cli llama110m] [--out bench/results/cold_start.json]

--src runs the cases against another checkout (main's code for the "before" column). The
results are merged into --out under --label, with the machine (lscpu's model name), the load
average around each run and the best (lowest) of --repeat cold and warm runs: wall-clock
seconds, and the CPU seconds the process used (user + system, all its threads), which a machine
busy with other work disturbs less (numba compiles on one thread, so on a quiet machine a cold
start's CPU time is about its wall time).
"""
import argparse
import json
import os
import platform
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HERE = Path(__file__).resolve().parent

ADD = r"""
import json, time
t0 = time.perf_counter()
import ggml_lite as ggml
ctx = ggml.init(mem_size=16 << 20)
a, b = (ggml.new_tensor_1d(ctx, ggml.Type.F32, 1024) for _ in range(2))
a.numpy()[...], b.numpy()[...] = 1.0, 2.0
c = ggml.add(ctx, a, b)
gf = ggml.new_graph(ctx)
ggml.build_forward_expand(gf, c)
t1 = time.perf_counter()
ggml.graph_compute_with_ctx(ctx, gf, 2)
t2 = time.perf_counter()
assert float(c.numpy().reshape(-1)[0]) == 3.0
print(json.dumps(dict(import_s=t1 - t0, first_compute_s=t2 - t1)))
"""

MATVEC = r"""
import json, time
import numpy as np
t0 = time.perf_counter()
import ggml_lite as ggml
ctx = ggml.init(mem_size=64 << 20)
K, M = 4096, 1024
w = ggml.new_tensor_2d(ctx, ggml.Type.Q8_0, K, M)
x = ggml.new_tensor_1d(ctx, ggml.Type.F32, K)
rng = np.random.default_rng(0)
blocks = np.zeros(M * K // 32, dtype=[("d", "<f2"), ("qs", "i1", 32)])
blocks["d"], blocks["qs"] = 0.01, rng.integers(-127, 128, (M * K // 32, 32))
w.numpy().reshape(-1)[...] = blocks.view(np.uint8)
x.numpy()[...] = 1.0
y = ggml.mul_mat(ctx, w, x)
gf = ggml.new_graph(ctx)
ggml.build_forward_expand(gf, y)
t1 = time.perf_counter()
ggml.graph_compute_with_ctx(ctx, gf, 2)
t2 = time.perf_counter()
ref = (blocks["qs"].astype(np.float64).reshape(M, K).sum(1) * float(np.float16(0.01)))
assert np.allclose(y.numpy().reshape(-1), ref, rtol=1e-3, atol=1e-2)
print(json.dumps(dict(import_s=t1 - t0, first_compute_s=t2 - t1)))
"""

LLAMA110M = r"""
import json, sys, time
t0 = time.perf_counter()
from ggml_lite import llama
path, n_decode = sys.argv[1], 16
vocab_path = sys.argv[2]
prompt = llama.load_vocab(vocab_path).tokenize(sys.argv[3])[:64]
m = llama.load(path, n_ctx=256, n_threads=2, n_batch=len(prompt), progress=False)
t1 = time.perf_counter()
m.eval(prompt, 0, logits_all=False)
t2 = time.perf_counter()
for i in range(n_decode):
    m.eval([prompt[i % len(prompt)]], len(prompt) + i, logits_all=False)
t3 = time.perf_counter()
m.eval(prompt, 0, logits_all=False)
t4 = time.perf_counter()
m.free()
print(json.dumps(dict(import_load_s=t1 - t0, first_prompt_s=t2 - t1,
                      decode_tokens_per_s=n_decode / (t3 - t2),
                      prompt_again_tokens_per_s=len(prompt) / (t4 - t3),
                      n_prompt=len(prompt))))
"""


def model_110m(models_dir):
    """The Q8_0 110 M model of llama_bench.py, written with this checkout's code."""
    sys.path.insert(0, str(HERE))
    import llama_bench
    paths, _ = llama_bench.write_models(models_dir)
    return paths["Q8_0"], llama_bench.PROMPT_TEXT


def case_command(case, src, models_dir):
    py = sys.executable
    if case == "add":
        return [py, "-c", ADD]
    if case == "matvec":
        return [py, "-c", MATVEC]
    if case == "cli":
        return [py, "-m", "ggml_lite.llama", str(Path(src) / "tests/data/llama_q8_0.gguf"),
                "-p", "Once upon a time", "-n", "16", "--no-progress"]
    if case == "llama110m":
        path, text = model_110m(models_dir)
        return [py, "-c", LLAMA110M, str(path),
                str(Path(src) / "tests/data/llama_vocab_spm.gguf"), text]
    raise SystemExit(f"cold_start: no case {case!r}")


def run_once(cmd, src, numba_dir, pyc_dir):
    env = dict(os.environ, PYTHONPATH=str(src), NUMBA_CACHE_DIR=str(numba_dir),
               PYTHONPYCACHEPREFIX=str(pyc_dir), PYTHONHASHSEED="0")
    load0 = os.getloadavg()[0]
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = subprocess.run(cmd, cwd=src, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    if out.returncode != 0:
        raise SystemExit(f"cold_start: {cmd[:3]} failed:\n{out.stderr[-3000:]}")
    row = dict(wall_s=round(wall, 2), cpu_s=round(cpu, 2), loadavg_before=load0,
               loadavg_after=os.getloadavg()[0])
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    if last.startswith("{"):
        row.update({k: round(v, 3) if isinstance(v, float) else v
                    for k, v in json.loads(last).items()})
    for line in out.stderr.splitlines():   # the command line's own timings
        if "prompt eval time" in line or "eval time" in line and "prompt" not in line:
            key = "prompt_eval" if "prompt" in line else "eval"
            row[key] = line.split("=", 1)[1].strip()
    n_cached = sum(1 for p in Path(numba_dir).rglob("*.nbc"))
    row["numba_cache_files"] = n_cached
    return row


def machine():
    try:
        model = next(line.split(":", 1)[1].strip()
                     for line in subprocess.run(["lscpu"], capture_output=True,
                                                text=True).stdout.splitlines()
                     if line.startswith("Model name"))
    except StopIteration:
        model = platform.processor()
    return dict(cpu=model, n_cpus=os.cpu_count(), python=platform.python_version())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--label", required=True, help="before (main's code) or after")
    ap.add_argument("--src", default=str(ROOT), help="the checkout whose code runs")
    ap.add_argument("--cases", nargs="+", default=["add", "matvec", "cli", "llama110m"])
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--models-dir", default=os.path.join(tempfile.gettempdir(),
                                                         "ggml_lite_llama_bench"))
    ap.add_argument("--out", default=str(HERE / "results/cold_start.json"))
    ap.add_argument("--note", default="")
    args = ap.parse_args()
    os.makedirs(args.models_dir, exist_ok=True)
    src = Path(args.src).resolve()
    results = {}
    for case in args.cases:
        cmd = case_command(case, src, args.models_dir)
        runs = []
        for r in range(args.repeat):
            with tempfile.TemporaryDirectory() as nb, tempfile.TemporaryDirectory() as pc:
                cold = run_once(cmd, src, nb, pc)
                warm = run_once(cmd, src, nb, pc)
            runs.append(dict(cold=cold, warm=warm))
            print(f"{args.label} {case} #{r}: cold {cold['wall_s']:.1f} s "
                  f"({cold['cpu_s']:.1f} s CPU), warm {warm['wall_s']:.1f} s "
                  f"({warm['cpu_s']:.1f} s CPU)  {json.dumps(cold)} | {json.dumps(warm)}",
                  flush=True)
        results[case] = dict(
            cold_s=min(x["cold"]["wall_s"] for x in runs),
            warm_s=min(x["warm"]["wall_s"] for x in runs),
            cold_cpu_s=min(x["cold"]["cpu_s"] for x in runs),
            warm_cpu_s=min(x["warm"]["cpu_s"] for x in runs), runs=runs)
    out = Path(args.out)
    data = json.loads(out.read_text()) if out.exists() else {}
    data["machine"] = {**data.get("machine", {}), **machine()}   # (keeps its note)
    # the cases run now replace theirs under the label; the label's others are kept
    label = data.setdefault("labels", {}).setdefault(args.label, {})
    label["cases"] = {**label.get("cases", {}), **results}
    label.update(note=args.note, date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()))
    out.write_text(json.dumps(data, indent=1) + "\n")


if __name__ == "__main__":
    main()
