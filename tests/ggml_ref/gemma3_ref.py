"""A small random-weight gemma3 model against real llama.cpp, for tests/test_gemma3.py.

Two halves, one file (as llama_ref.py):

1. With the project's venv (ggml_lite importable), it writes gemma3_f32.gguf and gemma3_q8_0.gguf
   into a temporary directory with ggml_lite.llama.writer.write_gemma3_test_model (chapter 93; the
   files are not stored: the writer remakes them, byte for byte, wherever they are needed): six
   layers (layers 0-4 slide, layer 5 is global: llama.cpp's pattern of 6), a sliding window of
   N_SWA = 5 cells (the prompt alone is longer), grouped-query attention (2 query heads, 1 KV head),
   heads key_length = 32 wide while n_embd = 32 (attn_q is [32, 64], attn_output [64, 32]), a global
   RoPE base of 1e6 (the sliding layers take llama.cpp's 10000), a tied head (no output.weight),
   and a SentencePiece vocabulary without the space prefix: the first 382 tokens of llama.cpp's
   SPM test vocabulary (tests/data/llama_vocab_spm.gguf: <unk> <s> </s>, the 256 byte tokens, the
   first merges) and two control tokens, <start_of_turn> (382) and <end_of_turn> (383), with
   seeded random weights. Then it runs its second half under the Python that has llama-cpp-python:

       PYTHONPATH=. .venv/bin/python tests/ggml_ref/gemma3_ref.py --llama-python /path/to/venv/bin/python

2. Under llama-cpp-python (`--peer DIR`): for each file the prompt's tokens and logits at every
   position, then N_STEPS greedy steps one token at a time through the KV cache (prompt and steps
   run far past the window); the tokenization (plain, with BOS, with special tokens parsed) and
   detokenization of test strings; which token ids llama.cpp counts as end of generation; and the
   size and sha256 of each file it ran on (the tests check that the writer still makes those
   bytes). Writes tests/data/gemma3_ref.npz and tests/data/gemma3_ref.json.

llama.cpp runs as in llama_ref.py: CPU, flash attention off, F16 KV cache, one thread, its default
full-size SWA cache (swa_full), so that a token's cell is its position; an AMX build is refused.
"""
import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from llama_ref import refuse_amx_build  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog"
N_STEPS = 24
N_CTX = 64
N_SWA = 5            # the writer's GEMMA3_TEST_HPARAMS["n_swa"], checked in write_models
MODELS = {"f32": "F32", "q8_0": "Q8_0"}
STRINGS = ["", " ", "a", "Hello world", " Hello world", "  two spaces", "line\nbreak", "The the there",
           "Ünïcödé", "😀", "<start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n",
           "x<end_of_turn>y", "<s>not special</s>", PROMPT]


def write_models(out, data):
    from ggml_lite.llama.writer import GEMMA3_TEST_HPARAMS, write_gemma3_test_model
    from ggml_lite.types import Type
    assert GEMMA3_TEST_HPARAMS["n_swa"] == N_SWA
    for name, wtype in MODELS.items():
        path = write_gemma3_test_model(out / f"gemma3_{name}.gguf", data / "llama_vocab_spm.gguf", Type[wtype])
        print(f"{path}: {path.stat().st_size} bytes")


def peer(models, data):
    import ctypes

    import llama_cpp
    import numpy as np
    refuse_amx_build(llama_cpp)
    arrays, meta = {}, {"prompt": PROMPT, "n_ctx": N_CTX, "n_swa": N_SWA,
                        "llama_cpp_python": llama_cpp.__version__,
                        "system_info": llama_cpp.llama_print_system_info().decode().strip(), "models": {}}
    for name in MODELS:
        path = models / f"gemma3_{name}.gguf"
        meta.setdefault("files", {})[name] = {"bytes": path.stat().st_size,
                                              "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
        llm = llama_cpp.Llama(model_path=str(path), n_ctx=N_CTX, n_batch=N_CTX,
                              logits_all=True, flash_attn=False, n_threads=1, verbose=False, seed=0)
        tokens = llm.tokenize(PROMPT.encode(), add_bos=True, special=False)
        assert N_SWA < len(tokens) and len(tokens) + N_STEPS <= N_CTX
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
        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        if name == "f32":
            n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
            meta["eog"] = [i for i in range(n_vocab) if llama_cpp.llama_vocab_is_eog(vocab, i)]
            meta["n_vocab"] = n_vocab

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

            meta["tokenizer"] = [{"text": s, "ids": tokenize(s, False), "ids_bos": tokenize(s, True),
                                  "ids_special": tokenize(s, True, True),
                                  "detok": detokenize(tokenize(s, True, True)),
                                  "detok_special": detokenize(tokenize(s, True, True), True)} for s in STRINGS]
        del llm
    np.savez_compressed(data / "gemma3_ref.npz", **arrays)
    (data / "gemma3_ref.json").write_text(json.dumps(meta, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {data / 'gemma3_ref.npz'} and {data / 'gemma3_ref.json'}: "
          + "; ".join(f"{k}: greedy {v['greedy']}" for k, v in meta["models"].items()))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--peer", metavar="DIR", help="(second half) run llama.cpp on the files in DIR")
    ap.add_argument("--out", help="(second half) where the fixtures go")
    ap.add_argument("--llama-python", default=os.environ.get("LLAMA_CPP_PYTHON"),
                    help="a Python with llama-cpp-python 0.3.36 (or $LLAMA_CPP_PYTHON)")
    ap.add_argument("--data", default=str(Path(__file__).resolve().parents[1] / "data"))
    args = ap.parse_args()
    if args.peer:
        return peer(Path(args.peer), Path(args.out))
    if not args.llama_python:
        ap.error("--llama-python is needed")
    data, models = Path(args.data), Path(tempfile.mkdtemp())
    write_models(models, data)
    subprocess.run([args.llama_python, __file__, "--peer", str(models), "--out", str(data)], check=True)


if __name__ == "__main__":
    sys.exit(main())
