#!/usr/bin/env python3
"""Re-execute chapters in place so their stored outputs are exactly what their code prints.

    python tools/run_notebooks.py book/01_types.ipynb [more.ipynb ...]

One canonical way: nbclient, the current environment's python3 kernel, no timing metadata,
PYTHONHASHSEED=0, the working directory the notebook's own folder (as under nbval).
"""
import os
import sys
import tempfile
import time
from pathlib import Path

import nbformat
from nbclient import NotebookClient


def run(path: Path) -> None:
    nb = nbformat.read(path, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3", record_timing=False,
                            resources={"metadata": {"path": str(path.parent)}})
    client.execute()
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = merged_streams(cell.outputs)
    nb.metadata.pop("widgets", None)
    nbformat.write(nb, path)


def merged_streams(outputs: list) -> list:
    """Consecutive stdout (or stderr) outputs as one: how a cell's prints arrive in pieces depends
    on the machine's timing, and the stored notebook should not."""
    merged = []
    for out in outputs:
        if (out.get("output_type") == "stream" and merged and merged[-1].get("output_type") == "stream"
                and merged[-1]["name"] == out["name"]):
            merged[-1]["text"] += out["text"]
        else:
            merged.append(out)
    return merged


def missing_hardware(path: Path) -> str:
    """Why this machine cannot run the chapter ("" if it can): the notebook's
    `ggml_lite.requires`, checked as conftest.py checks it under nbval."""
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from conftest import HARDWARE
    need = nbformat.read(path, as_version=4).metadata.get("ggml_lite", {}).get("requires")
    if not need:
        return ""
    ok, why = HARDWARE[need]()
    return "" if ok else f"needs {need}: {why}"


def fresh_cell_cache() -> None:
    """numba caches a function defined in a notebook cell by that function's source alone (in
    IPython's cache directory), so a cell whose callees changed would load stale machine code:
    the kernels get a cache directory of their own, made fresh for this run. matplotlib keeps its
    font cache where it was."""
    old = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    os.environ.setdefault("MPLCONFIGDIR", os.path.join(old, "matplotlib"))
    os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="ggml_lite-cells-")


def main(paths: list[str]) -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":
        print("run_notebooks: PYTHONHASHSEED must be 0 (make outputs sets it)", file=sys.stderr)
        return 2
    fresh_cell_cache()
    for p in paths:
        why = missing_hardware(Path(p))
        if why:
            print(f"skipped {p}: {why} (its stored outputs are kept)")
            continue
        t = time.perf_counter()
        run(Path(p))
        print(f"executed {p} in {time.perf_counter() - t:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
