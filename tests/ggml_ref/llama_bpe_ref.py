"""A llama model with a BPE vocabulary, against real llama.cpp, for tests/test_llama.py.

Two halves, one file (as llama_ref.py):

1. With the project's venv (ggml_lite importable), it writes tests/data/llama_bpe_q8_0.gguf with
   ggml_lite.llama.write_llama_gguf: Q8_0 weights seeded at random, GQA (4 query heads, 2 KV heads),
   Llama 3's rope base 500000 and a rope_freqs.weight (Llama 3's rope scaling, factor 8, low and high
   frequency factors 1 and 4, at a toy original context of 64 positions so that the prompt's
   positions feel it), and llama.cpp's Llama 3 vocabulary (models/ggml-vocab-llama-bpe.gguf) cut to
   1024 tokens: its first 1022 (the 256 byte characters come first), then <|begin_of_text|> and
   <|end_of_text|> renumbered 1022 and 1023, and the merge rules whose parts and result are all kept
   (1087 of 280147). Then it runs its second half under the Python that has llama-cpp-python:

       PYTHONPATH=. .venv/bin/python tests/ggml_ref/llama_bpe_ref.py \\
           --llama-python /path/to/venv/bin/python [--vocab .../ggml-vocab-llama-bpe.gguf]

   Without --vocab the vocabulary comes from the cache of tests/ggml_ref/llama_vocab_files.py.

2. Under llama-cpp-python (`--peer DIR`): the prompt's tokens and logits at every position, then 32
   greedy steps one token at a time through the KV cache; and the tokenization (plain, with BOS, with
   special tokens parsed) and detokenization of llama-bpe's test strings and llama_ref.py's extra
   strings with the cut vocabulary. Writes tests/data/llama_bpe_ref.npz and llama_bpe_ref.json.

llama.cpp runs as in llama_ref.py: CPU, flash attention off, F16 KV cache, one thread; an AMX build
is refused. The weights are Q8_0, whose products ggml_lite gives bit for bit (llama.cpp on an
AVX-512 CPU repacks Q4_0 and Q4_K weights into interleaved blocks with kernels of their own).
"""
import argparse
import json
import math
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from llama_ref import EXTRA_STRINGS, N_STEPS, refuse_amx_build  # noqa: E402

NAME = "bpe_q8_0"
PROMPT = "The quick brown fox jumps over the lazy dog.\nIt's 1234567 km, naïve café!"
N_CTX = 128
HPARAMS = dict(n_vocab=1024, n_ctx_train=256, n_embd=64, n_layer=2, n_ff=128, n_head=4, n_head_kv=2,
               n_rot=16, f_norm_rms_eps=1e-5, rope_freq_base=500000.0)
ROPE_SCALING = dict(factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_context=64)
SPECIAL_STRINGS = ["<|begin_of_text|>Hello<|end_of_text|>", "a<|end_of_text|>b", "<|begin_of_text|>",
                   "<|start_header_id|>user<|end_header_id|>", "x <|end_of_text|> y"]


def llama3_rope_freqs(n_rot, base, factor, low_freq_factor, high_freq_factor, original_context):
    """convert_hf_to_gguf.py's LlamaModel rope_freqs: the divisor of each rotation frequency."""
    out = []
    for i in range(0, n_rot, 2):
        wavelen = 2 * math.pi * base ** (i / n_rot)
        if wavelen < original_context / high_freq_factor:
            out.append(1.0)
        elif wavelen > original_context / low_freq_factor:
            out.append(factor)
        else:
            smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return out


def write_model(data, vocab_path):
    from ggml_lite.llama import LlamaHParams, load_vocab, write_llama_gguf
    from ggml_lite.types import Type
    hp = LlamaHParams(**HPARAMS)
    path = data / f"llama_{NAME}.gguf"
    freqs = llama3_rope_freqs(hp.n_rot, hp.rope_freq_base, **ROPE_SCALING)
    write_llama_gguf(path, hp, load_vocab(vocab_path), Type.Q8_0, seed=26, rope_freqs=freqs)
    print(f"{path}: {path.stat().st_size} bytes; rope_freqs {[round(f, 3) for f in freqs]}")


def test_strings(vocab_path):
    sep = "\n__ggml_vocab_test__\n"
    inp = Path(str(vocab_path) + ".inp").read_text(encoding="utf-8")
    inp = inp[:-len(sep)] if inp.endswith(sep) else inp
    return inp.split(sep) + EXTRA_STRINGS + SPECIAL_STRINGS + [PROMPT]


def peer(data, strings):
    import ctypes

    import llama_cpp
    import numpy as np
    refuse_amx_build(llama_cpp)
    llm = llama_cpp.Llama(model_path=str(data / f"llama_{NAME}.gguf"), n_ctx=N_CTX, n_batch=N_CTX,
                          logits_all=True, flash_attn=False, n_threads=1, verbose=False, seed=0)
    tokens = llm.tokenize(PROMPT.encode(), add_bos=True, special=False)
    llm.eval(tokens)
    arrays = {"prompt": np.array(llm.scores[:len(tokens)], np.float32)}
    steps, chosen = [], []
    for _ in range(N_STEPS):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))     # llama.cpp's greedy: the first maximum
        chosen.append(tok)
        llm.eval([tok])
        steps.append(np.array(llm.scores[llm.n_tokens - 1], np.float32))
    arrays["steps"] = np.stack(steps)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)

    def tokenize(text, add_special, parse_special=False):
        raw = text.encode()
        buf = (llama_cpp.llama_token * (len(raw) + 8))()
        n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, len(buf), add_special, parse_special)
        return [int(buf[i]) for i in range(n)]

    def detokenize(ids, unparse_special=False):
        arr = (llama_cpp.llama_token * max(len(ids), 1))(*ids)
        out = ctypes.create_string_buffer(8 * len(ids) + 64)
        n = llama_cpp.llama_detokenize(vocab, arr, len(ids), out, len(out), False, unparse_special)
        return out.raw[:n].decode("utf-8", errors="replace")

    meta = {"prompt": PROMPT, "n_ctx": N_CTX, "llama_cpp_python": llama_cpp.__version__,
            "system_info": llama_cpp.llama_print_system_info().decode().strip(),
            "n_vocab": llama_cpp.llama_vocab_n_tokens(vocab), "bos": llama_cpp.llama_vocab_bos(vocab),
            "eos": llama_cpp.llama_vocab_eos(vocab), "prompt_tokens": tokens, "greedy": chosen,
            "greedy_text": detokenize(chosen),
            "tokenizer": [{"text": s, "ids": tokenize(s, False), "ids_bos": tokenize(s, True),
                           "ids_special": tokenize(s, True, True),
                           "detok": detokenize(tokenize(s, True, True)),
                           "detok_special": detokenize(tokenize(s, True, True), True)} for s in strings]}
    np.savez_compressed(data / "llama_bpe_ref.npz", **arrays)
    (data / "llama_bpe_ref.json").write_text(json.dumps(meta, ensure_ascii=False, indent=0) + "\n", encoding="utf-8")
    print(f"wrote {data / 'llama_bpe_ref.npz'} and {data / 'llama_bpe_ref.json'}: {len(tokens)} prompt tokens, "
          f"greedy {chosen}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", metavar="DIR", help="(second half) run llama.cpp on the file in DIR")
    ap.add_argument("--strings", help="(second half) a JSON list of the strings to tokenize")
    ap.add_argument("--llama-python", default=os.environ.get("LLAMA_CPP_PYTHON"),
                    help="a Python with llama-cpp-python 0.3.36 (or $LLAMA_CPP_PYTHON)")
    ap.add_argument("--vocab", help="llama.cpp's models/ggml-vocab-llama-bpe.gguf (default: the cached sdist's)")
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[1] / "data"))
    args = ap.parse_args()
    if args.peer:
        return peer(Path(args.peer), json.loads(Path(args.strings).read_text(encoding="utf-8")))
    if not args.llama_python:
        ap.error("--llama-python is needed")
    if args.vocab is None:
        import llama_vocab_files
        args.vocab = llama_vocab_files.vocab_dir() / "ggml-vocab-llama-bpe.gguf"
    data = Path(args.data)
    write_model(data, args.vocab)
    strings = data / "llama_bpe_strings.tmp.json"
    strings.write_text(json.dumps(test_strings(args.vocab), ensure_ascii=False), encoding="utf-8")
    try:
        subprocess.run([args.llama_python, __file__, "--peer", str(data), "--strings", str(strings)], check=True)
    finally:
        strings.unlink()


if __name__ == "__main__":
    sys.exit(main())
