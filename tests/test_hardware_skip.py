"""conftest.py: a chapter that needs hardware this machine lacks is skipped, with the reason shown;
the CUDA chapter's "cuda" is met by a GPU or by the emulated CUDA device (a C++ compiler)."""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _notebook(requires):
    meta = {"ggml_lite": {"requires": requires}} if requires else {}
    return {"nbformat": 4, "nbformat_minor": 5, "metadata": meta, "cells": [
        {"cell_type": "code", "id": "c1", "metadata": {}, "execution_count": 1, "source": "print(1 + 1)",
         "outputs": [{"output_type": "stream", "name": "stdout", "text": "2\n"}]}]}


def _has_cuda():
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:
        return False


def _run_nbval(requires, **env):
    """nbval on a one-cell chapter placed inside the repository (under the ignored _build/), so
    that the repository's conftest.py applies to it as it does to book/."""
    (ROOT / "_build").mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory(dir=ROOT / "_build") as d:
        nb = Path(d) / "chapter.ipynb"
        nb.write_text(json.dumps(_notebook(requires)))
        return subprocess.run([sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--nbval",
                               "--nbval-current-env", str(nb)], cwd=ROOT, capture_output=True, text=True, timeout=300,
                              env={**os.environ, **env})


@pytest.mark.skipif(_has_cuda(), reason="this machine has a CUDA device")
def test_cuda_chapter_runs_on_the_emulated_device_without_a_gpu():
    r = _run_nbval("cuda")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout, r.stdout


@pytest.mark.skipif(_has_cuda(), reason="this machine has a CUDA device")
def test_cuda_chapter_is_skipped_with_reason_without_a_gpu_or_a_compiler():
    r = _run_nbval("cuda", CXX="no-such-c++-compiler")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 skipped" in r.stdout and "needs cuda" in r.stdout and "no C++ compiler" in r.stdout, r.stdout


def test_plain_chapter_runs():
    r = _run_nbval(None)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 passed" in r.stdout, r.stdout
