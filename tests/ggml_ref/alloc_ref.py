#!/usr/bin/env python3
"""What real ggml's graph allocator (ggml_gallocr) decides for the graphs of alloc_scenarios.py.

For every scenario this builds the graphs with real ggml in no_alloc contexts, plans them with
ggml_gallocr on the CPU buffer type (or on a copy of it with another alignment / max_size), and
prints one JSON object: per scenario the buffer size after each step (`ggml_gallocr_get_buffer_size`
for every buffer id, or `ggml_gallocr_reserve_n_size`) and, after the last `ggml_gallocr_alloc_graph`,
where every leaf and node of the last graph landed: `[buffer id, chunk, offset]` inside gallocr's
buffers (chunk = which backend buffer of the virtual buffer), "ext" for memory from elsewhere, null
for none. It also lists the ops `ggml_op_can_inplace` accepts.

tests/test_alloc.py states the buffer sizes as numbers and reads the placements from
tests/data/alloc_ref.json; it never needs ggml-python. To re-run (about 1 minute to build ggml
the first time):

    python3 -m venv /tmp/ggmlpy && /tmp/ggmlpy/bin/pip install ggml-python==0.0.45 numpy
    GGML_NO_BACKTRACE=1 /tmp/ggmlpy/bin/python tests/ggml_ref/alloc_ref.py > tests/data/alloc_ref.json

ggml-python 0.0.45 bundles ggml 0.15.3.
"""
import ctypes
import json
import sys
from pathlib import Path

import ggml.ggml as g

sys.path.insert(0, str(Path(__file__).parent))
import alloc_scenarios  # noqa: E402
from graph_ref import GgmlPy  # noqa: E402


class _BuftIface(ctypes.Structure):
    """struct ggml_backend_buffer_type_i (src/ggml-backend-impl.h): six function pointers."""
    _fields_ = [(n, ctypes.c_void_p) for n in
                ("get_name", "alloc_buffer", "get_alignment", "get_max_size", "get_alloc_size", "is_host")]


class _Buft(ctypes.Structure):
    """struct ggml_backend_buffer_type: {iface, device, context}."""
    _fields_ = [("iface", _BuftIface), ("device", ctypes.c_void_p), ("context", ctypes.c_void_p)]


_SIZE_FN = ctypes.CFUNCTYPE(ctypes.c_size_t, ctypes.c_void_p)
_KEEP = []      # ctypes objects that must outlive the allocators using them


def cpu_buft():
    backend = g.ggml_backend_cpu_init()
    _KEEP.append(backend)
    return g.ggml_backend_get_default_buffer_type(backend)


def custom_buft(alignment, max_size):
    """A copy of the CPU buffer type whose get_alignment / get_max_size answer other numbers."""
    buft = _Buft()
    ctypes.memmove(ctypes.byref(buft), cpu_buft(), ctypes.sizeof(_Buft))
    align_fn = _SIZE_FN(lambda _: alignment)
    max_fn = _SIZE_FN(lambda _: max_size)
    buft.iface.get_alignment = ctypes.cast(align_fn, ctypes.c_void_p).value
    buft.iface.get_max_size = ctypes.cast(max_fn, ctypes.c_void_p).value
    _KEEP.extend([buft, align_fn, max_fn])
    return ctypes.addressof(buft)


def addr(p):
    return ctypes.cast(p, ctypes.c_void_p).value or 0


def vbuffer_chunks(galloc, buffer_id):
    """The backend buffers behind gallocr's virtual buffer: struct ggml_gallocr's second field is
    `struct vbuffer ** buffers`, and a vbuffer is `ggml_backend_buffer_t chunks[16]`."""
    fields = ctypes.cast(galloc, ctypes.POINTER(ctypes.c_void_p))
    vbuf = ctypes.cast(fields[1], ctypes.POINTER(ctypes.c_void_p))[buffer_id]
    if not vbuf:
        return []
    return [c for c in ctypes.cast(vbuf, ctypes.POINTER(ctypes.c_void_p))[0:16] if c]


def placement(t, chunks):
    c = t.contents
    if not c.data:
        return None
    buf = addr(c.buffer)
    for buffer_id, bufs in chunks.items():
        if buf in bufs:
            return [buffer_id, bufs.index(buf), c.data - g.ggml_backend_buffer_get_base(c.buffer)]
    return "ext"


def run(scenario):
    s = scenario(GgmlPy())
    n_bufs = s.get("n_bufs", 1)
    buft = custom_buft(*s["buft"]) if "buft" in s else cpu_buft()
    bufts = (ctypes.c_void_p * n_bufs)(*([buft] * n_bufs))
    galloc = g.ggml_gallocr_new_n(bufts, n_bufs)
    steps = s.get("steps", ["reserve"] + ["alloc"] * (len(s["graphs"]) - 1))
    out = {"sizes": []}
    for step, gf in zip(steps, s["graphs"]):
        if step == "reserve":
            ids = s.get("node_ids")
            node_ids = (ctypes.c_int * len(ids))(*ids) if ids else None
            ok = g.ggml_gallocr_reserve_n(galloc, gf, node_ids, None)
        else:
            ok = g.ggml_gallocr_alloc_graph(galloc, gf)
        out["sizes"].append([g.ggml_gallocr_get_buffer_size(galloc, i) for i in range(n_bufs)])
        assert ok, step
    gf = s["graphs"][-1]
    if steps[-1] == "reserve":
        assert g.ggml_gallocr_alloc_graph(galloc, gf)
    chunks = {i: vbuffer_chunks(galloc, i) for i in range(n_bufs)}
    cg = gf.contents
    out["n_chunks"] = [len(chunks[i]) for i in range(n_bufs)]
    out["chunk_sizes"] = [[g.ggml_backend_buffer_get_size(c) for c in chunks[i]] for i in range(n_bufs)]
    out["leafs"] = [placement(cg.leafs[i], chunks) for i in range(cg.n_leafs)]
    out["nodes"] = [placement(cg.nodes[i], chunks) for i in range(cg.n_nodes)]
    out["names"] = [cg.nodes[i].contents.name.decode() for i in range(cg.n_nodes)]
    g.ggml_gallocr_free(galloc)
    return out


def main():
    can_inplace = g.lib.ggml_op_can_inplace
    can_inplace.argtypes, can_inplace.restype = [ctypes.c_int], ctypes.c_bool
    result = {"ggml_version": g.ggml_version().decode(),
              "inplace_ops": [g.ggml_op_name(op).decode() for op in range(g.GGML_OP_COUNT) if can_inplace(op)],
              "scenarios": {}}
    for name, scenario in alloc_scenarios.SCENARIOS.items():
        result["scenarios"][name] = run(scenario)
    # one line per scenario: small diffs when ggml changes its mind
    head = {k: v for k, v in result.items() if k != "scenarios"}
    print(json.dumps(head)[:-1] + ', "scenarios": {')
    lines = [f" {json.dumps(name)}: {json.dumps(v)}" for name, v in result["scenarios"].items()]
    print(",\n".join(lines))
    print("}}")


if __name__ == "__main__":
    main()
