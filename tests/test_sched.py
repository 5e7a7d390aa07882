"""The backend scheduler (book/09_sched.ipynb) against real ggml 0.15.3's decisions
(tests/data/sched_ref.json, written by tests/ggml_ref/sched_ref.py from the graphs of
tests/ggml_ref/sched_scenarios.py), and its compute, copies, callback and memory on ggml_lite."""
import json
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

import ggml_lite as ggml
from ggml_lite.backend import Backend, BackendBuffer, BackendBufferType, BackendDevice, BackendEvent
from ggml_lite.backends.blas import backend_blas_init
from ggml_lite.backends.cpu.backend import backend_cpu_init
from ggml_lite.backends.cpu.compute import graph_compute, graph_plan
from ggml_lite.core import GGMLError, Status

sys.path.insert(0, str(Path(__file__).parent / "ggml_ref"))
import sched_scenarios  # noqa: E402
from graph_lite import Lite  # noqa: E402

REF = json.loads((Path(__file__).parent / "data" / "sched_ref.json").read_text())
SCENARIOS = sched_scenarios.SCENARIOS


def _new_backend(name):
    return backend_blas_init() if name == "BLAS" else backend_cpu_init()


def _setup(spec, backend_names=None, extra=None):
    """Build spec's graph with ggml_lite, place its weights, make the sched and apply the pins."""
    s = sched_scenarios.build(Lite(), spec)
    names = backend_names or spec["backends"]
    backends = [extra[n] if extra and n in extra else _new_backend(n) for n in names]
    by_name = {}
    for n, b in zip(names, backends):
        by_name.setdefault(n, b)
    for wctx, where, usage in s["weights"]:
        buf = ggml.backend_alloc_ctx_tensors(wctx, by_name[where])
        ggml.backend_buffer_set_usage(buf, ggml.BackendBufferUsage.WEIGHTS if usage == "weights"
                                      else ggml.BackendBufferUsage.ANY)
        rng = np.random.default_rng(len(s["weights"]))
        for t in _tensors(wctx):
            _fill(t, rng)
    sched = ggml.backend_sched_new(backends, None, len(backends), 2048, spec["parallel"], True)
    nodes = {n.name: n for n in s["gf"].nodes}
    for node_name, bname in s["pins"]:
        ggml.backend_sched_set_tensor_backend(sched, nodes[node_name], by_name[bname])
    return s, sched, backends


def _tensors(ctx):
    return list(ctx)


def _fill(t, rng):
    """Weights: small values (quantized types through the reference quantizer)."""
    n = ggml.nelements(t)
    vals = (rng.standard_normal(n) * 0.1).astype(np.float32)
    if t.type == ggml.Type.F32:
        ggml.backend_tensor_set(t, vals.reshape(t.numpy().shape))
    else:
        q = ggml.quantize_chunk(t.type, vals.reshape(-1, t.ne[0]))
        ggml.backend_tensor_set(t, np.ascontiguousarray(q).view(np.uint8).reshape(-1))


def _fill_inputs(s, seed=0):
    rng = np.random.default_rng(seed)
    for t in s["inputs"]:
        if t.type == ggml.Type.I32:
            ggml.backend_tensor_set(t, np.arange(t.ne[0], dtype=np.int32))
        elif t.name == "kq_mask":
            n = t.ne[0]
            mask = np.where(np.tril(np.ones((n, n))) > 0, 0.0, -np.inf).astype(np.float32)
            ggml.backend_tensor_set(t, mask.reshape(t.numpy().shape))
        else:
            ggml.backend_tensor_set(t, rng.standard_normal(t.numpy().shape).astype(np.float32))


def _backend_name(sched, t):
    b = ggml.backend_sched_get_tensor_backend(sched, t)
    return None if b is None else ggml.backend_name(b)


# --- the decisions, against real ggml --------------------------------------------------------

@pytest.mark.parametrize("name", list(SCENARIOS))
def test_assignment_matches_ggml(name):
    ref = REF["scenarios"][name]
    s, sched, backends = _setup(SCENARIOS[name])
    gf = s["gf"]
    assert ggml.backend_sched_alloc_graph(sched, gf)
    assert ggml.backend_sched_get_n_splits(sched) == ref["n_splits"]
    assert ggml.backend_sched_get_n_copies(sched) == ref["n_copies"]
    assert [[n.name, _backend_name(sched, n)] for n in gf.nodes] == ref["nodes"]
    assert [[n.name, _backend_name(sched, n)] for n in gf.leafs] == ref["leafs"]
    splits = [{"backend": ggml.backend_name(sched.backends[sp.backend_id]), "n_inputs": sp.n_inputs,
               "inputs": [t.name for t in sp.inputs]} for sp in sched.splits]
    assert splits == ref["splits"]
    assert [ggml.backend_sched_get_buffer_size(sched, b) for b in backends] == ref["buffer_sizes"]


@pytest.mark.parametrize("name", ["llama-F32-64-cpu", "llama-F32-8-pin_norm_blas", "llama-F32-32-parallel",
                                  "natural-F32-32-cpu"])
def test_debug_text_matches_ggml(name):
    """GGML_SCHED_DEBUG=2's text, character for character."""
    s, sched, _ = _setup(SCENARIOS[name])
    assert ggml.backend_sched_alloc_graph(sched, s["gf"])
    assert ggml.backend_sched_print_assignments(sched, s["gf"], 2) == REF["scenarios"][name]["debug"]


def test_eval_callback_matches_ggml():
    """ggml's ask/observe order; False when observing ends that split, the later ones still run."""
    name = sched_scenarios.CALLBACK_SCENARIO
    s, sched, _ = _setup(SCENARIOS[name])
    calls = []

    def cb(t, ask, user_data):
        calls.append([t.name, bool(ask)])
        if ask:
            return t.op == ggml.Op.MUL_MAT
        return t.name != sched_scenarios.CALLBACK_STOP_AT

    ggml.backend_sched_set_eval_callback(sched, cb, None)
    assert ggml.backend_sched_alloc_graph(sched, s["gf"])
    _fill_inputs(s)
    status = ggml.backend_sched_graph_compute(sched, s["gf"])
    ref = REF["scenarios"][name]["callback"]
    assert int(status) == ref["status"]
    assert calls == ref["calls"]
