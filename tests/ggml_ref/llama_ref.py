"""Fixtures from real llama.cpp for tests/test_llama.py.

Two halves, one file:

1. With the project's venv (ggml_lite importable), it writes the small test models
   tests/data/llama_<type>.gguf with ggml_lite.llama.write_llama_gguf (seeded random weights,
   the first n_vocab tokens of llama.cpp's SPM vocabulary), copies that vocabulary file
   (ggml-vocab-llama-spm.gguf and its .inp/.out tokenizer test) to tests/data/llama_vocab_spm.*,
   then runs its second half under the Python that has llama-cpp-python:

       PYTHONPATH=. .venv/bin/python tests/ggml_ref/llama_ref.py \
           --llama-python /path/to/venv/bin/python --vocab /path/to/llama.cpp/models/ggml-vocab-llama-spm.gguf

2. Under llama-cpp-python (`--peer DIR`): for each model, the logits of a prompt (every position),
   then 32 greedy steps one token at a time through the KV cache (each step's logits and token);
   and the tokenization (with and without BOS) and detokenization of test strings with the SPM
   vocabulary. Writes tests/data/llama_ref.npz and tests/data/llama_ref.json.

llama.cpp runs on the CPU with flash attention off (soft_max path), an F16 KV cache (its default)
and one thread. On a CPU with AMX (Intel Sapphire Rapids and later) build llama-cpp-python with
-DGGML_NATIVE=OFF and AVX2 flags (see AMX_BUILD_HINT): a native build crashes there, and the
script refuses to run with it.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

PROMPT = "The quick brown fox jumps over the lazy dog"
N_STEPS = 32
N_CTX = 128

# name -> (hparams kind, weight type, output type or None, tied)
MODELS = {
    "f32": ("small", "F32", None, False),
    "f16": ("small", "F16", None, True),
    "bf16": ("small", "BF16", None, False),
    "q8_0": ("small", "Q8_0", None, False),
    "q4_0": ("small", "Q4_0", None, False),
    "q4_1": ("small", "Q4_1", None, False),
    "q4_k": ("k", "Q4_K", None, True),
    "q6_k": ("k", "Q6_K", None, True),
}
HPARAMS = {
    "small": dict(n_vocab=1024, n_ctx_train=256, n_embd=64, n_layer=2, n_ff=128, n_head=4, n_head_kv=2,
                  n_rot=16, f_norm_rms_eps=1e-5, rope_freq_base=10000.0),
    "k": dict(n_vocab=512, n_ctx_train=256, n_embd=256, n_layer=2, n_ff=512, n_head=4, n_head_kv=2,
              n_rot=64, f_norm_rms_eps=1e-5, rope_freq_base=500000.0),
}
EXTRA_STRINGS = [
    "", " ", "  ", "\t", "\n", "\n\n", " \n ", "a", "A", "Hello, world!", "hello world", " hello world",
    "1234567890", "3.14159 + 2.71828 = 5.85987", "1,000,000", "e.g. i.e. etc.", "(parentheses) [brackets] {braces}",
    "!@#$%^&*()_+-=~`|\\:;\"'<>,.?/", "Ünïcödé tëxt", "Привет, мир", "こんにちは世界", "中文测试",
    "😀 🎉 👍🏽", "\u00a0non-breaking\u00a0space", "tab\tseparated\tvalues", "控制\x01\x02bytes",
    "<s> not special </s>", "<unk>", "▁already▁escaped", "a" * 50, "The quick brown fox jumps over the lazy dog",
    "don't won't can't I'm you're", "   leading and trailing   ", "<s>Hello</s>", "a</s><s>b", "x<unk>y<s>",
]


def write_models(data, vocab_path):
    import numpy as np  # noqa: F401
    from ggml_lite.llama import LlamaHParams, load_vocab, write_llama_gguf
    from ggml_lite.types import Type
    vocab = load_vocab(vocab_path)
    for name, (kind, wtype, out_type, tied) in MODELS.items():
        hp = LlamaHParams(**HPARAMS[kind])
        path = data / f"llama_{name}.gguf"
        write_llama_gguf(path, hp, vocab, Type[wtype], seed=16, tied=tied,
                         out_type=Type[out_type] if out_type else None)
        print(f"{path}: {path.stat().st_size} bytes")
    for suffix in ("", ".inp", ".out"):
        shutil.copyfile(str(vocab_path) + suffix, data / f"llama_vocab_spm.gguf{suffix}")


AMX_BUILD_HINT = (
    "llama-cpp-python built with native flags on a CPU with AMX (Intel Sapphire Rapids and later) "
    "segfaults in llama_decode on Q8_0 and Q4_0 files (its AMX and repack extra buffer types). "
    "Rebuild it without them: CMAKE_ARGS=\"-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON "
    "-DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_BLAS=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF "
    "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_CURL=OFF\" "
    "pip install --no-cache-dir --force-reinstall llama-cpp-python==0.3.36")


def refuse_amx_build(llama_cpp):
    """Stop before llama.cpp crashes: an AMX build on a machine whose CPU has AMX."""
    info = llama_cpp.llama_print_system_info().decode()
    if "AMX_INT8 = 1" in info:
        sys.exit(f"llama_ref.py: {AMX_BUILD_HINT}\n(system info: {info.strip()})")


def peer(data):
    import ctypes

    import llama_cpp
    import numpy as np
    refuse_amx_build(llama_cpp)
    arrays, meta = {}, {"prompt": PROMPT, "n_ctx": N_CTX, "llama_cpp_python": llama_cpp.__version__, "models": {}}
    for name in MODELS:
        llm = llama_cpp.Llama(model_path=str(data / f"llama_{name}.gguf"), n_ctx=N_CTX, n_batch=N_CTX,
                              logits_all=True, flash_attn=False, n_threads=1, verbose=False, seed=0)
        tokens = llm.tokenize(PROMPT.encode(), add_bos=True, special=False)
        llm.eval(tokens)
        arrays[f"{name}_prompt"] = np.array(llm.scores[:len(tokens)], np.float32)
        steps, chosen = [], []
        for _ in range(N_STEPS):
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))     # llama.cpp's greedy: the first maximum
            chosen.append(tok)
            llm.eval([tok])
            steps.append(np.array(llm.scores[llm.n_tokens - 1], np.float32))
        arrays[f"{name}_steps"] = np.stack(steps)
        meta["models"][name] = {"prompt_tokens": tokens, "greedy": chosen}
        del llm
    vocab_llm = llama_cpp.Llama(model_path=str(data / "llama_vocab_spm.gguf"), vocab_only=True, verbose=False)
    vocab = llama_cpp.llama_model_get_vocab(vocab_llm.model)
    inp = (data / "llama_vocab_spm.gguf.inp").read_text(encoding="utf-8").split("\n__ggml_vocab_test__\n")
    strings = inp + EXTRA_STRINGS

    def tokenize(text, add_special, parse_special=False):
        raw = text.encode()
        buf = (llama_cpp.llama_token * (len(raw) + 8))()
        n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, len(buf), add_special, parse_special)
        return [int(buf[i]) for i in range(n)]

    def detokenize(ids):
        arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
        out = ctypes.create_string_buffer(8 * len(ids) + 64)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), out, len(out), False, False)
        return out.raw[:n].decode("utf-8", errors="replace")

    meta["tokenizer"] = [{"text": s, "ids": tokenize(s, False), "ids_bos": tokenize(s, True),
                          "ids_special": tokenize(s, True, True), "detok": detokenize(tokenize(s, True))}
                         for s in strings]
    np.savez_compressed(data / "llama_ref.npz", **arrays)
    (data / "llama_ref.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {data / 'llama_ref.npz'} and {data / 'llama_ref.json'}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", metavar="DIR", help="(second half) run llama.cpp on the files in DIR")
    ap.add_argument("--llama-python", default=os.environ.get("LLAMA_CPP_PYTHON"),
                    help="a Python with llama-cpp-python 0.3.36 (or $LLAMA_CPP_PYTHON)")
    ap.add_argument("--vocab", help="llama.cpp's models/ggml-vocab-llama-spm.gguf (from the llama-cpp-python sdist)")
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[1] / "data"))
    args = ap.parse_args()
    if args.peer:
        return peer(Path(args.peer))
    if not args.llama_python or not args.vocab:
        ap.error("--llama-python and --vocab are needed")
    data = Path(args.data)
    write_models(data, args.vocab)
    subprocess.run([args.llama_python, __file__, "--peer", str(data)], check=True)


if __name__ == "__main__":
    sys.exit(main())
