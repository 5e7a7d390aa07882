"""pytest hooks for the chapters run under nbval.

A chapter that needs hardware declares it in its notebook metadata, e.g.
`"ggml_lite": {"requires": "cuda"}`. On a machine without that hardware its cells are collected
and skipped with the reason printed (`-rs`), never passed silently.
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


HARDWARE = {"cuda": _has_cuda}


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
