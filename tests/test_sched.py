"""The backend scheduler (book/09_sched.ipynb) against real ggml 0.15.3's decisions
(tests/data/sched_ref.json, written by tests/ggml_ref/sched_ref.py from the graphs of
tests/ggml_ref/sched_scenarios.py), and its compute, copies, callback and memory on ggml_lite."""
import io
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
from ggml_lite.backends.cpu.compute import _PREPARED, graph_compute, graph_plan
from ggml_lite.core import GGMLError, Status
from ggml_lite.types import Type

sys.path.insert(0, str(Path(__file__).parent / "ggml_ref"))
import sched_scenarios  # noqa: E402
from graph_lite import Lite  # noqa: E402

REF = json.loads((Path(__file__).parent / "data" / "sched_ref.json").read_text())
SCENARIOS = sched_scenarios.SCENARIOS


def _new_backend(name):
    return backend_blas_init() if name == "BLAS" else backend_cpu_init()


def _setup(spec, extra=None, op_offload=True):
    """Build spec's graph with ggml_lite, place its weights, make the sched and apply the pins.
    extra: backends by name for names other than BLAS and CPU (the PRIV test backend)."""
    s = sched_scenarios.build(Lite(), spec)
    names = spec["backends"]
    backends = [extra[n] if extra and n in extra else _new_backend(n) for n in names]
    by_name = {}
    for n, b in zip(names, backends):
        by_name.setdefault(n, b)
    _place_weights(s, by_name)
    sched = ggml.backend_sched_new(backends, None, len(backends), 2048, spec["parallel"], op_offload)
    nodes = {n.name: n for n in s["gf"].nodes}
    for node_name, bname in s["pins"]:
        ggml.backend_sched_set_tensor_backend(sched, nodes[node_name], by_name[bname])
    return s, sched, backends


def _place_weights(s, by_name):
    """Each weight context in a buffer of its backend, with its usage; the same values every time."""
    rng = np.random.default_rng(len(s["weights"]))
    for wctx, where, usage in s["weights"]:
        buf = ggml.backend_alloc_ctx_tensors(wctx, by_name[where])
        ggml.backend_buffer_set_usage(buf, ggml.BackendBufferUsage.WEIGHTS if usage == "weights"
                                      else ggml.BackendBufferUsage.ANY)
        for t in _tensors(wctx):
            _fill(t, rng)


def _tensors(ctx):
    return list(ctx)


def _fill(t, rng):
    """Weights: small values (quantized types through the reference quantizer)."""
    n = ggml.nelements(t)
    vals = (rng.standard_normal(n) * 0.1).astype(np.float32)
    if t.type == ggml.Type.F32:
        ggml.backend_tensor_set(t, vals.reshape(t.ne[::-1]))
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
            ggml.backend_tensor_set(t, mask.reshape(t.ne[::-1]))
        else:
            ggml.backend_tensor_set(t, rng.standard_normal(t.ne[::-1]).astype(np.float32))


def _backend_name(sched, t):
    b = ggml.backend_sched_get_tensor_backend(sched, t)
    return None if b is None else ggml.backend_name(b)


# --- the decisions, against real ggml --------------------------------------------------------

def _rpc_stand_in():
    return PrivDevice(offload=lambda op: False, events=False, name="RPC").init_backend()


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_assignment_matches_ggml(name):
    ref = REF["scenarios"][name]
    s, sched, backends = _setup(SCENARIOS[name], extra={"RPC": _rpc_stand_in()})
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
    text = io.StringIO()
    ggml.sched_passes.backend_sched_print_assignments(sched, s["gf"], 2, file=text)
    assert text.getvalue() == REF["scenarios"][name]["debug"]


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


# --- a backend whose memory the CPU cannot read ---------------------------------------------

class PrivStats:
    """What crossed between host memory and the private device."""

    def __init__(self):
        self.reset()

    def reset(self):
        self.set_calls = self.set_bytes = 0          # host -> device, blocking (buffer.set_tensor)
        self.get_calls = self.get_bytes = 0          # device -> host (buffer.get_tensor)
        self.async_calls = self.async_bytes = 0      # host -> device, queued (cpy_tensor_async)
        self.computes = 0
        self.events_recorded = self.events_waited = self.events_synced = 0
        self.copied = []                             # names of the destination tensors


class PrivBufferType(BackendBufferType):
    def __init__(self, device, stats):
        super().__init__(device)
        self.stats = stats

    def get_name(self):
        return self.device.get_name()

    def alloc_buffer(self, size):
        return PrivBuffer(self, size)

    def get_alignment(self):
        return 32


class PrivBuffer(BackendBuffer):
    """Device memory: the host has no view of it. Only the device's compute (device_mode) and
    the buffer's own set/get, which count every byte, touch it."""
    device_mode = False

    def __init__(self, buft, size):
        super().__init__(buft, size)
        raw = np.zeros(size + 64, np.uint8)
        skip = (-raw.ctypes.data) % 64
        self._mem = raw[skip:skip + size]

    def _host_array(self):              # what tensor.numpy() and the kernels read through
        if not PrivBuffer.device_mode:
            raise GGMLError("host access to PRIV memory: the CPU cannot read this buffer")
        return self._mem

    def get_base(self):
        return self._mem.ctypes.data

    def _range(self, tensor, offset, size):
        start = tensor.data - self.get_base() + offset
        assert 0 <= start and start + size <= self.size
        return slice(start, start + size)

    def set_tensor(self, tensor, data, offset, size):
        self.buft.stats.set_calls += 1
        self.buft.stats.set_bytes += size
        self.buft.stats.copied.append(tensor.name)
        self._mem[self._range(tensor, offset, size)] = data[:size]

    def get_tensor(self, tensor, data, offset, size):
        self.buft.stats.get_calls += 1
        self.buft.stats.get_bytes += size
        data[:size] = self._mem[self._range(tensor, offset, size)]

    def memset_tensor(self, tensor, value, offset, size):
        self._mem[self._range(tensor, offset, size)] = value

    def clear(self, value):
        self._mem[:] = value


def _in_priv(t):
    root = t.view_src if t.view_src is not None else t
    buf = t.buffer if t.buffer is not None else root.buffer
    return buf is None or isinstance(buf, PrivBuffer)


class PrivBackend(Backend):
    def __init__(self, device):
        super().__init__(b"ggml_lite-priv!!", device)
        self.work = np.zeros(0, np.uint8)

    def get_name(self):
        return self.device.get_name()

    def graph_compute(self, cgraph):
        for node in cgraph.nodes:            # it reads only its own memory
            if node.op in (ggml.Op.NONE, ggml.Op.VIEW, ggml.Op.RESHAPE, ggml.Op.PERMUTE, ggml.Op.TRANSPOSE):
                continue                     # views compute nothing (a split may start with some)
            bad = [s.name for s in [node] + node.src if s is not None and not _in_priv(s)]
            if bad:
                raise GGMLError(f"PRIV compute: node '{node.name}' uses host tensors {bad}")
        self.device.stats.computes += 1
        PrivBuffer.device_mode = True
        try:
            plan = graph_plan(cgraph, 1)
            if self.work.nbytes < plan.work_size:       # grown once, as the CPU backend does
                self.work = np.zeros(plan.work_size, np.uint8)
            plan.work_data = self.work
            return graph_compute(cgraph, plan)
        finally:
            PrivBuffer.device_mode = False

    def cpy_tensor_async(self, backend_src, src, dst):
        src_buf = src.view_src.buffer if src.view_src is not None else src.buffer
        if src_buf is None or not ggml.backend_buffer_is_host(src_buf):
            return False
        n = ggml.nbytes(src)
        stats = self.device.stats
        stats.async_calls += 1
        stats.async_bytes += n
        stats.copied.append(dst.name)
        dst.buffer._mem[dst.buffer._range(dst, 0, n)] = ggml.backend_tensor_get(src, offset=0, size=n)
        return True

    def event_record(self, event):
        self.device.stats.events_recorded += 1

    def event_wait(self, event):
        self.device.stats.events_waited += 1


class PrivDevice(BackendDevice):
    """A pretend GPU: ggml_lite's CPU kernels over memory the host cannot see. offload(op):
    its offload_op (default: a batch of 32 or more, as ggml's GPU backends). As name="RPC" with
    no offload_op and no events it stands in for ggml's RPC backend, whose supports_op says yes
    to everything and whose supports_buft accepts only its own buffer type."""

    def __init__(self, ops=None, offload=None, events=True, name="PRIV"):
        super().__init__(None)
        self.name = name
        self.stats = PrivStats()
        self.buft = PrivBufferType(self, self.stats)
        self.ops = ops                 # None: every op the CPU backend computes
        self.offload = offload or (lambda op: op.op == ggml.Op.MUL_MAT and op.ne[1] >= 32)
        self.events = events
        self._cpu = backend_cpu_init().device

    def get_name(self):
        return self.name

    def get_description(self):
        return "private-memory test device"

    def get_memory(self):
        return 1 << 30, 1 << 30

    def get_type(self):
        return ggml.BackendDevType.GPU

    def init_backend(self, params=None):
        return PrivBackend(self)

    def get_buffer_type(self):
        return self.buft

    def supports_buft(self, buft):
        return buft is self.buft

    def supports_op(self, op):
        # like a GPU backend it does not ask where the srcs are: the scheduler copies them in,
        # and graph_compute checks that it reads only its own memory
        if self.ops is not None and op.op not in self.ops and op.op not in (
                ggml.Op.NONE, ggml.Op.VIEW, ggml.Op.RESHAPE, ggml.Op.PERMUTE, ggml.Op.TRANSPOSE):
            return False
        saved = [s.buffer if s is not None else None for s in op.src]
        try:                           # the CPU's kernel list, the srcs' place aside
            for s in op.src:
                if s is not None:
                    s.buffer = None
            return ggml.backend_dev_supports_op(self._cpu, op)
        finally:
            for s, b in zip(op.src, saved):
                if s is not None:
                    s.buffer = b

    def offload_op(self, op):
        return bool(self.offload(op))

    def event_new(self):
        return BackendEvent(self) if self.events else None

    def event_synchronize(self, event):
        self.stats.events_synced += 1


def _cpu_reference(spec, seed=0):
    """The scenario's output computed by the CPU backend alone (one gallocr, no scheduler)."""
    s = sched_scenarios.build(Lite(), spec)
    cpu = backend_cpu_init()
    rng = np.random.default_rng(len(s["weights"]))
    for wctx, _, _ in s["weights"]:
        ggml.backend_alloc_ctx_tensors(wctx, cpu)
        for t in _tensors(wctx):
            _fill(t, rng)
    galloc = ggml.gallocr_new(ggml.backend_get_default_buffer_type(cpu))
    assert ggml.gallocr_alloc_graph(galloc, s["gf"])
    _fill_inputs(s, seed)
    assert ggml.backend_graph_compute(cpu, s["gf"]) == Status.SUCCESS
    return ggml.backend_tensor_get(s["out"])


def _spec(graph, n_tok, wtype="F32", weights=("CPU", "weights"), backends=("PRIV", "CPU"), **kw):
    spec = sched_scenarios.make_spec(graph, n_tok, wtype, weights, backends, **kw)
    return spec


def _priv(**kw):
    dev = PrivDevice(**kw)
    return dev, dev.init_backend()


def _nmse(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.sum((a - b) ** 2) / np.sum(b ** 2))


def _compute(s, sched):
    assert ggml.backend_sched_alloc_graph(sched, s["gf"])
    _fill_inputs(s)
    assert ggml.backend_sched_graph_compute(sched, s["gf"]) == Status.SUCCESS
    return ggml.backend_tensor_get(s["out"])


# --- compute through the scheduler equals the CPU alone --------------------------------------

@pytest.mark.parametrize("graph", ["ffn", "llama"])
@pytest.mark.parametrize("wtype", ["F32", "Q8_0"])
@pytest.mark.parametrize("n_tok", [8, 64])
def test_blas_and_cpu_compute_equals_cpu_alone(graph, wtype, n_tok):
    spec = SCENARIOS[f"{graph}-{wtype}-{n_tok}-cpu"]
    s, sched, _ = _setup(spec)
    got = _compute(s, sched)
    # BLAS multiplies in float32 from dequantized weights, the CPU kernel in its vec_dot type:
    # test-backend-ops' limit for MUL_MAT
    assert _nmse(got, _cpu_reference(spec)) <= 5e-4
    assert np.all(np.isfinite(got))


@pytest.mark.parametrize("graph", ["ffn", "llama", "natural"])
@pytest.mark.parametrize("where", [("PRIV", "weights"), "half", ("CPU", "weights")])
@pytest.mark.parametrize("parallel", [False, True])
def test_private_device_compute_equals_cpu_alone(graph, where, parallel):
    dev, priv = _priv()
    weights = sched_scenarios.half_layers(("CPU", "weights"), ("PRIV", "weights")) if where == "half" else where
    spec = _spec(graph, 33, "Q8_0", weights, parallel=parallel)
    s, sched, _ = _setup(spec, extra={"PRIV": priv})
    got = _compute(s, sched)
    assert _nmse(got, _cpu_reference(spec)) <= 1e-7       # the same kernels on both sides
    assert dev.stats.computes > 0 or where == ("CPU", "weights")


# --- the copies are real ---------------------------------------------------------------------

def _expected_traffic(sched):
    """Bytes each direction must carry: every input of every split, once."""
    to_priv = sum(ggml.nbytes(t) for sp in sched.splits if ggml.backend_name(sched.backends[sp.backend_id]) == "PRIV"
                  for t in sp.inputs)
    to_host = sum(ggml.nbytes(t) for sp in sched.splits if ggml.backend_name(sched.backends[sp.backend_id]) != "PRIV"
                  for t in sp.inputs)
    n = sum(sp.n_inputs for sp in sched.splits)
    return to_priv, to_host, n


def test_split_inputs_are_copied_to_and_from_private_memory():
    dev, priv = _priv()
    spec = _spec("llama", 8, weights=sched_scenarios.half_layers(("CPU", "weights"), ("PRIV", "weights")))
    s, sched, _ = _setup(spec, extra={"PRIV": priv})
    assert ggml.backend_sched_alloc_graph(sched, s["gf"])
    _fill_inputs(s)
    dev.stats.reset()
    assert ggml.backend_sched_graph_compute(sched, s["gf"]) == Status.SUCCESS
    to_priv, to_host, n = _expected_traffic(sched)
    st = dev.stats
    priv_inputs = [t for sp in sched.splits if sched.backends[sp.backend_id] is priv for t in sp.inputs]
    # layer 0 on the CPU, layer 1 on the device; the "GPU up" walk pulled layer 0's last ADD onto
    # the device too, so its split needs both operands of that ADD, the positions and the mask
    assert sched.n_splits == 2
    assert [t.name for t in priv_inputs] == ["ffn_out-0", "ffn_inp-0", "inp_pos", "kq_mask"]
    assert st.set_bytes + st.async_bytes == to_priv > 0        # host -> device, each byte once
    assert st.get_bytes == to_host == 0                         # the result stays on the device
    assert st.set_calls + st.async_calls + st.get_calls == n == 4
    # computed tensors are queued (cpy_tensor_async), user inputs copied at once (set_tensor)
    assert st.async_calls == 2 and st.async_bytes == sum(ggml.nbytes(t) for t in priv_inputs[:2])
    assert st.set_calls == 2 and st.set_bytes == sum(ggml.nbytes(t) for t in priv_inputs[2:])
    # each copy lands in the tensor ggml names "<backend>#<src>#<copy>"
    assert sorted(st.copied) == sorted(f"PRIV#{t.name}#0" for sp in sched.splits for t in sp.inputs
                                       if sched.backends[sp.backend_id] is priv)
    # the CPU never saw the device's memory: reading it from the host fails
    priv_tensor = next(n for n in s["gf"].nodes if isinstance(n.buffer, PrivBuffer) and n.view_src is None)
    with pytest.raises(GGMLError, match="cannot read"):
        priv_tensor.numpy()
    assert _nmse(ggml.backend_tensor_get(s["out"]), _cpu_reference(spec)) <= 1e-7


def test_user_input_goes_to_the_device_with_a_blocking_copy():
    """inp_embd is an INPUT on the CPU and its first user runs on the device: ggml copies user
    inputs immediately (the user may overwrite them once compute returns)."""
    dev, priv = _priv()
    spec = _spec("ffn", 64, weights=("PRIV", "weights"))
    s, sched, _ = _setup(spec, extra={"PRIV": priv})
    assert ggml.backend_sched_alloc_graph(sched, s["gf"])
    assert [t.name for t in sched.splits[0].inputs] == ["inp_embd"]
    _fill_inputs(s)
    dev.stats.reset()
    assert ggml.backend_sched_graph_compute(sched, s["gf"]) == Status.SUCCESS
    assert dev.stats.set_calls == 1 and dev.stats.async_calls == 0
    assert dev.stats.set_bytes == ggml.nbytes(s["inputs"][0])


def test_pipeline_parallel_copies_rotate_and_use_events():
    dev, priv = _priv()
    spec = _spec("llama", 8, weights=sched_scenarios.half_layers(("CPU", "weights"), ("PRIV", "weights")), parallel=True)
    ref = _cpu_reference(spec)
    s, sched, backends = _setup(spec, extra={"PRIV": priv})
    used = []
    for step in range(5):
        if step:                    # a fresh graph of the same shape, llama.cpp's way
            ggml.backend_sched_reset(sched)
            s = sched_scenarios.build(Lite(), spec)
            _place_weights(s, dict(zip(spec["backends"], backends)))
        assert ggml.backend_sched_get_n_copies(sched) == 4
        assert ggml.backend_sched_alloc_graph(sched, s["gf"])
        used.append(sched.cur_copy)
        names = [src.name for n in s["gf"].nodes for src in n.src if src is not None and "#" in src.name]
        assert names and all(name.endswith(f"#{sched.cur_copy}") for name in names)
        _fill_inputs(s)
        assert ggml.backend_sched_graph_compute(sched, s["gf"]) == Status.SUCCESS
        assert _nmse(ggml.backend_tensor_get(s["out"]), ref) <= 1e-7
    assert used == [0, 1, 2, 3, 0]
    assert dev.stats.events_recorded > 0 and dev.stats.events_waited > 0
    # every copy is an INPUT|OUTPUT leaf of the graph copy: gallocr never reuses its memory
    n_inputs = sum(sp.n_inputs for sp in sched.splits)
    copies = sched.graph.leafs[:4 * (n_inputs + len(sched.graph_inputs))]
    assert len(sched.graph_inputs) == 3                      # inp_embd, inp_pos, kq_mask
    assert all(t.flags & ggml.TensorFlag.INPUT and t.flags & ggml.TensorFlag.OUTPUT for t in copies)


# --- op offload --------------------------------------------------------------------------------

@pytest.mark.parametrize("n_tok,op_offload,offloaded", [(64, True, True), (8, True, False), (64, False, False)])
def test_op_offload_moves_big_batches_off_host_weights(n_tok, op_offload, offloaded):
    """Weights in host memory, a device that wants products of a batch >= 32 (offload_op):
    with op_offload those go to the device (their weights copied over), without it all stays."""
    dev, priv = _priv()
    spec = _spec("ffn", n_tok, weights=("CPU", "weights"))
    s, sched, _ = _setup(spec, extra={"PRIV": priv}, op_offload=op_offload)
    got = _compute(s, sched)
    on_priv = [n.name for n in s["gf"].nodes if ggml.backend_sched_get_tensor_backend(sched, n) is priv]
    if offloaded:
        assert {"up-0", "down-0", "up-1", "down-1"} <= set(on_priv)
        inputs = [t.name for sp in sched.splits for t in sp.inputs]
        assert {"ffn_up-0", "ffn_down-1"} <= set(inputs)              # the weights travel
        assert dev.stats.computes > 0
    else:
        assert on_priv == [] and sched.n_splits == 1 and dev.stats.computes == 0
    assert _nmse(got, _cpu_reference(spec)) <= 1e-7


# --- memory: reserve once, recompute without new buffers -----------------------------------

def _buffers(sched):
    return [b for b in sched.galloc.buffers if b is not None]


def test_recompute_of_the_same_shape_allocates_no_tensor_memory():
    dev, priv = _priv()
    spec = _spec("llama", 33, weights=sched_scenarios.half_layers(("CPU", "weights"), ("PRIV", "weights")))
    s, sched, backends = _setup(spec, extra={"PRIV": priv})
    by_name = dict(zip(spec["backends"], backends))
    assert ggml.backend_sched_reserve(sched, s["gf"])            # the measure graph
    sizes = [ggml.backend_sched_get_buffer_size(sched, b) for b in backends]
    bufs = _buffers(sched)
    assert sizes[0] > 0 and sizes[1] > 0
    graphs = []
    for _ in range(3):
        g = sched_scenarios.build(Lite(), spec)
        _place_weights(g, by_name)
        graphs.append(g)
    out = []
    for i, g in enumerate(graphs):
        ggml.backend_sched_reset(sched)
        if i == 2:
            tracemalloc.start()
        assert ggml.backend_sched_alloc_graph(sched, g["gf"])
        _fill_inputs(g)
        assert ggml.backend_sched_graph_compute(sched, g["gf"]) == Status.SUCCESS
        if i == 2:
            current, peak = tracemalloc.get_traced_memory()
            largest = max((tr.size for tr in tracemalloc.take_snapshot().traces), default=0)
            tracemalloc.stop()
        out.append(ggml.backend_tensor_get(g["out"]))
    assert [ggml.backend_sched_get_buffer_size(sched, b) for b in backends] == sizes
    assert all(a is b for a, b in zip(_buffers(sched), bufs)) and len(_buffers(sched)) == len(bufs)
    # the tensors' memory is the reserved buffers': what the recompute allocated is bookkeeping
    # (descriptors, lists, numpy views), no block as large as one of the graph's tensors
    biggest = max(ggml.nbytes(n) for n in graphs[2]["gf"].nodes)
    assert largest < biggest and peak - current < biggest, (largest, peak - current, biggest)
    assert np.array_equal(out[0], out[2])


# --- the graph is split once ---------------------------------------------------------------

def test_a_graph_split_with_copies_cannot_be_split_again():
    dev, priv = _priv()
    spec = _spec("llama", 8, weights=sched_scenarios.half_layers(("CPU", "weights"), ("PRIV", "weights")))
    s, sched, _ = _setup(spec, extra={"PRIV": priv})
    assert ggml.backend_sched_reserve(sched, s["gf"])
    with pytest.raises(GGMLError, match="split before.*PRIV#.*#0.*build the graph again"):
        ggml.backend_sched_alloc_graph(sched, s["gf"])


def test_a_graph_without_copies_can_be_computed_again():
    """BLAS and CPU share host memory: nothing is rewritten, so reuse is harmless (as in ggml)."""
    spec = SCENARIOS["llama-F32-64-cpu"]
    s, sched, _ = _setup(spec)
    first = _compute(s, sched)
    ggml.backend_sched_reset(sched)
    assert ggml.backend_sched_alloc_graph(sched, s["gf"])
    _fill_inputs(s)                     # gallocr may have reused the inputs' memory: set them again
    assert ggml.backend_sched_graph_compute(sched, s["gf"]) == Status.SUCCESS
    assert np.array_equal(ggml.backend_tensor_get(s["out"]), first)


# --- errors ------------------------------------------------------------------------------------

def test_the_last_backend_must_be_the_cpu():
    with pytest.raises(GGMLError, match="last backend must be a CPU device, BLAS is ACCEL"):
        ggml.backend_sched_new([backend_cpu_init(), backend_blas_init()], None, 2, 64, False, True)


def test_at_most_16_backends():
    cpus = [backend_cpu_init() for _ in range(17)]
    with pytest.raises(GGMLError, match="n_backends = 17.*GGML_SCHED_MAX_BACKENDS = 16"):
        ggml.backend_sched_new(cpus, None, 17, 64, False, True)


def test_a_buffer_type_the_backend_cannot_use():
    dev, priv = _priv()
    with pytest.raises(GGMLError, match="backend CPU does not support buffer type PRIV"):
        ggml.backend_sched_new([priv, backend_cpu_init()], [dev.buft, dev.buft], 2, 64, False, True)


def test_pre_allocated_tensor_on_a_device_that_cannot_run_its_op():
    """A node whose result already lives in device memory, an op the device lacks."""
    dev, priv = _priv(ops={ggml.Op.MUL_MAT})
    ctx = ggml.init(1 << 20, None, True)
    a = ggml.new_tensor_2d(ctx, ggml.Type.F32, 8, 4)
    y = ggml.set_name(ggml.rms_norm(ctx, a, 1e-5), "y")
    ggml.backend_alloc_ctx_tensors(ctx, priv)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, y)
    sched = ggml.backend_sched_new([priv, backend_cpu_init()], None, 2, 64, False, True)
    with pytest.raises(GGMLError, match=r"pre-allocated tensor \(y\) in a buffer \(PRIV\) that cannot run "
                                        r"the operation \(RMS_NORM\).*\[PRIV, CPU\]"):
        ggml.backend_sched_alloc_graph(sched, gf)


def test_no_backend_supports_the_node():
    ctx = ggml.init(1 << 20, None, True)
    w = ggml.new_tensor_2d(ctx, ggml.Type.Q8_0, 64, 64)
    x = ggml.new_tensor_2d(ctx, ggml.Type.F16, 64, 64)          # neither CPU nor BLAS takes F16 here
    y = ggml.set_name(ggml.mul_mat(ctx, w, x), "y")
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, y)
    sched = ggml.backend_sched_new([backend_blas_init(), backend_cpu_init()], None, 2, 64, False, True)
    with pytest.raises(GGMLError, match=r"no backend supports node 'y' \(op MUL_MAT.*\[BLAS, CPU\]"):
        ggml.backend_sched_alloc_graph(sched, gf)


def test_graph_larger_than_the_hash_set():
    s, _, backends = _setup(SCENARIOS["ffn-F32-8-cpu"])
    sched = ggml.backend_sched_new(backends, None, 2, 16, False, True)      # 17 slots
    n, m = s["gf"].n_nodes, s["gf"].n_leafs
    assert n + m > 17
    with pytest.raises(GGMLError, match=rf"hash_set.size >= graph->n_nodes \+ graph->n_leafs.*17 < {n} \+ {m}"):
        ggml.backend_sched_alloc_graph(sched, s["gf"])


def test_too_many_inputs_for_pipeline_parallelism():
    ctx = ggml.init(1 << 20, None, True)
    acc = None
    for i in range(31):
        t = ggml.new_tensor_1d(ctx, ggml.Type.F32, 4)
        ggml.set_input(t)
        acc = t if acc is None else ggml.add(ctx, acc, t)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, acc)
    sched = ggml.backend_sched_new([backend_cpu_init()], None, 1, 256, True, True)
    with pytest.raises(GGMLError, match="too many graph inputs.*number 31.*GGML_SCHED_MAX_SPLIT_INPUTS = 30"):
        ggml.backend_sched_alloc_graph(sched, gf)
    ggml.backend_sched_reset(sched)                 # and the scheduler is usable again
    ctx2 = ggml.init(1 << 20, None, True)
    t = ggml.new_tensor_1d(ctx2, ggml.Type.F32, 4)
    ggml.set_input(t)
    gf2 = ggml.new_graph(ctx2)
    ggml.build_forward_expand(gf2, ggml.scale(ctx2, t, 2.0))
    assert ggml.backend_sched_alloc_graph(sched, gf2)


def test_alloc_twice_without_reset():
    s, sched, _ = _setup(SCENARIOS["ffn-F32-8-cpu"])
    assert ggml.backend_sched_alloc_graph(sched, s["gf"])
    with pytest.raises(GGMLError, match="is_alloc.*call backend_sched_reset"):
        ggml.backend_sched_alloc_graph(sched, s["gf"])


def test_set_tensor_backend_of_a_foreign_backend():
    s, sched, _ = _setup(SCENARIOS["ffn-F32-8-cpu"])
    with pytest.raises(GGMLError, match="backend CPU is not one of the scheduler's"):
        ggml.backend_sched_set_tensor_backend(sched, s["gf"].nodes[0], backend_cpu_init())


# --- the oracle harness's graphs, the op on the device, its operands copied in --------------

try:
    import backend_ops_cases as B
    from test_backend_ops import _known as _known_failure
except ImportError:                               # pragma: no cover
    B = None

HARNESS = [c for i, c in enumerate(B.make_test_cases()) if i % 7 == 0] if B else []
_CPU1 = backend_cpu_init()
ggml.backend_cpu_set_n_threads(_CPU1, 1)     # the device computes on one thread too


def _harness_on_cpu(case):
    """The case on the CPU backend alone (its tensors in one CPU buffer), the same inputs."""
    built = B.build_case(case, no_alloc=True, sentinels=False)
    try:
        buf = ggml.backend_alloc_ctx_tensors(built.ctx, _CPU1)
        case.initialize_tensors(built, np.random.default_rng(B.case_seed(case)))
        assert ggml.backend_graph_compute(_CPU1, built.gf) == Status.SUCCESS
        out = B.tensor_values(built.out)
        ggml.backend_buffer_free(buf)
        return out
    finally:
        ggml.free(built.ctx)


@pytest.mark.skipif(B is None, reason="the oracle harness is not here")
@pytest.mark.parametrize("case", HARNESS, ids=[c.name() for c in HARNESS])
def test_oracle_harness_through_the_scheduler(case):
    """Each case's op pinned to the private device, its inputs INPUT tensors on the CPU: the
    scheduler copies them in; judged as the harness judges (an independent numpy reference,
    ggml's error limits). eval_built is not used: it reads out.src after the split rewrote it."""
    if _known_failure(case):
        pytest.skip(f"a known kernel failure: {_known_failure(case)}")
    dev, priv = _priv()
    sched = ggml.backend_sched_new([priv, backend_cpu_init()], None, 2, 256, False, False)
    built = B.build_case(case, no_alloc=True, sentinels=False)
    try:
        for leaf in built.gf.leafs:
            ggml.set_input(leaf)
        out = built.out
        if not ggml.backend_supports_op(priv, out):
            pytest.skip("the device declines this op")
        if out.view_src is not None:        # CPY writes into its destination, a host tensor
            pytest.skip("the op's result is a view of a host tensor: it cannot run on the device")
        srcs = list(out.src)            # the split rewrites out.src to the device's copies
        ggml.backend_sched_set_tensor_backend(sched, out, priv)
        assert ggml.backend_sched_alloc_graph(sched, built.gf)
        assert ggml.backend_sched_get_tensor_backend(sched, out) is priv
        if any(not t.data and t.view_src is None for t in built.ctx):
            pytest.skip("a tensor of the case is not in its graph (REPEAT's shape): nothing allocates it")
        case.initialize_tensors(built, np.random.default_rng(B.case_seed(case)))
        ref = case.reference([B.tensor_values(t) if t is not None else None for t in srcs], out)
        dev.stats.reset()
        assert ggml.backend_sched_graph_compute(sched, built.gf) == Status.SUCCESS
        got = B.tensor_values(out)
        verdict = B.compare(got, ref, case.max_nmse_err(), case.op)
        assert verdict.ok, f"{case.name()} through the scheduler: {verdict}"
        # the device runs the CPU's kernels: bit for bit what the CPU backend alone computes
        assert np.array_equal(got, _harness_on_cpu(case), equal_nan=True)
        inputs = [t for sp in sched.splits if sched.backends[sp.backend_id] is priv for t in sp.inputs]
        st = dev.stats                   # user inputs: blocking copies; views of them: queued
        assert inputs and st.set_calls + st.async_calls == len(inputs)
        assert st.set_bytes + st.async_bytes == sum(ggml.nbytes(t) for t in inputs)
    finally:
        ggml.free(built.ctx)


def test_a_full_split_starts_another_and_the_sum_is_right():
    """40 user inputs into ADDs on the device: 30 copies fill the first split, a second split
    takes the other 10 (GGML_SCHED_MAX_SPLIT_INPUTS), and the sum comes out right."""
    dev, priv = _priv()
    spec = dict(SCENARIOS["fan_in-F32-40-rpc_pinned"], backends=["PRIV", "CPU"])
    s, sched, _ = _setup(spec, extra={"PRIV": priv})
    assert ggml.backend_sched_alloc_graph(sched, s["gf"])
    assert [sp.n_inputs for sp in sched.splits] == [30, 10]
    xs = [np.full(64, i + 1, np.float32) for i in range(40)]
    for t, x in zip(s["inputs"], xs):
        ggml.backend_tensor_set(t, x)
    assert ggml.backend_sched_graph_compute(sched, s["gf"]) == Status.SUCCESS
    assert np.array_equal(ggml.backend_tensor_get(s["out"]).reshape(-1), np.full(64, 820, np.float32))
    assert dev.stats.set_calls == 40


def test_reserve_size_measures_without_allocating():
    spec = SCENARIOS["llama-F32-64-rpc_half"]
    s, sched, backends = _setup(spec, extra={"RPC": _rpc_stand_in()})
    sizes = ggml.backend_sched_reserve_size(sched, s["gf"])
    assert all(b is None for b in sched.galloc.buffers)
    s2, sched2, backends2 = _setup(spec, extra={"RPC": _rpc_stand_in()})
    assert ggml.backend_sched_reserve(sched2, s2["gf"])
    assert sizes == [ggml.backend_sched_get_buffer_size(sched2, b) for b in backends2]
    assert sizes == REF["scenarios"]["llama-F32-64-rpc_half"]["buffer_sizes"]     # real ggml's, after alloc
    ggml.backend_sched_free(sched2)
    assert all(b is None for b in sched2.galloc.buffers) and sched2.ctx is None


# --- the CPU stream's programs, by content (book/07c_backend_devices.ipynb) ---

def _scaled_sum(sched, s, x_data, op=None):
    """y = scale(x + x, s) (or op(x) when given) recorded in a new context, split and
    allocated by sched, computed with x = x_data: (y's values, the split graph)."""
    ctx = ggml.init(mem_size=16 * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
    x = ggml.new_tensor_2d(ctx, Type.F32, 8, 4)
    ggml.set_input(x)
    y = op(ctx, x) if op is not None else ggml.scale(ctx, ggml.add(ctx, x, x), s)
    ggml.set_output(y)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, y)
    ggml.backend_sched_reset(sched)
    assert ggml.backend_sched_alloc_graph(sched, gf)
    ggml.backend_tensor_set(x, x_data)
    assert ggml.backend_sched_graph_compute(sched, gf) == Status.SUCCESS
    return ggml.backend_tensor_get(y).reshape(4, 8), sched.splits[0].graph


def test_cpu_stream_reuses_a_program_by_content():
    """A graph recorded again with the same content (ops, parameters, shapes, addresses)
    runs the program of the first one; any difference in content is planned anew; every
    result is the graph's own."""
    cpu = backend_cpu_init()
    sched = ggml.backend_sched_new([cpu], None, 1, 64, False, True)
    rng = np.random.default_rng(0)
    a, b = (rng.standard_normal((4, 8)).astype(np.float32) for _ in range(2))
    y1, g1 = _scaled_sum(sched, 2.0, a)
    np.testing.assert_array_equal(y1, 4 * a)
    assert (cpu.programs.hits, cpu.programs.misses) == (0, 1)
    y2, g2 = _scaled_sum(sched, 2.0, b)         # same content, new graph, new values
    np.testing.assert_array_equal(y2, 4 * b)
    assert (cpu.programs.hits, cpu.programs.misses) == (1, 1)
    assert g2 is not g1 and _PREPARED[g2] is _PREPARED[g1]
    y3, _ = _scaled_sum(sched, 3.0, b)          # another scale: another content
    np.testing.assert_array_equal(y3, 6 * b)
    assert (cpu.programs.hits, cpu.programs.misses) == (1, 2)
    ggml.backend_cpu_set_n_threads(cpu, 2)      # the same graph on another thread count
    y4, _ = _scaled_sum(sched, 3.0, a)
    np.testing.assert_array_equal(y4, 6 * a)
    assert (cpu.programs.hits, cpu.programs.misses) == (1, 3)


def test_cpu_stream_keeps_only_compiled_programs():
    """A program with a task called back into Python holds its own graph's nodes: it is
    not kept for other graphs (each such graph is planned and prepared anew)."""
    cpu = backend_cpu_init()
    sched = ggml.backend_sched_new([cpu], None, 1, 64, False, True)
    x = np.linspace(-2, 2, 32, dtype=np.float32).reshape(4, 8)
    for _ in range(2):
        y, g = _scaled_sum(sched, 0.0, x, op=ggml.relu)
        np.testing.assert_array_equal(y, np.maximum(x, 0))
        assert _PREPARED[g].native.native_tasks() < len(_PREPARED[g].tasks)
    assert (cpu.programs.hits, cpu.programs.misses, len(cpu.programs.entries)) == (0, 2, 0)
