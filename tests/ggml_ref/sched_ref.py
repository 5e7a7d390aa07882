#!/usr/bin/env python3
"""What real ggml's scheduler (ggml_backend_sched) decides for the graphs of sched_scenarios.py.

For every scenario: build the graph with real ggml, allocate the weights in buffers of the named
backends (usage WEIGHTS or ANY), make a scheduler over the scenario's backends (BLAS and CPU,
graph_size 2048, op_offload on as llama.cpp has it), apply the user pins, and
ggml_backend_sched_alloc_graph. Recorded: n_splits, n_copies, the backend of every node and leaf
(by index in the graph), each split's backend and inputs (parsed from the GGML_SCHED_DEBUG=2 text,
which is stored too), and ggml_backend_sched_get_buffer_size for each backend. For one scenario it
also computes the graph with an eval callback and records the callback's calls; and for one RPC
scenario the first outputs of a fresh graph and of a graph reserved and then computed again
(`graph_reuse`: the split at the reserve rewrote its sources).

tests/test_sched.py reads tests/data/sched_ref.json and never needs ggml-python. It needs a
ggml-python built with BLAS (see tests/ggml_ref/README.md):

    GGML_NO_BACKTRACE=1 $GGMLPY tests/ggml_ref/sched_ref.py      ($GGMLPY: that python)

The RPC scenarios use a local rpc-server over the CPU device, started by this script in a child
process at $GGML_RPC_ENDPOINT (default 127.0.0.1:50917); the RPC backend's name, which contains
the endpoint, is stored as "RPC". ggml-python 0.0.45 bundles ggml 0.15.3. Binding pitfalls handled here:
ggml_backend_sched_get_tensor_backend's restype truncates the pointer (called from the library
with restype c_void_p); ggml_backend_sched_set_eval_callback needs a null callback object, not None.
"""
import ctypes
import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import ggml.ggml as g

sys.path.insert(0, str(Path(__file__).parent))
import sched_scenarios  # noqa: E402
from graph_ref import GgmlPy, captured_stderr  # noqa: E402

OUT = Path(__file__).parent.parent / "data" / "sched_ref.json"

_get_tensor_backend = g.lib.ggml_backend_sched_get_tensor_backend
_get_tensor_backend.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
_get_tensor_backend.restype = ctypes.c_void_p
_KEEP = []


def backend_of(sched, t):
    p = _get_tensor_backend(sched, ctypes.cast(t, ctypes.c_void_p))
    return g.ggml_backend_name(ctypes.c_void_p(p)).decode() if p else None


RPC_ENDPOINT = os.environ.get("GGML_RPC_ENDPOINT", "127.0.0.1:50917")
RPC_NAMES = (f"RPC0[{RPC_ENDPOINT}]", f"RPC[{RPC_ENDPOINT}]")   # backend / device, buffer type


def new_backend(name):
    if name == "RPC":
        b = g.ggml_backend_rpc_init(RPC_ENDPOINT.encode(), 0)
        assert b, f"no rpc-server at {RPC_ENDPOINT}"
    else:
        b = g.ggml_backend_blas_init() if name == "BLAS" else g.ggml_backend_cpu_init()
    _KEEP.append(b)
    return b


def start_rpc_server():
    """A local rpc-server over the CPU device, in a child process (ggml_backend_rpc_start_server
    does not return)."""
    code = ("import ctypes, ggml.ggml as g; dev = g.ggml_backend_dev_by_name(b'CPU'); "
            "arr = (ctypes.c_void_p * 1)(dev); "
            f"g.ggml_backend_rpc_start_server({RPC_ENDPOINT.encode()!r}, None, 2, 1, arr)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    host, port = RPC_ENDPOINT.rsplit(":", 1)
    for _ in range(100):
        try:
            socket.create_connection((host, int(port)), timeout=0.2).close()
            return proc
        except OSError:
            time.sleep(0.1)
    proc.kill()
    raise RuntimeError(f"rpc-server did not start at {RPC_ENDPOINT}")


def rpc_normalized(x):
    """The RPC backend is named after its endpoint: store it as "RPC"."""
    text = json.dumps(x)
    for name in RPC_NAMES:
        text = text.replace(name, "RPC")
    return json.loads(text)


SPLIT_RE = re.compile(r"^## SPLIT #(\d+): (\S+) # (\d+) inputs(?:: (.*))?$")


def parse_splits(text):
    splits = []
    for line in text.splitlines():
        m = SPLIT_RE.match(line)
        if m:
            inputs = re.findall(r"\[(.+?) \(\s*\S+\)\] ", (m.group(4) or "") + " ")
            splits.append({"backend": m.group(2), "n_inputs": int(m.group(3)), "inputs": inputs})
    return splits


def fill_inputs(s):
    for t in s["inputs"]:
        c = t.contents
        n = g.ggml_nbytes(t)
        if c.type == g.GGML_TYPE_I32:
            data = (ctypes.c_int32 * c.ne[0])(*range(c.ne[0]))
        else:
            data = (ctypes.c_float * (n // 4))(*([0.01] * (n // 4)))
        g.ggml_backend_tensor_set(t, ctypes.cast(data, ctypes.c_void_p), 0, n)


def run(name, spec, callback=False):
    api = GgmlPy()
    s = sched_scenarios.build(api, spec)
    backends = [new_backend(n) for n in spec["backends"]]
    by_name = {}
    for n, b in zip(spec["backends"], backends):
        by_name.setdefault(n, b)
    for wctx, where, usage in s["weights"]:
        buf = g.ggml_backend_alloc_ctx_tensors(wctx, by_name[where])
        _KEEP.append(buf)
        g.ggml_backend_buffer_set_usage(buf, g.GGML_BACKEND_BUFFER_USAGE_WEIGHTS if usage == "weights"
                                        else g.GGML_BACKEND_BUFFER_USAGE_ANY)
    arr = (ctypes.c_void_p * len(backends))(*backends)
    os.environ["GGML_SCHED_DEBUG"] = "2"
    sched = g.ggml_backend_sched_new(arr, None, len(backends), 2048, spec["parallel"], True)
    del os.environ["GGML_SCHED_DEBUG"]
    gf = s["gf"]
    cg = gf.contents
    nodes = {cg.nodes[i].contents.name.decode(): cg.nodes[i] for i in range(cg.n_nodes)}
    for node_name, bname in s["pins"]:
        g.ggml_backend_sched_set_tensor_backend(sched, nodes[node_name], by_name[bname])
    # the backends before the split rewrites the srcs: read them from the debug text's order
    with captured_stderr() as err:
        ok = g.ggml_backend_sched_alloc_graph(sched, gf)
    assert ok, name
    out = {"n_splits": g.ggml_backend_sched_get_n_splits(sched),
           "n_copies": g.ggml_backend_sched_get_n_copies(sched),
           "nodes": [[cg.nodes[i].contents.name.decode(), backend_of(sched, cg.nodes[i])]
                     for i in range(cg.n_nodes)],
           "leafs": [[cg.leafs[i].contents.name.decode(), backend_of(sched, cg.leafs[i])]
                     for i in range(cg.n_leafs)],
           "splits": parse_splits(err["text"]),
           "buffer_sizes": [g.ggml_backend_sched_get_buffer_size(sched, b) for b in backends],
           "debug": err["text"]}
    assert len(out["splits"]) == out["n_splits"], name
    if "RPC" in spec["backends"]:
        del out["debug"]             # its backend names are cut to 5 characters: "RPC[1"
        out = rpc_normalized(out)
    if callback:
        fill_inputs(s)
        calls = []

        @g.ggml_backend_sched_eval_callback
        def cb(t, ask, _):
            tname = t.contents.name.decode()
            calls.append([tname, bool(ask)])
            if ask:
                return t.contents.op == g.GGML_OP_MUL_MAT
            return tname != sched_scenarios.CALLBACK_STOP_AT

        g.ggml_backend_sched_set_eval_callback(sched, cb, None)
        status = g.ggml_backend_sched_graph_compute(sched, gf)
        g.ggml_backend_sched_set_eval_callback(sched, g.ggml_backend_sched_eval_callback(0), None)
        out["callback"] = {"status": status, "calls": calls}
    g.ggml_backend_sched_free(sched)
    return out


def graph_reuse(name="llama-F32-8-rpc_half"):
    """The same graph reserved and then allocated and computed (the split rewrote its srcs at the
    reserve), against a fresh graph: the first output values of each, same weights and inputs."""
    out = {"scenario": name}
    spec = sched_scenarios.SCENARIOS[name]
    for how in ("fresh", "reused"):
        s = sched_scenarios.build(GgmlPy(), spec)
        backends = [new_backend(n) for n in spec["backends"]]
        for wctx, where, usage in s["weights"]:
            buf = g.ggml_backend_alloc_ctx_tensors(wctx, backends[spec["backends"].index(where)])
            g.ggml_backend_buffer_set_usage(buf, g.GGML_BACKEND_BUFFER_USAGE_WEIGHTS)
            _KEEP.append(buf)
            t = g.ggml_get_first_tensor(wctx)
            while t:
                n = g.ggml_nbytes(t)
                data = (ctypes.c_float * (n // 4))(*([0.01] * (n // 4)))
                g.ggml_backend_tensor_set(t, ctypes.cast(data, ctypes.c_void_p), 0, n)
                t = g.ggml_get_next_tensor(wctx, t)
        arr = (ctypes.c_void_p * len(backends))(*backends)
        sched = g.ggml_backend_sched_new(arr, None, len(backends), 2048, False, True)
        measure = s if how == "reused" else sched_scenarios.build(GgmlPy(), spec)
        assert g.ggml_backend_sched_reserve(sched, measure["gf"])
        assert g.ggml_backend_sched_alloc_graph(sched, s["gf"])
        fill_inputs(s)
        assert g.ggml_backend_sched_graph_compute(sched, s["gf"]) == 0
        n = g.ggml_nbytes(s["out"])
        vals = (ctypes.c_float * (n // 4))()
        g.ggml_backend_tensor_get(s["out"], ctypes.cast(vals, ctypes.c_void_p), 0, n)
        out[how] = [round(v, 6) for v in vals[:4]]
        g.ggml_backend_sched_free(sched)
    return out


def main():
    result = {"ggml_version": g.ggml_version().decode(), "scenarios": {}}
    server = start_rpc_server()
    try:
        for name, spec in sched_scenarios.SCENARIOS.items():
            result["scenarios"][name] = run(name, spec, callback=name == sched_scenarios.CALLBACK_SCENARIO)
        result["graph_reuse"] = graph_reuse()
    finally:
        server.kill()
        server.wait()
    lines = [f" {json.dumps(name)}: {json.dumps(v)}" for name, v in result["scenarios"].items()]
    head = {"ggml_version": result["ggml_version"], "graph_reuse": result["graph_reuse"]}
    OUT.write_text(json.dumps(head)[:-1] + ', "scenarios": {\n'
                   + ",\n".join(lines) + "\n}}\n")
    print(f"wrote {OUT}: {len(lines)} scenarios")


if __name__ == "__main__":
    main()
