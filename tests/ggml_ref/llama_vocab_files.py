"""llama.cpp's tokenizer test files: its vocabulary-only GGUF files with their tests, from the pinned
llama-cpp-python sdist on PyPI (its vendor/llama.cpp/models/ggml-vocab-*.gguf, .gguf.inp, .gguf.out).

Too big to commit (about 45 MB of BPE vocabularies), so they are fetched on first use: the sdist is
downloaded once, its sha256 checked, and only those files extracted into
$XDG_CACHE_HOME/ggml_lite/llama-cpp-python-0.3.36/ (~/.cache/... without XDG_CACHE_HOME); later runs
read the cache. LLAMA_CPP_PYTHON_SDIST=/path/to/llama_cpp_python-0.3.36.tar.gz uses a local copy of
the sdist instead of PyPI (its sha256 is checked the same way).

    python tests/ggml_ref/llama_vocab_files.py      # fetch now, list what is there
"""
import hashlib
import os
import shutil
import tarfile
import tempfile
import urllib.request
from pathlib import Path

VERSION = "0.3.36"
URL = ("https://files.pythonhosted.org/packages/ec/e9/e7de2b0463ea3ffbf0ede6cb21b58c1258a8f6521aae45ca773a59fe7cf3/"
       f"llama_cpp_python-{VERSION}.tar.gz")
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
MEMBERS = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/models/"
SEP = b"\n__ggml_vocab_test__\n"


def cache_dir():
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "ggml_lite" / f"llama-cpp-python-{VERSION}"


def _download(dest):
    local = os.environ.get("LLAMA_CPP_PYTHON_SDIST")
    if local:
        shutil.copyfile(local, dest)
        return
    with urllib.request.urlopen(URL, timeout=60) as r, open(dest, "wb") as f:
        shutil.copyfileobj(r, f, 1 << 20)


def vocab_dir():
    """The directory of ggml-vocab-*.gguf{,.inp,.out}, fetched and extracted if not cached yet.
    Raises OSError (no network, no space) or ValueError (a download that is not the pinned sdist)."""
    out = cache_dir()
    if (out / "complete").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out) as tmp:
        sdist = Path(tmp) / "sdist.tar.gz"
        _download(sdist)
        digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
        if digest != SHA256:
            raise ValueError(f"{URL}: sha256 {digest}, expected {SHA256}")
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                name = m.name[len(MEMBERS):]
                if m.isfile() and m.name.startswith(MEMBERS) and name.startswith("ggml-vocab-") and "/" not in name:
                    with tar.extractfile(m) as src, open(Path(tmp) / name, "wb") as dst:
                        shutil.copyfileobj(src, dst)
                    os.replace(Path(tmp) / name, out / name)
    (out / "complete").write_text(f"{URL}\n{SHA256}\n")
    return out


def tested_vocabs(directory):
    """The names (ggml-vocab-NAME.gguf) of the vocabularies that come with a test."""
    return sorted(p.name[len("ggml-vocab-"):-len(".gguf.inp")] for p in Path(directory).glob("ggml-vocab-*.gguf.inp"))


def read_test(directory, name):
    """llama.cpp's test-tokenizer-0 reading of NAME's .inp/.out: [(text, [ids])]."""
    raw = (Path(directory) / f"ggml-vocab-{name}.gguf.inp").read_bytes()
    texts = raw.split(SEP)
    if raw.endswith(SEP):
        texts = texts[:-1]
    lines = (Path(directory) / f"ggml-vocab-{name}.gguf.out").read_bytes().decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines = lines[:-1]
    if len(texts) != len(lines):
        raise ValueError(f"{name}: {len(texts)} inputs, {len(lines)} lines of ids")
    return [(t.decode("utf-8"), [int(x) for x in ids.split()]) for t, ids in zip(texts, lines)]


if __name__ == "__main__":
    d = vocab_dir()
    for name in tested_vocabs(d):
        print(f"{name:16} {len(read_test(d, name)):3d} tests  {(d / f'ggml-vocab-{name}.gguf').stat().st_size:>10} bytes")
