"""pytest hooks for the chapters run under nbval.

A chapter that needs hardware declares it in its notebook metadata, e.g.
`"ggml_lite": {"requires": "cuda"}`. On a machine without that hardware its cells are collected
and skipped with the reason printed (`-rs`), never passed silently. "cuda" is met by a GPU or,
without one, by the emulated CUDA device (a C++ compiler is all it needs): the CUDA chapter
switches it on itself where cupy sees no GPU.
"""
import json
from pathlib import Path

import pytest


def _has_cuda() -> tuple[bool, str]:
    try:
        import cupy
    except ImportError as e:
        return False, f"cupy is not installed ({e}); install the 'cuda' extra"
    try:
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # cupy raises CUDARuntimeError without a driver or device
        return False, f"no CUDA device ({type(e).__name__}: {e})"
    return (n > 0), ("no CUDA device (device count 0)" if n == 0 else "")


def _has_cuda_or_emulator() -> tuple[bool, str]:
    ok, why = _has_cuda()
    if ok:
        return ok, why
    from ggml_lite.backends.cuda.emu import emu_compiler
    if emu_compiler() is not None:
        return True, ""
    return False, f"{why}, and no C++ compiler (g++ or $CXX) for the emulated CUDA device"


HARDWARE = {"cuda": _has_cuda_or_emulator}


def pytest_collection_modifyitems(config, items):
    checked = {}
    for item in items:
        path = Path(str(item.fspath))
        if path.suffix != ".ipynb":
            continue
        if path not in checked:
            meta = json.loads(path.read_text()).get("metadata", {}).get("ggml_lite", {})
            need = meta.get("requires")
            checked[path] = None
            if need:
                ok, why = HARDWARE[need]()
                if not ok:
                    checked[path] = f"{path.name} needs {need}: {why}"
        if checked[path]:
            item.add_marker(pytest.mark.skip(reason=checked[path]))
