"""Prompt and decode speed on a trained model: Gemma 3 270M (Q4_K_M GGUF) in ggml_lite and in
llama.cpp, the same file, the same way as bench/llama_bench.py measures its random llama files:

* prompt: one eval of a 64-token prompt (one graph, batch 64), tokens per second ("pp"; with the CPU
  stream's kept programs dropped first: "pp_unkept"; the same graph again: "pp_again");
* decode: 32 single-token steps through the KV cache, tokens per second ("tg");

each after a warm-up round, best of --repeat rounds, at 1 and 2 threads. A decode step of this
model reads the tied 262,144 x 640 Q8_0 head (178 MB) and about 63 MB of layer weights.
Results go to bench/results/gemma.json with the ratio ggml_lite / llama.cpp.

    PYTHONPATH=. .venv/bin/python bench/gemma_bench.py --llama-python /path/to/llama-venv/bin/python

The file comes from ggml_lite.llama.fetch (`make gemma`); the Gemma terms of use apply to it.
"""
import argparse
import json
import os
import platform
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llama_bench import N_DECODE, cpu_flags, measure_lite, measure_peer, peer_info, rates  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
N_PROMPT = 64
PROMPT_TEXT = ("The quick brown fox jumps over the lazy dog while the llama reads a book about tensors, "
               "graphs, backends and the allocator that plans memory once and reuses it for every token.")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-python", default=os.environ.get("LLAMA_CPP_PYTHON"))
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=str(ROOT / "bench/results/gemma.json"))
    args = ap.parse_args()
    from ggml_lite.llama import load
    from ggml_lite.llama.fetch import gemma3_270m
    path = gemma3_270m()
    m = load(path, n_ctx=256, progress=False)
    prompt = m.tokenize(PROMPT_TEXT)
    prompt = (prompt * (N_PROMPT // len(prompt) + 1))[:N_PROMPT]
    m.free()
    results = {"model": path.name, "n_prompt": N_PROMPT, "n_decode": N_DECODE,
               "machine": {"cpu": platform.processor() or platform.machine(), "n_cpus": os.cpu_count(),
                           "flags": cpu_flags(), "loadavg_before": os.getloadavg()}, "runs": []}
    if args.llama_python:
        results["llama.cpp"] = peer_info(args.llama_python)
    for threads in args.threads:
        raw = measure_lite(path, threads, args.repeat, prompt)
        lite = rates(raw, N_PROMPT)
        lite["decode_ms_per_token"] = 1e3 * raw["tg_s"] / N_DECODE
        lite["pp_unkept_tok_s"] = N_PROMPT / raw["pp_unkept_s"]
        row = {"threads": threads, "ggml_lite": lite}
        if args.llama_python:
            peer = rates(measure_peer(args.llama_python, path, threads, args.repeat, prompt), N_PROMPT)
            peer["decode_ms_per_token"] = 1e3 / peer["tg_tok_s"]
            row["llama.cpp"] = peer
            row["ratio"] = {k: lite[k] / peer[k] for k in ("pp_tok_s", "pp_again_tok_s", "tg_tok_s")}
            row["ratio"]["pp_unkept_tok_s"] = lite["pp_unkept_tok_s"] / peer["pp_tok_s"]
        results["runs"].append(row)
        print(json.dumps(row))
    results["machine"]["loadavg_after"] = os.getloadavg()
    Path(args.out).write_text(json.dumps(results, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
