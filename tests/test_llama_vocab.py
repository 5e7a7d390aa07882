"""Vocabularies against llama.cpp: its own tokenizer test (test-tokenizer-0) on every SPM and BPE
vocabulary-only file llama.cpp ships, fetched once from the pinned llama-cpp-python sdist on PyPI
(tests/ggml_ref/llama_vocab_files.py); the BPE loader's refusals; a llama model file with a BPE
vocabulary through load, tokenize, generate and the command line."""
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

from ggml_lite import llama  # noqa: E402
from ggml_lite.core import GGMLError  # noqa: E402
from ggml_lite.llama import vocab_bpe  # noqa: E402
from ggml_lite.llama.vocab import BPEVocab  # noqa: E402

sys.path.insert(0, str(Path(__file__).parent / "ggml_ref"))
import llama_bpe_ref  # noqa: E402
import llama_vocab_files  # noqa: E402

DATA = Path(__file__).parent / "data"
SPM = ["llama-spm", "phi-3"]
BPE = ["llama-bpe", "qwen2", "qwen35", "gpt-2", "falcon", "mpt", "starcoder", "refact", "command-r",
       "deepseek-llm", "deepseek-coder", "gemma-4"]
NOT_HERE = {"bert-bge": "WordPiece (tokenizer.ggml.model = 'bert'), not a llama vocabulary"}


@pytest.fixture(scope="session")
def vocab_files():
    try:
        return llama_vocab_files.vocab_dir()
    except (OSError, ValueError) as e:       # no network, no space, not the pinned sdist
        pytest.skip(f"llama.cpp's vocabulary files could not be fetched from PyPI ({type(e).__name__}: {e}); "
                    f"see tests/ggml_ref/README.md")


_vocabs = {}


def vocab(files, name):
    if name not in _vocabs:
        _vocabs[name] = llama.load_vocab(files / f"ggml-vocab-{name}.gguf")
    return _vocabs[name]


def test_every_tested_vocabulary_is_covered(vocab_files):
    assert set(llama_vocab_files.tested_vocabs(vocab_files)) == set(SPM + BPE + list(NOT_HERE))


@pytest.mark.parametrize("name", SPM + BPE)
def test_llama_cpp_tokenizer_test(vocab_files, name):
    """Every string of ggml-vocab-NAME.gguf.inp gives the ids of its .out (add_special off, as the test)."""
    v = vocab(vocab_files, name)
    cases = llama_vocab_files.read_test(vocab_files, name)
    assert len(cases) >= 46
    wrong = [(text, v.tokenize(text, add_special=False), ids) for text, ids in cases
             if v.tokenize(text, add_special=False) != ids]
    assert not wrong, f"{len(wrong)} of {len(cases)} strings differ, the first: {wrong[0]}"


@pytest.mark.parametrize("name", BPE)
def test_bpe_detokenize(vocab_files, name):
    """Tokens back to the text: the bytes as they were, then clean_up_tokenization_spaces where the
    pre-tokenizer asks for it."""
    v = vocab(vocab_files, name)
    for text, _ in llama_vocab_files.read_test(vocab_files, name):
        back = v.detokenize(v.tokenize(text, add_special=False))
        assert back == (vocab_bpe.clean_spaces(text) if v.pre.clean_spaces else text), text


def test_bpe_special_tokens_and_bos(vocab_files):
    v = vocab(vocab_files, "llama-bpe")                     # Llama 3: BOS <|begin_of_text|> = 128000
    assert (v.bos, v.eos, v.add_bos) == (128000, 128001, True)
    assert v.tokenize("Hello") == [128000, 9906]
    text = "<|start_header_id|>user<|end_header_id|>"
    assert v.tokenize(text, add_special=False, parse_special=True) == [128006, 882, 128007]
    assert 128006 not in v.tokenize(text, add_special=False)      # control tokens only with parse_special
    assert v.detokenize([128000, 9906], unparse_special=True) == "<|begin_of_text|>Hello"
    assert v.detokenize([128000, 9906]) == "Hello"
    g = vocab(vocab_files, "gpt-2")                          # no add_bos_token key: no BOS
    assert g.tokenize("Hello") == g.tokenize("Hello", add_special=False) == [15496]


def test_bpe_model_fixture_is_the_writers(vocab_files, tmp_path):
    """tests/data/llama_bpe_q8_0.gguf (llama.cpp's logits of it: tests/test_llama.py) is exactly what
    write_llama_gguf makes of llama-bpe's vocabulary cut to 1024 tokens, with llama_bpe_ref.py's settings."""
    llama_bpe_ref.write_model(tmp_path, vocab_files / "ggml-vocab-llama-bpe.gguf")
    assert (tmp_path / "llama_bpe_q8_0.gguf").read_bytes() == (DATA / "llama_bpe_q8_0.gguf").read_bytes()
    cut = llama.load_vocab(tmp_path / "llama_bpe_q8_0.gguf")
    full = vocab(vocab_files, "llama-bpe")
    assert cut.tokens[:1022] == full.tokens[:1022] and cut.tokens[1022:] == [full.tokens[full.bos], full.tokens[full.eos]]
    assert cut.tokenize(" the", add_special=False) == full.tokenize(" the", add_special=False) == [279]
    ids = cut.tokenize("Hello world")                       # 'Hello' (9906) and ' world' (1917) were cut away
    assert ids[0] == 1022 and len(ids) > 3 and max(ids[1:]) < 1022 and cut.detokenize(ids) == "Hello world"


# --- no downloads needed below ------------------------------------------------------------------

def test_byte_map():
    assert len(set(vocab_bpe.BYTE_TO_CHAR)) == 256
    assert vocab_bpe.byte_encode(" \n\t!é") == "ĠĊĉ!Ã©"
    raw = bytes(range(256))
    assert vocab_bpe.byte_decode("".join(vocab_bpe.BYTE_TO_CHAR[b] for b in raw)) == raw
    assert vocab_bpe.utf8_text(b"a\xff\xe2\x82") == "a\ufffd\ufffd\ufffd"      # one U+FFFD per bad byte


def test_pre_split_collapses_categories():
    llama3 = vocab_bpe.bpe_pre("llama-bpe").regexes
    assert vocab_bpe.pre_split("I've 1234567 apples!\n", llama3) == ["I", "'ve", " ", "123", "456", "7", " apples", "!\n"]
    # U+3000 is white space (collapsed to \v), 'é' a letter, '½' a number, U+1E4D0 a letter of Unicode 15
    assert vocab_bpe.pre_split("a\u3000b é½\U0001e4d0", llama3) == ["a", "\u3000b", " é", "½", "\U0001e4d0"]
    assert vocab_bpe.category(0x1E4D0) == "L" and vocab_bpe.category(0x0378) == "C"
    assert vocab_bpe.clean_spaces("a , b ' c 's d 't e 're") == "a, b'c's d 't e're"


def test_unknown_pre_tokenizer_is_named():
    with pytest.raises(GGMLError, match="unknown pre-tokenizer type: 'no-such-pre'"):
        BPEVocab([b"a"], [], pre="no-such-pre")


def _bpe_tokens():
    """A small byte-level vocabulary: the 256 characters and merges of frequent English pairs."""
    alphabet = vocab_bpe.BYTE_TO_CHAR
    tokens, merges = list(alphabet), []
    for a in "Ġetaoinshrdlucmwfgypbvkjxqz" + "ETAOINSHRDLUCMWFGYPBVKJXQZ":
        for b in "etaoinshrdlucmwfgypbvkjxqz":
            if len(tokens) < 1022:
                merges.append(f"{a} {b}")
                tokens.append(a + b)
    return [t.encode() for t in tokens] + [b"<|begin_of_text|>", b"<|end_of_text|>"], merges


def bpe_model_file(dst, pre="llama-bpe", drop=()):
    """tests/data/llama_f32.gguf (n_vocab 1024) with a BPE vocabulary in place of its SPM one."""
    tokens, merges = _bpe_tokens()
    r = gguf.GGUFReader(str(DATA / "llama_f32.gguf"))
    w = gguf.GGUFWriter(str(dst), "llama")
    for key, f in r.fields.items():
        if key.startswith(("GGUF.", "tokenizer.")) or key == "general.architecture":
            continue
        w.add_key_value(key, f.contents(), f.types[0], f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([1] * 1022 + [3, 3])
    if "merges" not in drop:
        w.add_token_merges(merges)
    w.add_bos_token_id(1022)
    w.add_eos_token_id(1023)
    for t in r.tensors:
        w.add_tensor(t.name, np.array(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return dst


def test_bpe_model_file(tmp_path):
    path = bpe_model_file(tmp_path / "bpe.gguf")
    m = llama.load(path, n_ctx=64, progress=False, n_threads=1)
    assert isinstance(m.vocab, BPEVocab) and m.eos == 1023
    ids = m.tokenize("the rain in spain")
    assert ids[0] == 1022 and len(ids) < len("the rain in spain")           # BOS, then merged pairs
    assert m.detokenize(ids[1:]) == "the rain in spain"
    out = m.generate(ids, 8)
    assert 1 <= len(out) <= 8 and all(0 <= t < 1024 for t in out)
    run = subprocess.run([sys.executable, "-m", "ggml_lite.llama", str(path), "-p", "the rain in spain", "-n", "8",
                          "-t", "1", "-c", "64", "--no-progress"], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    assert run.stdout == "the rain in spain" + b"".join(m.vocab.token_to_piece(t) for t in out).decode("utf-8", "replace") + "\n"


def test_bpe_model_file_refusals(tmp_path):
    with pytest.raises(GGMLError, match="cannot find tokenizer merges"):
        llama.load_vocab(bpe_model_file(tmp_path / "nomerges.gguf", drop=("merges",)))
    with pytest.raises(GGMLError, match="unknown pre-tokenizer type: 'mystery'"):
        llama.load(bpe_model_file(tmp_path / "pre.gguf", pre="mystery"), n_ctx=32, progress=False)
