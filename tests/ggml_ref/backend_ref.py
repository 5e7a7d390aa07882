#!/usr/bin/env python3
"""What real ggml's ggml_backend_alloc_ctx_tensors_from_buft does with the contexts of
backend_scenarios.py, on its CPU buffer type (or a copy of it with a smaller max_size).

Per scenario: ggml_backend_alloc_ctx_tensors_from_buft_size, whether a buffer came back, its size,
the sizes of the buffers holding the tensors (several: ggml made a multi-buffer), and per tensor
(creation order) the index of the buffer holding it (in order of first appearance) and its data
offset from that buffer's base. Also the CPU buffer type's name, alignment, max_size, is_host. tests/test_backend.py compares ggml_lite with
tests/data/backend_ref.json and never needs ggml-python. To re-run:

    python3 -m venv /tmp/ggmlpy && /tmp/ggmlpy/bin/pip install ggml-python==0.0.45 numpy
    GGML_NO_BACKTRACE=1 /tmp/ggmlpy/bin/python tests/ggml_ref/backend_ref.py

ggml-python 0.0.45 bundles ggml 0.15.3.
"""
import ctypes
import json
import sys
from pathlib import Path

import ggml.ggml as g

sys.path.insert(0, str(Path(__file__).parent))
import backend_scenarios  # noqa: E402
from graph_ref import GgmlPy, addr  # noqa: E402

OUT = Path(__file__).parent.parent / "data" / "backend_ref.json"


class _BuftIface(ctypes.Structure):
    """struct ggml_backend_buffer_type_i: get_name, alloc_buffer, get_alignment, get_max_size,
    get_alloc_size, is_host."""
    _fields_ = [(n, ctypes.c_void_p) for n in
                ("get_name", "alloc_buffer", "get_alignment", "get_max_size", "get_alloc_size", "is_host")]


class _Buft(ctypes.Structure):
    _fields_ = [("iface", _BuftIface), ("device", ctypes.c_void_p), ("context", ctypes.c_void_p)]


_SIZE_FN = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p)
_KEEP = []


def cpu_buft():
    """The CPU backend's buffer type (calling ggml_backend_cpu_buffer_type() directly crashes
    through ggml-python 0.0.45; the backend's default type is the same object)."""
    backend = g.ggml_backend_cpu_init()
    _KEEP.append(backend)
    return g.ggml_backend_get_default_buffer_type(backend)


def with_max_size(max_size):
    """A copy of the CPU buffer type whose get_max_size answers max_size."""
    buft = _Buft()
    ctypes.memmove(ctypes.byref(buft), cpu_buft(), ctypes.sizeof(_Buft))
    fn = _SIZE_FN(lambda _: max_size)
    buft.iface.get_max_size = ctypes.cast(fn, ctypes.c_void_p).value
    _KEEP.extend([buft, fn])
    return ctypes.cast(ctypes.byref(buft), ctypes.c_void_p)


def run(name):
    api = GgmlPy()
    ctx, ts, max_size = backend_scenarios.build(api, name)
    buft = cpu_buft() if max_size is None else with_max_size(max_size)
    size = g.ggml_backend_alloc_ctx_tensors_from_buft_size(ctx, buft)
    buf = g.ggml_backend_alloc_ctx_tensors_from_buft(ctx, buft)
    out = {"size_query": size, "buffer": bool(buf)}
    if buf:
        out["buffer_size"] = g.ggml_backend_buffer_get_size(buf)
    bufs, placed = [], []
    for t in ts:
        c = t.contents
        b = addr(c.buffer)
        if b not in bufs:
            bufs.append(b)
        base = g.ggml_backend_buffer_get_base(c.buffer)
        placed.append({"name": c.name.decode(), "buffer": bufs.index(b), "offset": c.data - base})
    out["tensors"] = placed
    if buf:
        out["part_sizes"] = [g.ggml_backend_buffer_get_size(ctypes.c_void_p(b)) for b in bufs]
    return out


def main():
    buft = cpu_buft()
    ref = {"cpu_buffer_type": {"name": g.ggml_backend_buft_name(buft).decode(),
                               "alignment": g.ggml_backend_buft_get_alignment(buft),
                               "max_size": g.ggml_backend_buft_get_max_size(buft),
                               "is_host": bool(g.ggml_backend_buft_is_host(buft))},
           "scenarios": {name: run(name) for name in backend_scenarios.SCENARIOS}}
    OUT.write_text(json.dumps(ref, indent=1) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
