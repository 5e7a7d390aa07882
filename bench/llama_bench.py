"""Prompt and decode speed of ggml_lite.llama next to llama.cpp's, on the same model files.

Writes two llama models of about 110 M parameters (n_embd 768, 12 layers, 12 heads, n_ff 2048,
the 32,000-token SPM vocabulary of tests/data, output head tied to the embeddings) with
ggml_lite.llama.write_llama_gguf, in Q4_0 and Q8_0, then for each file and thread count:

* prompt processing: one eval of a 64-token prompt (one graph, batch 64), tokens per second,
  right after a decode step, so that its graph is recorded, split and allocated again
  (llama.cpp re-records it too, in C++); ggml_lite's CPU stream finds the plan and compiled
  program it kept for a graph of the same content earlier in the round (chapter 07c) ("pp");
* the same, with the stream's kept programs dropped first, so that the prompt's graph is also
  planned and lowered to a program in Python ("pp_unkept"; compared with llama.cpp's "pp",
  since llama.cpp keeps nothing of the kind);
* the same prompt evaluated again at position 0 right after: both sides reuse the prompt's
  graph (only its inputs are set), so this is the compute of the step ("pp_again");
* token generation: 32 single-token decode steps through the KV cache, tokens per second;

for ggml_lite and for llama.cpp (llama-cpp-python, CPU, flash attention off, F16 KV cache), each
after a warm-up run, best of --repeat rounds, the two sides interleaved. Results go to
bench/results/llama.json with the ratio ggml_lite / llama.cpp.

    PYTHONPATH=. .venv/bin/python bench/llama_bench.py --llama-python /path/to/llama-venv/bin/python \
        [--models-dir DIR] [--threads 1 2] [--repeat 3]

--llama-python defaults to $LLAMA_CPP_PYTHON; without it only ggml_lite is measured.
"""
import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
N_PROMPT, N_DECODE, N_CTX = 64, 32, 256
HPARAMS = dict(n_vocab=32000, n_ctx_train=2048, n_embd=768, n_layer=12, n_ff=2048, n_head=12, n_head_kv=12,
               n_rot=64, f_norm_rms_eps=1e-5)
PROMPT_TEXT = ("The quick brown fox jumps over the lazy dog while the llama reads a book about tensors, "
               "graphs, backends and the allocator that plans memory once and reuses it for every token.")

PEER = r"""
import json, sys, time
import llama_cpp
path, threads, repeat, prompt = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
n_decode = int(sys.argv[5])
llm = llama_cpp.Llama(model_path=path, n_ctx=%d, n_batch=len(prompt), n_ubatch=len(prompt), n_threads=threads,
                      n_threads_batch=threads, flash_attn=False, logits_all=False, verbose=False)
best_pp = best_pp2 = best_tg = float("inf")
for r in range(repeat + 1):
    llm.reset()
    t0 = time.perf_counter(); llm.eval(prompt); pp = time.perf_counter() - t0
    llm.reset()
    t0 = time.perf_counter(); llm.eval(prompt); pp2 = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(n_decode):
        llm.eval([prompt[i %% len(prompt)]])
    tg = time.perf_counter() - t0
    if r:                                   # round 0 warms up
        best_pp, best_pp2, best_tg = min(best_pp, pp), min(best_pp2, pp2), min(best_tg, tg)
print(json.dumps({"pp_s": best_pp, "pp_again_s": best_pp2, "tg_s": best_tg}))
""" % N_CTX


def write_models(models_dir):
    from ggml_lite.llama import LlamaHParams, load_vocab, write_llama_gguf
    from ggml_lite.types import Type
    vocab = load_vocab(ROOT / "tests/data/llama_vocab_spm.gguf")
    hp = LlamaHParams(**HPARAMS)
    paths = {}
    for t in ("Q4_0", "Q8_0"):
        path = Path(models_dir) / f"llama_110m_{t.lower()}.gguf"
        if not path.exists():
            t0 = time.perf_counter()
            write_llama_gguf(path, hp, vocab, Type[t], seed=110, tied=True)
            print(f"wrote {path} ({path.stat().st_size / 2**20:.1f} MiB) in {time.perf_counter() - t0:.0f} s")
        paths[t] = path
    return paths, vocab


def n_params():
    e, l, ff, v = HPARAMS["n_embd"], HPARAMS["n_layer"], HPARAMS["n_ff"], HPARAMS["n_vocab"]
    return v * e + l * (4 * e * e + 3 * e * ff + 2 * e) + e


def measure_lite(path, threads, repeat, prompt):
    from ggml_lite import llama
    m = llama.load(path, n_ctx=N_CTX, n_threads=threads, n_batch=len(prompt), progress=False)
    best_pp = best_pp2 = best_tg = float("inf")
    best_new = float("inf")
    for r in range(repeat + 1):
        # a prompt whose graph content the CPU stream has not kept: its kept programs
        # dropped first (07c), so that this prompt is recorded, split, allocated, planned
        # and lowered to a program, all of it
        for b in m.backends:
            if hasattr(b, "programs"):
                b.programs.entries.clear()
        t0 = time.perf_counter()
        m.eval(prompt, 0, logits_all=False)
        pp_new = time.perf_counter() - t0
        m.eval([prompt[0]], len(prompt), logits_all=False)      # a decode graph between
        t0 = time.perf_counter()
        m.eval(prompt, 0, logits_all=False)
        pp = time.perf_counter() - t0
        t0 = time.perf_counter()
        m.eval(prompt, 0, logits_all=False)
        pp2 = time.perf_counter() - t0
        t0 = time.perf_counter()
        for i in range(N_DECODE):
            m.eval([prompt[i % len(prompt)]], len(prompt) + i, logits_all=False)
        tg = time.perf_counter() - t0
        if r:
            best_pp, best_pp2, best_tg = min(best_pp, pp), min(best_pp2, pp2), min(best_tg, tg)
            best_new = min(best_new, pp_new)
    # how much of a decode step is recording its graph (Python work that llama.cpp does in C++)
    t0 = time.perf_counter()
    for i in range(10):
        llama.build_graph(m, 1, 256, 1)
    build = (time.perf_counter() - t0) / 10
    m.free()
    return {"pp_s": best_pp, "pp_again_s": best_pp2, "tg_s": best_tg, "pp_unkept_s": best_new,
            "build_graph_ms": 1e3 * build}


def cpu_flags():
    """The x86 features that decide which kernels each side runs."""
    try:
        flags = next(line for line in open("/proc/cpuinfo") if line.startswith("flags")).split()
    except (OSError, StopIteration):
        return []
    return [f for f in ("avx2", "avx512f", "avx512_vnni", "avx512vbmi", "amx_int8") if f in flags]


def peer_info(python):
    """llama-cpp-python's version and how its ggml was built (llama_print_system_info)."""
    out = subprocess.run([python, "-c", "import llama_cpp; print(llama_cpp.__version__); "
                          "print(llama_cpp.llama_print_system_info().decode().strip())"],
                         capture_output=True, text=True, check=True)
    version, info = out.stdout.strip().split("\n", 1)
    return {"llama_cpp_python": version, "system_info": info}


def measure_peer(python, path, threads, repeat, prompt):
    out = subprocess.run([python, "-c", PEER, str(path), str(threads), str(repeat), json.dumps(prompt), str(N_DECODE)],
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def rates(r, n_prompt):
    return {"pp_tok_s": n_prompt / r["pp_s"], "pp_again_tok_s": n_prompt / r["pp_again_s"],
            "tg_tok_s": N_DECODE / r["tg_s"]}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", default=os.environ.get("LLAMA_CPP_PYTHON"))
    ap.add_argument("--models-dir", default=os.path.join(tempfile.gettempdir(), "ggml_lite_llama_bench"))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench/results/llama.json"))
    args = ap.parse_args()
    os.makedirs(args.models_dir, exist_ok=True)
    paths, vocab = write_models(args.models_dir)
    prompt = vocab.tokenize(PROMPT_TEXT)[:N_PROMPT]
    prompt += [prompt[-1]] * (N_PROMPT - len(prompt))
    results = {"model": dict(HPARAMS, n_params=n_params(), tied=True), "n_prompt": N_PROMPT, "n_decode": N_DECODE,
               "machine": {"cpu": platform.processor() or platform.machine(), "n_cpus": os.cpu_count(),
                           "flags": cpu_flags(), "loadavg_before": os.getloadavg()}, "runs": []}
    if args.llama_python:
        results["llama.cpp"] = peer_info(args.llama_python)
    for t, path in paths.items():
        for threads in args.threads:
            raw = measure_lite(path, threads, args.repeat, prompt)
            lite = rates(raw, N_PROMPT)
            lite["decode_ms_per_token"] = 1e3 * raw["tg_s"] / N_DECODE
            lite["build_graph_ms"] = raw["build_graph_ms"]
            lite["pp_unkept_tok_s"] = N_PROMPT / raw["pp_unkept_s"]
            row = {"type": t, "threads": threads, "ggml_lite": lite}
            if args.llama_python:
                peer = rates(measure_peer(args.llama_python, path, threads, args.repeat, prompt), N_PROMPT)
                row["llama.cpp"] = peer
                row["ratio"] = {k: lite[k] / peer[k] for k in peer}
                # llama.cpp keeps no program: its prompt is the same either way
                row["ratio"]["pp_unkept_tok_s"] = lite["pp_unkept_tok_s"] / peer["pp_tok_s"]
            results["runs"].append(row)
            print(json.dumps(row))
    results["machine"]["loadavg_after"] = os.getloadavg()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
