"""Tests of the backend chapter: buffers, tensor data access, alloc_ctx_tensors, the registry and
its loader (entry points, module files), and the BLAS backend against numpy."""
import itertools
import json
import logging
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import ggml_lite as ggml
import ggml_lite.backend as gb
import ggml_lite.backends.blas as blas_mod
from ggml_lite import GGMLError, Op, Type

sys.path.insert(0, str(Path(__file__).parent / "ggml_ref"))
import backend_scenarios  # noqa: E402


class LiteApi:
    """ggml_lite with the calling convention backend_scenarios.build expects."""
    Type = Type

    def __getattr__(self, name):
        return getattr(ggml, name)

    @staticmethod
    def init(mem_size, mem_buffer=None, no_alloc=False):
        return ggml.init(mem_size=mem_size, mem_buffer=mem_buffer, no_alloc=no_alloc)


# --- helpers ---------------------------------------------------------------------------------

def nctx(n=16):
    return ggml.init(mem_size=n * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)


def placed(*shapes, type=Type.F32):
    """A no_alloc context with 2-D tensors of the given shapes, placed in one CPU buffer."""
    ctx = nctx()
    ts = [ggml.set_name(ggml.new_tensor_2d(ctx, type, *s), f"t{i}") for i, s in enumerate(shapes)]
    buf = ggml.backend_alloc_ctx_tensors_from_buft(ctx, ggml.backend_cpu_buffer_type())
    return ctx, buf, ts


class DeviceBuffer(ggml.BackendBuffer):
    """A buffer whose memory Python cannot reach through an address (like a GPU's)."""
    next_base = itertools.count(1)

    def __init__(self, buft, size):
        super().__init__(buft, size)
        self.mem = np.zeros(size, np.uint8)
        self.base = next(self.next_base) << 32          # any aligned number: never dereferenced
        self.copies = 0

    def get_base(self):
        return self.base

    def set_tensor(self, tensor, data, offset, size):
        s = tensor.data - self.base + offset
        self.mem[s:s + size] = data[:size]

    def get_tensor(self, tensor, data, offset, size):
        s = tensor.data - self.base + offset
        data[:size] = self.mem[s:s + size]

    def memset_tensor(self, tensor, value, offset, size):
        s = tensor.data - self.base + offset
        self.mem[s:s + size] = value

    def clear(self, value):
        self.mem[:] = value


class DeviceBufferType(ggml.BackendBufferType):
    def __init__(self, max_size=ggml.backend_impl.SIZE_MAX, fail=False, name="DEV"):
        super().__init__()
        self.max_size, self.fail, self.name = max_size, fail, name

    def get_name(self):
        return self.name

    def alloc_buffer(self, size):
        if self.fail:
            raise MemoryError("no memory (test)")
        return DeviceBuffer(self, size)

    def get_alignment(self):
        return 64

    def get_max_size(self):
        return self.max_size


# --- buffers -----------------------------------------------------------------------------------

def test_cpu_buffer_base_alignment_and_clear():
    buf = ggml.backend_buft_alloc_buffer(ggml.backend_cpu_buffer_type(), 100)
    assert ggml.backend_buffer_get_base(buf) % ggml.backend_impl.TENSOR_ALIGNMENT == 0
    assert ggml.backend_buffer_get_size(buf) == 100 and ggml.backend_buffer_is_host(buf)
    ggml.backend_buffer_clear(buf, 7)
    assert (buf.host_array()[:100] == 7).all()
    with pytest.raises(GGMLError, match="not a byte"):
        ggml.backend_buffer_clear(buf, 256)
    ggml.backend_buffer_free(buf)
    with pytest.raises(GGMLError, match="was freed"):
        ggml.backend_buffer_get_base(buf)
    with pytest.raises(GGMLError, match="was freed"):
        ggml.backend_buffer_clear(buf, 0)


def test_zero_size_buffer_is_a_dummy():
    buf = ggml.backend_buft_alloc_buffer(ggml.backend_cpu_buffer_type(), 0)
    assert buf is not None and ggml.backend_buffer_get_base(buf) == 0
    ggml.backend_buffer_clear(buf, 1)          # nothing to clear, no error
    with pytest.raises(GGMLError):
        ggml.backend_buft_alloc_buffer(ggml.backend_cpu_buffer_type(), -1)


def test_alloc_failure_returns_none_and_logs(caplog):
    with caplog.at_level(logging.ERROR, logger="ggml_lite.backend"):
        assert ggml.backend_buft_alloc_buffer(DeviceBufferType(fail=True), 10) is None
    assert "failed to allocate" in caplog.text


def test_buffer_from_ptr_wraps_caller_memory():
    mem = np.zeros(256, np.uint8)
    mem = mem[(-mem.ctypes.data) % 32:][:128]
    buf = ggml.backend_cpu_buffer_from_ptr(mem, 128)
    assert ggml.backend_buffer_name(buf) == "CPU_Mapped"
    assert ggml.backend_buffer_get_base(buf) == mem.ctypes.data
    ctx = nctx()
    t = ggml.new_tensor_1d(ctx, Type.F32, 4)
    ggml.backend_tensor_alloc(buf, t, ggml.backend_buffer_get_base(buf) + 32)
    ggml.backend_tensor_set(t, np.arange(4, dtype=np.float32))
    assert (mem[32:48].view(np.float32) == np.arange(4)).all()        # written in place
    with pytest.raises(GGMLError, match="aligned"):
        ggml.backend_cpu_buffer_from_ptr(mem[1:], 16)
    with pytest.raises(GGMLError, match="holds"):
        ggml.backend_cpu_buffer_from_ptr(mem, 1000)
    with pytest.raises(GGMLError, match="writable, C-contiguous"):     # a copy would take the writes
        ggml.backend_cpu_buffer_from_ptr(mem.reshape(4, 32)[:, :16], 64)
    with pytest.raises(GGMLError, match="writable"):
        ggml.backend_cpu_buffer_from_ptr(bytes(128), 64)


def test_abstract_interfaces_refuse_missing_members():
    class Half(ggml.BackendBufferType):
        def get_name(self):
            return "HALF"
    with pytest.raises(TypeError):
        Half()


# --- placing tensors ---------------------------------------------------------------------------

REF = json.loads((Path(__file__).parent / "data" / "backend_ref.json").read_text())


def test_cpu_buffer_type_is_ggmls():
    buft = ggml.backend_cpu_buffer_type()
    got = {"name": ggml.backend_buft_name(buft), "alignment": ggml.backend_buft_get_alignment(buft),
           "max_size": ggml.backend_buft_get_max_size(buft), "is_host": ggml.backend_buft_is_host(buft)}
    assert got == REF["cpu_buffer_type"]


class MaxSizeCPU(type(ggml.backend_cpu_buffer_type())):
    """The CPU buffer type with a smaller max_size (as backend_ref.py patches ggml's)."""

    def __init__(self, max_size):
        super().__init__("CPU")
        self.max_size = max_size

    def get_max_size(self):
        return self.max_size


@pytest.mark.parametrize("name", backend_scenarios.SCENARIOS)
def test_alloc_ctx_tensors_places_like_ggml(name):
    """Buffer sizes and every tensor's buffer and offset, as ggml 0.15.3 placed them."""
    ref = REF["scenarios"][name]
    ctx, ts, max_size = backend_scenarios.build(LiteApi(), name)
    buft = ggml.backend_cpu_buffer_type() if max_size is None else MaxSizeCPU(max_size)
    assert ggml.backend_alloc_ctx_tensors_from_buft_size(ctx, buft) == ref["size_query"]
    buf = ggml.backend_alloc_ctx_tensors_from_buft(ctx, buft)
    assert (buf is not None) == ref["buffer"]
    if buf is None:
        return
    assert buf.size == ref["buffer_size"]
    parts = []
    for t in ts:
        if t.buffer not in parts:
            parts.append(t.buffer)
    assert [p.size for p in parts] == ref["part_sizes"]
    assert ggml.backend_buffer.backend_buffer_is_multi_buffer(buf) == (len(parts) > 1)
    got = [{"name": t.name, "buffer": parts.index(t.buffer),
            "offset": t.data - ggml.backend_buffer_get_base(t.buffer)} for t in ts]
    assert got == ref["tensors"]

def test_alloc_ctx_tensors_layout():
    ctx = nctx()
    a = ggml.new_tensor_2d(ctx, Type.F32, 4, 3)          # 48 bytes -> 64
    q = ggml.new_tensor_2d(ctx, Type.Q4_0, 64, 1)        # 36 -> 64
    v = ggml.view_1d(ctx, a, 4, a.nb[1])
    h = ggml.new_tensor_1d(ctx, Type.F16, 3)             # 6 -> 32
    assert ggml.backend_alloc_ctx_tensors_from_buft_size(ctx, ggml.backend_cpu_buffer_type()) == 160
    buf = ggml.backend_alloc_ctx_tensors_from_buft(ctx, ggml.backend_cpu_buffer_type())
    base = ggml.backend_buffer_get_base(buf)
    assert buf.size == 160
    assert [t.data - base for t in (a, q, v, h)] == [0, 64, 16, 128]
    assert all(t.buffer is buf for t in (a, q, v, h))
    assert ggml.backend_alloc_ctx_tensors_from_buft(ctx, ggml.backend_cpu_buffer_type()) is None


def test_alloc_ctx_tensors_view_of_tensor_placed_elsewhere():
    _, buf, (w,) = placed((8, 2))
    ctx2 = nctx()
    v = ggml.view_1d(ctx2, w, 8, w.nb[1])     # data known (w is placed), buffer not yet
    x = ggml.new_tensor_1d(ctx2, Type.F32, 2)
    buf2 = ggml.backend_alloc_ctx_tensors_from_buft(ctx2, ggml.backend_cpu_buffer_type())
    assert v.buffer is buf and v.data == w.data + w.nb[1]
    assert x.buffer is buf2


def test_alloc_ctx_tensors_needs_no_alloc_context():
    ctx = ggml.init(mem_size=4096)
    ggml.new_tensor_1d(ctx, Type.F32, 4)
    with pytest.raises(GGMLError, match="no_alloc"):
        ggml.backend_alloc_ctx_tensors_from_buft(ctx, ggml.backend_cpu_buffer_type())


def test_alloc_ctx_tensors_splits_at_max_size_into_a_multi_buffer():
    buft = DeviceBufferType(max_size=200)
    ctx = nctx()
    ts = [ggml.new_tensor_1d(ctx, Type.F32, 20) for _ in range(5)]   # 80 bytes -> 128 each
    buf = ggml.backend_alloc_ctx_tensors_from_buft(ctx, buft)
    assert ggml.backend_buffer.backend_buffer_is_multi_buffer(buf)
    assert [b.size for b in buf.buffers] == [128] * 5 and buf.size == 640
    assert [t.buffer for t in ts] == buf.buffers
    ggml.backend_buffer_set_usage(buf, ggml.BackendBufferUsage.WEIGHTS)
    assert all(b.usage == ggml.BackendBufferUsage.WEIGHTS for b in buf.buffers)
    ggml.backend_buffer_free(buf)
    assert all(b._freed for b in buf.buffers)
    with pytest.raises(GGMLError, match="freed"):
        ggml.backend_tensor_get(ts[0])


def test_alloc_ctx_tensors_failure_leaves_nothing_placed(caplog):
    ctx = nctx()
    ts = [ggml.new_tensor_1d(ctx, Type.F32, 4) for _ in range(3)]
    with caplog.at_level(logging.ERROR, logger="ggml_lite.backend"):
        assert ggml.backend_alloc_ctx_tensors_from_buft(ctx, DeviceBufferType(fail=True)) is None
    assert all(t.buffer is None and t.data == 0 for t in ts)


def test_tallocr_runs_out_of_space_with_numbers():
    buf = ggml.backend_buft_alloc_buffer(ggml.backend_cpu_buffer_type(), 64)
    ctx = nctx()
    a, b = ggml.new_tensor_1d(ctx, Type.F32, 10), ggml.set_name(ggml.new_tensor_1d(ctx, Type.F32, 10), "b")
    talloc = ggml.tallocr_new(buf)
    ggml.tallocr_alloc(talloc, a)
    assert talloc.offset == 64
    with pytest.raises(GGMLError, match=r"allocate b \(needed 64, available 0\)"):
        ggml.tallocr_alloc(talloc, b)
    assert b.buffer is None and b.data == 0 and talloc.offset == 64


def test_tensor_alloc_and_view_init_checks():
    _, buf, (w,) = placed((4, 2))
    ctx = nctx()
    t = ggml.set_name(ggml.new_tensor_1d(ctx, Type.F32, 4), "t")
    base = ggml.backend_buffer_get_base(buf)
    with pytest.raises(GGMLError, match="already in a buffer"):
        ggml.backend_tensor_alloc(buf, w, base)
    with pytest.raises(GGMLError, match=r"16 bytes at offset 24\) does not fit"):
        ggml.backend_tensor_alloc(buf, t, base + 24)
    with pytest.raises(GGMLError, match="does not fit"):
        ggml.backend_tensor_alloc(buf, t, base - 32)
    assert t.buffer is None and t.data == 0
    v = ggml.view_1d(ctx, t, 2, 0)
    with pytest.raises(GGMLError, match="is a view"):
        ggml.backend_tensor_alloc(buf, v, base)
    with pytest.raises(GGMLError, match="not allocated in a buffer"):
        ggml.backend_view_init(v)
    with pytest.raises(GGMLError, match="not a view"):
        ggml.backend_view_init(t)


# --- tensor data -------------------------------------------------------------------------------

@pytest.mark.parametrize("type,dtype", [(Type.F32, np.float32), (Type.F16, np.float16),
                                        (Type.I32, np.int32), (Type.I8, np.int8), (Type.BF16, np.uint16)])
def test_set_get_roundtrip_values_and_bytes(type, dtype):
    _, _, (t,) = placed((6, 5), type=type)
    v = (np.arange(30) % 17).astype(dtype).reshape(5, 6)
    ggml.backend_tensor_set(t, v)
    got = ggml.backend_tensor_get(t)
    assert got.dtype == dtype and got.shape == (1, 1, 5, 6) and (got[0, 0] == v).all()
    assert (t.numpy() == got).all()
    ggml.backend_tensor_set(t, v.tobytes())                   # raw bytes, the whole tensor
    assert ggml.backend_tensor_get(t, offset=0, size=ggml.nbytes(t)).tobytes() == v.tobytes()
    es = np.dtype(dtype).itemsize
    ggml.backend_tensor_set(t, np.zeros(2, dtype).tobytes(), offset=7 * es)   # partial raw write
    flat = ggml.backend_tensor_get(t).reshape(-1)
    assert (flat[7:9] == 0).all() and (flat[:7] == v.reshape(-1)[:7]).all()
    out = bytearray(3 * es)
    ggml.backend_tensor_get(t, out, offset=es, size=3 * es)
    assert bytes(out) == flat[1:4].tobytes()


def test_quantized_tensor_takes_block_bytes():
    _, _, (q,) = placed((64, 2), type=Type.Q8_0)
    x = np.linspace(-2, 2, 128, dtype=np.float32).reshape(2, 64)
    qb = ggml.quantize_chunk(Type.Q8_0, x)
    ggml.backend_tensor_set(q, qb)
    assert (ggml.backend_tensor_get(q)[0, 0] == qb).all()
    with pytest.raises(GGMLError, match="quantize_chunk"):
        ggml.backend_tensor_set(q, x)


def test_strided_views_go_through_strides_and_keep_gaps():
    _, _, (w,) = placed((4, 3))
    ggml.backend_tensor_set(w, np.arange(12, dtype=np.float32))
    ctx = nctx()
    wt = ggml.transpose(ctx, w)
    assert (ggml.backend_tensor_get(wt)[0, 0] == np.arange(12).reshape(3, 4).T).all()
    cols = ggml.view_2d(ctx, w, 2, 3, w.nb[1], 4)     # columns 1..2 of each row: gaps in between
    ggml.backend_tensor_set(cols, -np.ones((3, 2), np.float32))
    expect = np.arange(12, dtype=np.float32).reshape(3, 4)
    expect[:, 1:3] = -1
    assert (ggml.backend_tensor_get(w)[0, 0] == expect).all()
    p = ggml.permute(ctx, ggml.reshape_3d(ctx, w, 2, 2, 3), 1, 0, 2, 3)
    assert (ggml.backend_tensor_get(p) == np.swapaxes(expect.reshape(1, 3, 2, 2), 2, 3)).all()


@pytest.mark.parametrize("call,match", [
    (lambda t: ggml.backend_tensor_set(t, np.zeros(13, np.float32)), "13 elements"),
    (lambda t: ggml.backend_tensor_set(t, np.zeros(11, np.float32)), "11 elements"),
    (lambda t: ggml.backend_tensor_set(t, b"\0" * 47), "47 bytes, tensor 't0' has 48"),
    (lambda t: ggml.backend_tensor_set(t, b"\0" * 49), "49 bytes"),
    (lambda t: ggml.backend_tensor_set(t, b"\0" * 8, offset=44), r"write out of bounds.*44 \+ 8 > 48"),
    (lambda t: ggml.backend_tensor_set(t, b"\0" * 8, offset=-4), r"-4 \+ 8 > 48"),
    (lambda t: ggml.backend_tensor_set(t, b"\0" * 4, offset=0, size=8), "only 4 bytes"),
    (lambda t: ggml.backend_tensor_set(t, np.zeros((3, 4))), "float64"),
    (lambda t: ggml.backend_tensor_set(t, [1.0] * 12), "bytes-like"),
    (lambda t: ggml.backend_tensor_get(t, offset=40, size=16), r"read out of bounds.*40 \+ 16 > 48"),
    (lambda t: ggml.backend_tensor_get(t, offset=-1, size=1), "read out of bounds"),
    (lambda t: ggml.backend_tensor_get(t, bytearray(4), size=8), "room for only 4"),
    (lambda t: ggml.backend_tensor_get(t, b"\0" * 48), "writable"),
    (lambda t: ggml.backend_tensor_memset(t, 0, offset=40, size=9), "write out of bounds"),
    (lambda t: ggml.backend_tensor_memset(t, 300), "not a byte"),
])
def test_bad_sizes_and_offsets_raise_and_change_nothing(call, match):
    _, _, (t,) = placed((4, 3))
    ggml.backend_tensor_set(t, np.arange(12, dtype=np.float32))
    with pytest.raises(GGMLError, match=match):
        call(t)
    assert (ggml.backend_tensor_get(t).reshape(-1) == np.arange(12)).all()


def test_unallocated_tensors_raise():
    ctx = nctx()
    t = ggml.set_name(ggml.new_tensor_1d(ctx, Type.F32, 4), "u")
    for call in (lambda: ggml.backend_tensor_set(t, np.zeros(4, np.float32)),
                 lambda: ggml.backend_tensor_get(t),
                 lambda: ggml.backend_tensor_get(t, offset=0, size=4),
                 lambda: ggml.backend_tensor_memset(t, 0)):
        with pytest.raises(GGMLError, match="'u' has no buffer"):
            call()
    _, buf, _ = placed((4, 1))
    t.buffer = buf                                    # a buffer but no address: not allocated
    with pytest.raises(GGMLError, match="not allocated"):
        ggml.backend_tensor_get(t)
    pool = ggml.init(mem_size=1024)
    p = ggml.new_tensor_1d(pool, Type.F32, 4)         # data in a context's pool, no buffer
    with pytest.raises(GGMLError, match="tensor buffer not set"):
        ggml.backend_tensor_set(p, np.zeros(4, np.float32))


def test_zero_size_copies_check_the_buffer_first_like_ggml():
    # ggml_backend_tensor_set/_get assert "tensor buffer not set" before their size-0
    # return; ggml_backend_tensor_memset returns for size 0 before any check
    ctx = nctx()
    t = ggml.set_name(ggml.new_tensor_1d(ctx, Type.F32, 4), "z")   # no buffer
    with pytest.raises(GGMLError, match="'z' has no buffer"):
        ggml.backend_tensor_set(t, b"", offset=0, size=0)
    with pytest.raises(GGMLError, match="'z' has no buffer"):
        ggml.backend_tensor_get(t, bytearray(0), offset=0, size=0)
    with pytest.raises(GGMLError, match="'z' has no buffer"):
        ggml.backend_tensor_get(t, offset=0, size=0)
    ggml.backend_tensor_memset(t, 0, offset=0, size=0)
    _, buf, _ = placed((4, 1))
    t.buffer = buf                         # a buffer, but not allocated (data NULL)
    ggml.backend_tensor_set(t, b"", offset=0, size=0)   # the remaining asserts come later
    assert ggml.backend_tensor_get(t, offset=0, size=0).size == 0
    with pytest.raises(GGMLError, match="not allocated"):
        ggml.backend_tensor_set(t, b"\0" * 4, offset=0, size=4)


def test_memset_and_freed_buffer():
    _, buf, (t,) = placed((4, 2))
    ggml.backend_tensor_memset(t, 0x3F, offset=4, size=4)
    assert ggml.backend_tensor_get(t, offset=0, size=8).tolist() == [0, 0, 0, 0, 63, 63, 63, 63]
    ggml.backend_buffer_free(buf)
    with pytest.raises(GGMLError, match="freed"):
        t.numpy()
    with pytest.raises(GGMLError, match="freed"):
        ggml.backend_tensor_set(t, np.zeros(8, np.float32))


def test_copy_host_device_and_staged():
    _, _, (h1, h2) = placed((4, 3), (4, 3))
    dev = DeviceBufferType()
    ctx = nctx()
    d1, d2 = ggml.new_tensor_2d(ctx, Type.F32, 4, 3), ggml.new_tensor_2d(ctx, Type.F32, 4, 3)
    ggml.backend_alloc_ctx_tensors_from_buft(ctx, dev)
    v = np.arange(12, dtype=np.float32).reshape(3, 4)
    ggml.backend_tensor_set(h1, v)
    ggml.backend_tensor_copy(h1, h2)                      # host -> host
    ggml.backend_tensor_copy(h2, d1)                      # host -> device: set_tensor
    ggml.backend_tensor_copy(d1, d2)                      # device -> device: staged via the host
    ggml.backend_tensor_memset(h1, 0)
    ggml.backend_tensor_copy(d2, h1)                      # device -> host: get_tensor
    assert (ggml.backend_tensor_get(h1)[0, 0] == v).all() and (ggml.backend_tensor_get(d2)[0, 0] == v).all()
    with pytest.raises(GGMLError, match="without host access"):
        d1.numpy()


def test_copy_errors():
    _, _, (a, b, c) = placed((4, 3), (4, 3), (3, 4))
    with pytest.raises(GGMLError, match="different layouts"):
        ggml.backend_tensor_copy(a, c)
    ctx = nctx()
    u = ggml.new_tensor_2d(ctx, Type.F32, 4, 3)
    with pytest.raises(GGMLError, match="no buffer"):
        ggml.backend_tensor_copy(a, u)
    with pytest.raises(GGMLError, match="no buffer"):
        ggml.backend_tensor_copy(u, a)
    ggml.backend_tensor_copy(a, a)                      # the same tensor: nothing to do


def test_cpu_buffer_cpy_tensor_from_host_only():
    _, _, (a, b) = placed((4, 2), (4, 2))
    ggml.backend_tensor_set(a, np.ones((2, 4), np.float32))
    assert b.buffer.cpy_tensor(a, b) and (ggml.backend_tensor_get(b) == 1).all()
    ctx = nctx()
    d = ggml.new_tensor_2d(ctx, Type.F32, 4, 2)
    ggml.backend_alloc_ctx_tensors_from_buft(ctx, DeviceBufferType())
    assert not b.buffer.cpy_tensor(d, b)


# --- streams, async and events -----------------------------------------------------------------

class EventDevice(ggml.BackendDevice):
    def get_name(self):
        return "EV"

    def get_description(self):
        return "a device with events"

    def get_memory(self):
        return 1, 2

    def get_type(self):
        return ggml.BackendDevType.GPU

    def init_backend(self, params=None):
        return EventBackend(self)

    def get_buffer_type(self):
        return ggml.backend_cpu_buffer_type()

    def supports_op(self, op):
        return False

    def supports_buft(self, buft):
        return True

    def event_new(self):
        return ggml.BackendEvent(self, {"recorded": 0, "waited": 0})

    def event_synchronize(self, event):
        event.context["synced"] = True


class EventBackend(ggml.Backend):
    def __init__(self, device):
        super().__init__(b"event-backend-01", device)
        self.synced = 0

    def get_name(self):
        return "EV"

    def graph_compute(self, cgraph):
        return ggml.Status.SUCCESS

    def synchronize(self):
        self.synced += 1

    def event_record(self, event):
        event.context["recorded"] += 1

    def event_wait(self, event):
        event.context["waited"] += 1


def test_events_and_async_defaults():
    dev = EventDevice(None)
    be = ggml.backend_dev_init(dev)
    ev = ggml.backend_event_new(dev)
    ggml.backend_event_record(ev, be)
    ggml.backend_event_wait(be, ev)
    ggml.backend_event_synchronize(ev)
    assert ev.context == {"recorded": 1, "waited": 1, "synced": True}
    ggml.backend_event_free(ev)
    assert ggml.backend_event_new(None) is None
    assert ggml.backend_graph_compute(be, ggml.new_graph(nctx())) == ggml.Status.SUCCESS and be.synced == 1
    # the default async copies are blocking ones, with the same checks
    _, _, (a, b) = placed((4, 1), (4, 1))
    ggml.backend_tensor_set_async(be, a, np.arange(4, dtype=np.float32))
    out = np.zeros(4, np.float32)
    ggml.backend_tensor_get_async(be, a, out)
    assert (out == np.arange(4)).all()
    ggml.backend_tensor_copy_async(be, be, a, b)
    assert (ggml.backend_tensor_get(b).reshape(-1) == np.arange(4)).all() and be.synced == 3
    with pytest.raises(GGMLError, match="out of bounds"):
        ggml.backend_tensor_set_async(be, a, np.zeros(8, np.float32))


def test_backend_without_events_says_so():
    class Plain(ggml.Backend):
        def get_name(self):
            return "PLAIN"

        def graph_compute(self, cgraph):
            raise MemoryError("compute ran out of memory")
    be = Plain(b"plain-backend-01", EventDevice(None))
    with pytest.raises(GGMLError, match="no events"):
        ggml.backend_event_record(ggml.BackendEvent(be.device), be)
    with pytest.raises(MemoryError, match="ran out"):     # not a status: ggml lets bad_alloc out too
        ggml.backend_graph_compute(be, ggml.new_graph(nctx()))


# --- registry and loading ----------------------------------------------------------------------

GOOD_PLUGIN = '''
import ggml_lite as ggml

class Dev(ggml.BackendDevice):
    def get_name(self): return "{name}"
    def get_description(self): return "test plugin"
    def get_memory(self): return 0, 0
    def get_type(self): return ggml.BackendDevType.ACCEL
    def init_backend(self, params=None): return None
    def get_buffer_type(self): return ggml.backend_cpu_buffer_type()
    def supports_op(self, op): return False
    def supports_buft(self, buft): return ggml.backend_buft_is_host(buft)

class Reg(ggml.BackendReg):
    def __init__(self, api_version=ggml.backend_impl.BACKEND_API_VERSION):
        super().__init__(api_version)
        self.dev = Dev(self)
    def get_name(self): return "{name}"
    def get_device_count(self): return 1
    def get_device(self, i): return self.dev

REG = Reg({api})

def ggml_backend_init():
    return REG

def ggml_backend_score():
    return {score}
'''


def write_plugin_dist(root, dist, entries, modules):
    """A module per name in modules and a .dist-info declaring entries in group ggml_lite.backends."""
    for name, source in modules.items():
        (root / f"{name}.py").write_text(textwrap.dedent(source))
    info = root / f"{dist}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 0.1\n")
    lines = "\n".join(f"{k} = {v}" for k, v in entries.items())
    (info / "entry_points.txt").write_text(f"[ggml_lite.backends]\n{lines}\n")


@pytest.fixture
def clean_registry():
    before = [r for r, _ in gb._registry.backends]
    yield
    for r, _ in list(gb._registry.backends):
        if not any(r is b for b in before):
            ggml.backend_unload(r)


def test_load_all_registers_shipped_backends_once(clean_registry):
    ggml.backend_load_all()
    n = ggml.backend_reg_count()
    ggml.backend_load_all()
    assert ggml.backend_reg_count() == n
    assert ggml.backend_reg_by_name("blas") is ggml.backend_blas_reg()
    assert ggml.backend_dev_by_name("BlAs").get_type() == ggml.BackendDevType.ACCEL
    assert ggml.backend_dev_by_type(ggml.BackendDevType.ACCEL) is not None
    assert ggml.backend_init_by_name("no such device") is None
    assert ggml.backend_reg_by_name("no such reg") is None
    with pytest.raises(GGMLError, match="out of range"):
        ggml.backend_reg_get(n)
    with pytest.raises(GGMLError, match="out of range"):
        ggml.backend_dev_get(ggml.backend_dev_count())
    names = [ggml.backend_reg_name(ggml.backend_reg_get(i)) for i in range(n)]
    assert names.index("BLAS") < names.index("CPU") if "CPU" in names else True


def test_entry_point_plugins_good_failing_and_scoring_zero(tmp_path, monkeypatch, caplog, clean_registry):
    tag = tmp_path.name.replace("-", "_")
    good, broken, nogpu, noinit = (f"{p}_{tag}" for p in ("good", "broken", "nogpu", "noinit"))
    write_plugin_dist(tmp_path, f"plugins_{tag}",
                      {"good": good, "broken": broken, "nogpu": nogpu, "noinit": noinit},
                      {good: GOOD_PLUGIN.format(name="GOODDEV", api="", score=5),
                       broken: "import a_module_that_does_not_exist_here\n",
                       nogpu: GOOD_PLUGIN.format(name="NOGPU", api="", score=0),
                       noinit: "X = 1\n"})
    monkeypatch.syspath_prepend(str(tmp_path))
    with caplog.at_level(logging.DEBUG, logger="ggml_lite.backend"):
        ggml.backend_load_all()
    assert ggml.backend_reg_by_name("GOODDEV") is not None
    assert ggml.backend_dev_by_name("gooddev").reg is ggml.backend_reg_by_name("GOODDEV")
    assert ggml.backend_reg_by_name("NOGPU") is None
    assert ggml.backend_reg_by_name("BLAS") is not None        # the rest still loaded
    text = caplog.text
    assert f"broken = {broken}: import failed: ModuleNotFoundError" in text
    assert f"nogpu = {nogpu} is not supported on this system (ggml_backend_score = 0)" in text
    assert f"failed to find ggml_backend_init in entry point noinit = {noinit}" in text
    assert all(r.levelno <= logging.INFO for r in caplog.records)   # silent: nothing louder


def test_entry_point_naming_the_init_function(tmp_path, monkeypatch, clean_registry):
    tag = tmp_path.name.replace("-", "_")
    mod = f"fnplugin_{tag}"
    write_plugin_dist(tmp_path, f"fn_{tag}", {"fn": f"{mod}:ggml_backend_init"},
                      {mod: GOOD_PLUGIN.format(name="FNDEV", api="", score=1)})
    monkeypatch.syspath_prepend(str(tmp_path))
    ggml.backend_load_all()
    assert ggml.backend_reg_by_name("FNDEV") is not None


def test_backend_load_from_file(tmp_path, caplog, clean_registry):
    good = tmp_path / "filedev.py"
    good.write_text(GOOD_PLUGIN.format(name="FILEDEV", api="", score=1))
    reg = ggml.backend_load(good)
    assert reg is not None and ggml.backend_reg_by_name("filedev") is reg
    assert ggml.backend_load(good) is reg and ggml.backend_reg_count() == len(gb._registry.backends)
    old = tmp_path / "olddev.py"
    old.write_text(GOOD_PLUGIN.format(name="OLDDEV", api="api_version=1", score=1))
    zero = tmp_path / "zerodev.py"
    zero.write_text(GOOD_PLUGIN.format(name="ZERODEV", api="", score=0))
    with caplog.at_level(logging.INFO, logger="ggml_lite.backend"):
        assert ggml.backend_load(tmp_path / "missing.py") is None
        assert ggml.backend_load(old) is None
        assert ggml.backend_load(zero) is None
    assert "failed to load" in caplog.text
    assert "incompatible API version (backend: 1, current: 2)" in caplog.text
    assert "is not supported on this system" in caplog.text
    ggml.backend_unload(reg)
    assert ggml.backend_reg_by_name("FILEDEV") is None and ggml.backend_dev_by_name("FILEDEV") is None


def test_env_path_is_loaded_by_load_all(tmp_path, monkeypatch, clean_registry):
    f = tmp_path / "envdev.py"
    f.write_text(GOOD_PLUGIN.format(name="ENVDEV", api="", score=1))
    monkeypatch.setenv("GGML_LITE_BACKEND_PATH", str(f))
    ggml.backend_load_all()
    assert ggml.backend_reg_by_name("ENVDEV") is not None


def test_init_best_prefers_gpu(clean_registry):
    # the registry may hold GPU devices registered by earlier tests (an RPC server's device):
    # init_best takes the first GPU in registry order, so this test makes its device the only one
    saved = list(gb._registry.devices)
    gb._registry.devices[:] = [d for d in saved if d.get_type() != ggml.BackendDevType.GPU]
    dev = EventDevice(None)                                  # type GPU
    ggml.backend_device_register(dev)
    try:
        assert ggml.backend_init_best().device is dev
    finally:
        gb._registry.devices[:] = saved


# --- BLAS --------------------------------------------------------------------------------------

def nmse(out, ref):
    ref = np.asarray(ref, np.float64)
    return float(((np.asarray(out, np.float64) - ref) ** 2).sum() / (ref ** 2).sum())


def mul_mat_case(wtype, K, M, N, w_batch=(1, 1), x_batch=(1, 1), seed=0):
    """a: weights (K, M) of wtype, batches w_batch; b: F32 (K, N), batches x_batch; c = mul_mat(a, b)."""
    rng = np.random.default_rng(seed)
    ctx = nctx()
    a = ggml.set_name(ggml.new_tensor_4d(ctx, wtype, K, M, *w_batch), "a")
    b = ggml.set_name(ggml.new_tensor_4d(ctx, Type.F32, K, N, *x_batch), "b")
    c = ggml.mul_mat(ctx, a, b)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, c)
    ggml.backend_alloc_ctx_tensors_from_buft(ctx, ggml.backend_cpu_buffer_type())
    wf = rng.uniform(-1, 1, (w_batch[1], w_batch[0], M, K)).astype(np.float32)
    xf = rng.uniform(-1, 1, (x_batch[1], x_batch[0], N, K)).astype(np.float32)
    if wtype == Type.F32:
        ggml.backend_tensor_set(a, wf)
        wref = wf
    else:
        qb = ggml.quantize_chunk(wtype, wf.reshape(-1, K))
        ggml.backend_tensor_set(a, qb.reshape(-1))
        wref = ggml.types.dequantize_rows(wtype, qb, K).reshape(wf.shape)
    ggml.backend_tensor_set(b, xf)
    r2, r3 = x_batch[0] // w_batch[0], x_batch[1] // w_batch[1]
    wrep = np.repeat(np.repeat(wref.astype(np.float64), r2, axis=1), r3, axis=0)
    ref = xf.astype(np.float64) @ np.swapaxes(wrep, -1, -2)
    return ctx, gf, c, ref


BLAS_TYPES = [Type.F32, Type.F16, Type.BF16, Type.Q4_0, Type.Q4_1, Type.Q8_0, Type.Q4_K, Type.Q6_K]


@pytest.mark.parametrize("wtype", BLAS_TYPES)
@pytest.mark.parametrize("batches", [((1, 1), (1, 1)), ((2, 1), (4, 3)), ((1, 2), (3, 2))])
def test_blas_mul_mat_matches_numpy(wtype, batches):
    K = 256 if wtype in (Type.Q4_K, Type.Q6_K) else 64
    ctx, gf, c, ref = mul_mat_case(wtype, K, 40, 33, *batches)
    be = ggml.backend_blas_init()
    assert ggml.backend_supports_op(be, c)
    assert ggml.backend_graph_compute(be, gf) == ggml.Status.SUCCESS
    got = ggml.backend_tensor_get(c)
    assert got.shape == ref.shape
    assert nmse(got, ref) < 1e-10        # the same F32 weights, only summation order differs


def test_blas_converts_each_weight_once_per_compute(monkeypatch):
    ctx = nctx()
    a = ggml.new_tensor_2d(ctx, Type.Q8_0, 64, 32)
    x1 = ggml.new_tensor_2d(ctx, Type.F32, 64, 32)
    x2 = ggml.new_tensor_2d(ctx, Type.F32, 64, 32)
    y = ggml.add(ctx, ggml.mul_mat(ctx, a, x1), ggml.mul_mat(ctx, a, x2))
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, y)
    ggml.backend_alloc_ctx_tensors_from_buft(ctx, ggml.backend_cpu_buffer_type())
    calls = []
    real = blas_mod.dequantize_rows
    monkeypatch.setattr(blas_mod, "dequantize_rows", lambda *a, **k: calls.append(1) or real(*a, **k))
    be = ggml.backend_blas_init()
    sub = ggml.graph.graph_view(gf, 0, 2)                   # the two products (BLAS's part of the graph)
    assert [n.op for n in sub.nodes] == [Op.MUL_MAT, Op.MUL_MAT]
    ggml.backend_graph_compute(be, sub)
    assert len(calls) == 1
    ggml.backend_graph_compute(be, sub)
    assert len(calls) == 2                            # once per compute: weights may have changed


def blas_candidates():
    """(label, builder) of nodes: mul_mat in many variants and other ops."""
    def mm(wtype, K, M, N, strided_a=False, transposed_b=False, x_type=Type.F32):
        def build(ctx):
            a = ggml.new_tensor_2d(ctx, wtype, K, M)
            if strided_a:                             # rows with gaps: not contiguous
                big = ggml.new_tensor_2d(ctx, wtype, 2 * K, M)
                a = ggml.view_2d(ctx, big, K, M, big.nb[1], 0)
            b = ggml.new_tensor_2d(ctx, x_type, K, N)
            if transposed_b:
                b = ggml.transpose(ctx, ggml.new_tensor_2d(ctx, x_type, N, K))
            return ggml.mul_mat(ctx, a, b)
        return build

    def other(fn):
        def build(ctx):
            a = ggml.new_tensor_2d(ctx, Type.F32, 64, 64)
            return fn(ctx, a, ggml.new_tensor_2d(ctx, Type.F32, 64, 64))
        return build
    cands = [(f"mul_mat {t.name} 64x40x33", mm(t, 256 if t in (Type.Q4_K, Type.Q6_K) else 64, 40, 33))
             for t in BLAS_TYPES]
    cands += [("mul_mat F32 small (31x33)", mm(Type.F32, 64, 31, 33)),
              ("mul_mat F32 matvec", mm(Type.F32, 64, 64, 1)),
              ("mul_mat F32 strided a", mm(Type.F32, 64, 40, 40, strided_a=True)),
              ("mul_mat F32 transposed b", mm(Type.F32, 64, 40, 40, transposed_b=True)),
              ("mul_mat F16 x F16 activations", mm(Type.F16, 64, 40, 40, x_type=Type.F16)),
              ("add", other(ggml.add)), ("mul", other(ggml.mul)), ("sub", other(ggml.sub)),
              ("scale", other(lambda ctx, a, b: ggml.scale(ctx, a, 2.0))),
              ("soft_max", other(lambda ctx, a, b: ggml.soft_max(ctx, a))),
              ("rms_norm", other(lambda ctx, a, b: ggml.rms_norm(ctx, a, 1e-6))),
              ("cpy", other(ggml.cpy)), ("silu", other(lambda ctx, a, b: ggml.silu(ctx, a))),
              ("cont of transpose", other(lambda ctx, a, b: ggml.cont(ctx, ggml.transpose(ctx, a))))]
    return cands


@pytest.mark.parametrize("label,build", blas_candidates(), ids=[c[0] for c in blas_candidates()])
def test_blas_claims_exactly_what_it_computes(label, build):
    ctx = nctx(32)
    node = build(ctx)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, node)
    ggml.backend_alloc_ctx_tensors_from_buft(ctx, ggml.backend_cpu_buffer_type())
    rng = np.random.default_rng(1)
    for leaf in gf.leafs:
        if leaf.type == Type.BF16:
            ggml.backend_tensor_set(leaf, ggml.half.fp32_to_bf16_array(
                rng.uniform(-1, 1, leaf.numpy().size).astype(np.float32)))
        elif ggml.is_quantized(leaf.type):
            ggml.backend_tensor_set(leaf, ggml.quantize_chunk(
                leaf.type, rng.uniform(-1, 1, (ggml.nrows(leaf), leaf.ne[0])).astype(np.float32)).reshape(-1))
        else:
            ggml.backend_tensor_set(leaf, rng.uniform(-1, 1, leaf.numpy().size).astype(leaf.numpy().dtype))
    be = ggml.backend_blas_init()
    claims = ggml.backend_supports_op(be, node)
    expect = label.startswith("mul_mat") and not any(w in label for w in ("small", "matvec", "strided", "transposed", "F16 x F16"))
    assert claims == expect
    if not claims:
        with pytest.raises(GGMLError, match="unsupported node"):
            ggml.backend_graph_compute(be, gf)
        return
    assert ggml.backend_graph_compute(be, gf) == ggml.Status.SUCCESS
    a, b = node.src[0], node.src[1]
    af = (ggml.types.dequantize_rows(a.type, ggml.backend_tensor_get(a).view(np.uint8).reshape(ggml.nrows(a), -1), a.ne[0])
          if a.type != Type.F32 else ggml.backend_tensor_get(a)[0, 0])
    ref = ggml.backend_tensor_get(b)[0, 0].astype(np.float64) @ af.astype(np.float64).T
    assert nmse(ggml.backend_tensor_get(node)[0, 0], ref) < 1e-10


def test_blas_rule_ignores_where_operands_live():
    """ggml's BLAS supports_op does not look at buffers; supports_buft keeps device memory away."""
    ctx = nctx()
    a = ggml.new_tensor_2d(ctx, Type.F32, 64, 64)
    x = ggml.new_tensor_2d(ctx, Type.F32, 64, 64)
    c = ggml.mul_mat(ctx, a, x)
    ggml.backend_alloc_ctx_tensors_from_buft(ctx, DeviceBufferType())
    dev = ggml.backend_blas_reg().get_device(0)
    assert ggml.backend_dev_supports_op(dev, c)
    assert not ggml.backend_dev_supports_buft(dev, DeviceBufferType())


BLAS_REF = json.loads((Path(__file__).parent / "data" / "blas_ref.json").read_text())
import blas_ref  # noqa: E402


def out_prod(ctx, a, b):
    """An OUT_PROD node as ggml_out_prod makes it (ggml_lite has no constructor for it)."""
    assert a.ne[1] == b.ne[1] and b.ne[2] % a.ne[2] == 0 and b.ne[3] % a.ne[3] == 0
    t = ggml.new_tensor_4d(ctx, Type.F32, a.ne[0], b.ne[0], b.ne[2], b.ne[3])
    t.op, t.src[0], t.src[1] = Op.OUT_PROD, a, b
    return t


@pytest.mark.parametrize("ref", BLAS_REF["cases"], ids=[c["id"] for c in BLAS_REF["cases"]])
def test_blas_supports_op_equals_ggml_blas(ref):
    """ggml 0.15.3's BLAS device (tests/ggml_ref/blas_ref.py) and ggml_lite's on the same node."""
    ctx, node = blas_ref.build(LiteApi(), ref["case"], out_prod)
    assert ggml.backend_dev_supports_op(ggml.backend_blas_reg().get_device(0), node) == ref["supports_op"]


def test_blas_fixture_covers_both_answers_at_each_boundary():
    got = {c["id"]: c["supports_op"] for c in BLAS_REF["cases"]}
    base = "MUL_MAT-F32[{},{},1,1]conti-F32[{},{},1,1]conti"
    for K, M, N in ((64, 64, 31), (64, 31, 64), (31, 64, 64)):      # one size under 32: no
        assert got[base.format(K, M, K, N)] is False
    for K, M, N in ((32, 32, 32), (33, 64, 33), (64, 64, 64)):
        assert got[base.format(K, M, K, N)] is True
    assert any(v for k, v in got.items() if k.startswith("OUT_PROD"))
    assert any(not v for k, v in got.items() if k.startswith("OUT_PROD"))


@pytest.mark.parametrize("transposed", [False, True])
def test_blas_out_prod_matches_numpy(transposed):
    ctx = nctx()
    a = ggml.new_tensor_2d(ctx, Type.F32, 24, 40)                    # (k=40 rows of n=24)
    b = (ggml.transpose(ctx, ggml.new_tensor_2d(ctx, Type.F32, 40, 16)) if transposed
         else ggml.new_tensor_2d(ctx, Type.F32, 16, 40))            # (k=40 rows of m=16)
    c = out_prod(ctx, a, b)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, c)
    ggml.backend_alloc_ctx_tensors_from_buft(ctx, ggml.backend_cpu_buffer_type())
    rng = np.random.default_rng(5)
    src_b = b.view_src if transposed else b
    ggml.backend_tensor_set(a, rng.uniform(-1, 1, (40, 24)).astype(np.float32))
    ggml.backend_tensor_set(src_b, rng.uniform(-1, 1, ggml.backend_tensor_get(src_b).shape).astype(np.float32))
    be = ggml.backend_blas_init()
    assert ggml.backend_supports_op(be, c)
    assert ggml.backend_graph_compute(be, gf) == ggml.Status.SUCCESS
    A = ggml.backend_tensor_get(a)[0, 0].astype(np.float64)
    B = b.numpy()[0, 0].astype(np.float64)                          # (k, m) through b's strides
    ref = np.einsum("km,kn->mn", B, A)
    assert nmse(ggml.backend_tensor_get(c)[0, 0], ref) < 1e-10


def test_blas_refuses_before_computing_anything():
    """A graph with a claimed product first and an unclaimed one after: nothing is written."""
    ctx = nctx()
    W = ggml.new_tensor_2d(ctx, Type.F32, 64, 64)
    x = ggml.new_tensor_2d(ctx, Type.F32, 64, 64)
    big = ggml.mul_mat(ctx, W, x)
    small = ggml.mul_mat(ctx, ggml.new_tensor_2d(ctx, Type.F32, 64, 64), ggml.new_tensor_2d(ctx, Type.F32, 64, 1))
    ggml.set_name(small, "matvec")
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, big)
    ggml.build_forward_expand(gf, small)
    ggml.backend_alloc_ctx_tensors_from_buft(ctx, ggml.backend_cpu_buffer_type())
    ggml.backend_tensor_set(W, np.ones((64, 64), np.float32))
    ggml.backend_tensor_set(x, np.ones((64, 64), np.float32))
    ggml.backend_tensor_memset(big, 0xAB)
    with pytest.raises(GGMLError, match=r"'matvec' \(MUL_MAT, f32 ne=\[64, 1, 1, 1\]"):
        ggml.backend_graph_compute(ggml.backend_blas_init(), gf)
    assert (ggml.backend_tensor_get(big).view(np.uint8) == 0xAB).all()


def test_blas_device_reg_and_guid():
    reg = ggml.backend_blas_reg()
    assert reg is ggml.backend_blas_reg() and ggml.backend_reg_dev_count(reg) == 1
    dev = ggml.backend_reg_dev_get(reg, 0)
    props = ggml.backend_dev_get_props(dev)
    assert (props.name, props.type, props.caps.buffer_from_host_ptr) == ("BLAS", ggml.BackendDevType.ACCEL, True)
    assert ggml.backend_dev_buffer_type(dev) is ggml.backend_cpu_buffer_type()
    assert ggml.backend_dev_supports_buft(dev, ggml.backend_cpu_buffer_type())
    assert not ggml.backend_dev_supports_buft(dev, DeviceBufferType())
    be = ggml.backend_dev_init(dev)
    assert ggml.backend_is_blas(be) and ggml.backend_name(be) == "BLAS"
    set_n = ggml.backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads")
    set_n(be, 3)
    assert be.n_threads == 3
    assert ggml.backend_reg_get_proc_address(reg, "nothing") is None
    assert ggml.backend_event_new(dev) is None
    with pytest.raises(GGMLError, match="out of range"):
        ggml.backend_reg_dev_get(reg, 1)
    with pytest.raises(GGMLError, match="not a BLAS backend"):
        ggml.backend_blas_set_n_threads(EventBackend(None), 2)
    assert blas_mod.ggml_backend_score() == 1 and blas_mod.ggml_backend_init() is reg


# --- the CPU backend ---------------------------------------------------------------------------

def seed_graph():
    """f = a·x² + b in a no_alloc context: (ctx, gf, a, x, b, f)."""
    ctx = nctx()
    a, x, b = (ggml.set_name(ggml.new_tensor_1d(ctx, Type.F32, 3), n) for n in "axb")
    f = ggml.add(ctx, ggml.mul(ctx, a, ggml.mul(ctx, x, x)), b)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, f)
    return ctx, gf, a, x, b, f


def test_cpu_backend_computes_the_seed_example():
    cpu = ggml.backend_cpu_init()
    ctx, gf, a, x, b, f = seed_graph()
    ggml.backend_alloc_ctx_tensors(ctx, cpu)
    ggml.backend_tensor_set(a, np.array([1, 2, 3], np.float32))
    ggml.backend_tensor_set(b, np.array([0.5, 0.5, 0.5], np.float32))
    for xv in (2.0, 3.0, 4.0):
        ggml.backend_tensor_set(x, np.full(3, xv, np.float32))
        assert ggml.backend_graph_compute(cpu, gf) == ggml.Status.SUCCESS
        assert (ggml.backend_tensor_get(f).reshape(-1) == np.array([1, 2, 3]) * xv * xv + 0.5).all()
    ggml.backend_free(cpu)


def quant_graph(K=256, M=64, N=4):
    ctx = nctx()
    W = ggml.new_tensor_2d(ctx, Type.Q4_0, K, M)
    v = ggml.new_tensor_2d(ctx, Type.F32, K, N)
    y = ggml.mul_mat(ctx, W, v)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, y)
    buf = ggml.backend_alloc_ctx_tensors_from_buft(ctx, ggml.backend_cpu_buffer_type())
    rng = np.random.default_rng(0)
    wf = rng.uniform(-1, 1, (M, K)).astype(np.float32)
    ggml.backend_tensor_set(W, ggml.quantize_chunk(Type.Q4_0, wf).reshape(-1))
    ggml.backend_tensor_set(v, rng.uniform(-1, 1, (N, K)).astype(np.float32))
    return gf, y, buf


def test_cpu_work_buffer_grows_and_is_reused():
    cpu = ggml.backend_cpu_init()
    small, _, _ = quant_graph(N=2)
    big, _, _ = quant_graph(N=16)
    need_small = ggml.graph_plan(small, cpu.n_threads).work_size
    need_big = ggml.graph_plan(big, cpu.n_threads).work_size
    assert 0 < need_small < need_big
    ggml.backend_graph_compute(cpu, small)
    assert cpu.work_size == need_small
    work = cpu.work_data
    ggml.backend_graph_compute(cpu, small)
    assert cpu.work_data is work                       # reused, not reallocated
    ggml.backend_graph_compute(cpu, big)
    assert cpu.work_size == need_big and cpu.work_data is not work
    work = cpu.work_data
    ggml.backend_graph_compute(cpu, small)             # smaller again: the big one is kept
    assert cpu.work_data is work


@pytest.mark.parametrize("n_threads", [1, 2, 3, 4])
def test_cpu_threads_give_the_same_result(n_threads):
    gf, y, _ = quant_graph(N=8)
    ref_be = ggml.backend_cpu_init()
    ggml.backend_cpu_set_n_threads(ref_be, 1)
    ggml.backend_graph_compute(ref_be, gf)
    ref = ggml.backend_tensor_get(y)
    cpu = ggml.backend_cpu_init()
    ggml.backend_cpu_set_n_threads(cpu, n_threads)
    ggml.backend_graph_compute(cpu, gf)
    assert np.array_equal(ggml.backend_tensor_get(y), ref)


def test_cpu_abort_callback():
    cpu = ggml.backend_cpu_init()
    ctx, gf, a, x, b, f = seed_graph()
    ggml.backend_alloc_ctx_tensors(ctx, cpu)
    ggml.backend_tensor_set(f, np.zeros(3, np.float32))
    seen = []
    ggml.backend_cpu_set_abort_callback(cpu, lambda data: seen.append(data) or True, "data")
    assert ggml.backend_graph_compute(cpu, gf) == ggml.Status.ABORTED
    assert seen == ["data"]
    assert (ggml.backend_tensor_get(f) == 0).all()     # stopped before the last node
    ggml.backend_cpu_set_abort_callback(cpu, lambda data: False)
    assert ggml.backend_graph_compute(cpu, gf) == ggml.Status.SUCCESS
    ggml.backend_cpu_set_abort_callback(cpu, None)
    with pytest.raises(GGMLError, match="ggml_backend_is_cpu"):
        ggml.backend_cpu_set_abort_callback(ggml.backend_blas_init(), None)


def test_cpu_device_reg_and_proc_addresses():
    reg = ggml.backend_cpu_reg()
    assert reg is ggml.backend_cpu_reg() and ggml.backend_reg_name(reg) == "CPU"
    dev = ggml.backend_reg_dev_get(reg, 0)
    props = ggml.backend_dev_get_props(dev)
    assert (props.name, props.type) == ("CPU", ggml.BackendDevType.CPU)
    assert props.caps == ggml.BackendDevCaps(async_=False, host_buffer=False,
                                             buffer_from_host_ptr=True, events=False)
    assert props.memory_total > 0 and props.memory_free == props.memory_total
    assert ggml.backend_dev_buffer_type(dev) is ggml.backend_cpu_buffer_type()
    cpu = ggml.backend_dev_init(dev)
    assert ggml.backend_is_cpu(cpu) and not ggml.backend_is_blas(cpu)
    assert not ggml.backend_is_cpu(ggml.backend_blas_init()) and not ggml.backend_is_cpu(None)
    ggml.backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads")(cpu, 3)
    assert cpu.n_threads == 3
    assert ggml.backend_reg_get_proc_address(reg, "ggml_backend_set_abort_callback") is ggml.backend_cpu_set_abort_callback
    assert ggml.backend_event_new(dev) is None
    mem = np.zeros(64, np.uint8)
    mem = mem[(-mem.ctypes.data) % 32:][:32]
    assert ggml.backend_buffer_name(ggml.backend_dev_buffer_from_host_ptr(dev, mem, 32, 32)) == "CPU_Mapped"


def test_cpu_supports_op():
    dev = ggml.backend_cpu_reg().get_device(0)
    ctx = nctx(32)
    q = ggml.new_tensor_2d(ctx, Type.Q4_0, 64, 4)
    h = ggml.new_tensor_2d(ctx, Type.F16, 64, 4)
    x = ggml.new_tensor_2d(ctx, Type.F32, 64, 2)
    xh = ggml.new_tensor_2d(ctx, Type.F16, 64, 2)
    x8 = ggml.new_tensor_2d(ctx, Type.Q8_0, 64, 2)
    assert ggml.backend_dev_supports_op(dev, ggml.mul_mat(ctx, q, x))
    assert not ggml.backend_dev_supports_op(dev, ggml.mul_mat(ctx, q, x8))    # Q8_0 activations: no kernel
    assert not ggml.backend_dev_supports_op(dev, ggml.mul_mat(ctx, q, xh))    # F16 activations: no
    assert ggml.backend_dev_supports_op(dev, ggml.mul_mat(ctx, h, xh))        # F16 · F16
    assert ggml.backend_dev_supports_op(dev, ggml.transpose(ctx, q))
    assert ggml.backend_dev_supports_op(dev, ggml.add(ctx, x, x))
    dctx = nctx()
    d = ggml.new_tensor_2d(dctx, Type.F32, 64, 2)
    ggml.backend_alloc_ctx_tensors_from_buft(dctx, DeviceBufferType())
    assert not ggml.backend_dev_supports_op(dev, ggml.add(ctx, d, x))         # non-host operand
    assert ggml.backend_dev_supports_buft(dev, ggml.backend_cpu_buffer_type())
    assert not ggml.backend_dev_supports_buft(dev, DeviceBufferType())


def test_cpu_and_blas_agree_on_a_shared_graph():
    """One graph, tensors in one CPU buffer: BLAS computes the products, CPU the rest (by hand,
    as the scheduler will): the result equals the CPU alone within mul_mat's NMSE."""
    ctx = nctx()
    W = ggml.new_tensor_2d(ctx, Type.F32, 64, 48)
    x = ggml.new_tensor_2d(ctx, Type.F32, 64, 40)
    y = ggml.silu(ctx, ggml.mul_mat(ctx, W, x))
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, y)
    ggml.backend_alloc_ctx_tensors_from_buft(ctx, ggml.backend_cpu_buffer_type())
    rng = np.random.default_rng(3)
    ggml.backend_tensor_set(W, rng.uniform(-1, 1, (48, 64)).astype(np.float32))
    ggml.backend_tensor_set(x, rng.uniform(-1, 1, (40, 64)).astype(np.float32))
    cpu, blas = ggml.backend_cpu_init(), ggml.backend_blas_init()
    ggml.backend_graph_compute(cpu, gf)
    ref = ggml.backend_tensor_get(y)
    ggml.backend_tensor_memset(y, 0)
    assert [ggml.backend_supports_op(blas, n) for n in gf.nodes] == [True, False]
    ggml.backend_graph_compute(blas, ggml.graph.graph_view(gf, 0, 1))
    ggml.backend_graph_compute(cpu, ggml.graph.graph_view(gf, 1, 2))
    assert nmse(ggml.backend_tensor_get(y), ref) < 1e-10



# --- the layer's shape: one face, the host base, the entry-point checks ---------------------------

# Every name ggml_lite.backend offered before it was split along ggml's files (the later chapters
# and other packages import them from there).
FACE_NAMES = """
BACKEND_API_VERSION SIZE_MAX TENSOR_ALIGNMENT Backend BackendBuffer BackendBufferType BackendBufferUsage
BackendDevCaps BackendDevProps BackendDevType BackendDevice BackendEvent BackendReg Tallocr
backend_alloc_buffer backend_alloc_ctx_tensors backend_alloc_ctx_tensors_from_buft
backend_alloc_ctx_tensors_from_buft_size backend_buffer_clear backend_buffer_free backend_buffer_get_alignment
backend_buffer_get_alloc_size backend_buffer_get_base backend_buffer_get_max_size backend_buffer_get_size
backend_buffer_get_type backend_buffer_get_usage backend_buffer_init_tensor backend_buffer_is_host
backend_buffer_is_multi_buffer backend_buffer_name backend_buffer_reset backend_buffer_set_usage
backend_buft_alloc_buffer backend_buft_get_alignment backend_buft_get_alloc_size backend_buft_get_device
backend_buft_get_max_size backend_buft_is_host backend_buft_name backend_cpu_buffer_from_ptr
backend_cpu_buffer_type backend_dev_backend_reg backend_dev_buffer_from_host_ptr backend_dev_buffer_type
backend_dev_by_name backend_dev_by_type backend_dev_count backend_dev_description backend_dev_get
backend_dev_get_props backend_dev_host_buffer_type backend_dev_init backend_dev_memory backend_dev_name
backend_dev_offload_op backend_dev_supports_buft backend_dev_supports_op backend_dev_type
backend_device_register backend_event_free backend_event_new backend_event_record backend_event_synchronize
backend_event_wait backend_free backend_get_alignment backend_get_default_buffer_type backend_get_device
backend_get_max_size backend_graph_compute backend_graph_compute_async backend_graph_optimize backend_guid
backend_init_best backend_init_by_name backend_init_by_type backend_load backend_load_all
backend_multi_buffer_alloc_buffer backend_multi_buffer_set_usage backend_name backend_offload_op
backend_reg_by_name backend_reg_count backend_reg_dev_count backend_reg_dev_get backend_reg_get
backend_reg_get_proc_address backend_reg_name backend_register backend_supports_buft backend_supports_op
backend_synchronize backend_tensor_alloc backend_tensor_copy backend_tensor_copy_async backend_tensor_get
backend_tensor_get_async backend_tensor_memset backend_tensor_set backend_tensor_set_async backend_unload
backend_view_init guid_matches tallocr_alloc tallocr_new _registry
""".split()


def test_every_name_of_the_backend_face_is_still_there():
    missing = [n for n in FACE_NAMES if not hasattr(gb, n)]
    assert not missing
    # the ones that are ggml's public API are the package face's own objects
    assert all(getattr(gb, n) is getattr(ggml, n) for n in FACE_NAMES if n in ggml.__all__)


def test_host_array_is_the_public_hook_and_the_older_name_still_serves():
    buf = ggml.backend_buft_alloc_buffer(ggml.backend_cpu_buffer_type(), 64)
    assert buf.host_array() is buf._host_array()
    assert not hasattr(DeviceBuffer(ggml.backend_cpu_buffer_type(), 8), "host_array")   # no host view

    class OlderHostType(DeviceBufferType):                # a host buffer offering only _host_array
        def is_host(self):
            return True

        def alloc_buffer(self, size):
            b = DeviceBuffer(self, size)
            raw = np.zeros(size + 64, np.uint8)
            b.mem = raw[(-raw.ctypes.data) % 64:][:size]
            b.base = b.mem.ctypes.data
            b._host_array = lambda: b.mem
            return b
    ctx = nctx()
    src = ggml.new_tensor_1d(ctx, Type.F32, 4)
    dst = ggml.new_tensor_1d(ctx, Type.F32, 4)
    ggml.backend_alloc_ctx_tensors_from_buft(ctx, OlderHostType())
    ggml.backend_tensor_set(src, np.arange(4, dtype=np.float32))
    cctx = nctx()
    cpu_dst = ggml.new_tensor_1d(cctx, Type.F32, 4)
    ggml.backend_alloc_ctx_tensors_from_buft(cctx, ggml.backend_cpu_buffer_type())
    ggml.backend_tensor_copy(src, cpu_dst)                # host source: read through _host_array
    assert (cpu_dst.numpy() == np.arange(4)).all() and (src.numpy() == np.arange(4)).all()


def test_host_device_base_and_single_device_reg():
    from ggml_lite.backends.host import HostDevice, SingleDeviceReg

    class Tiny(HostDevice):
        def get_name(self):
            return "TINY"

        def get_description(self):
            return "tiny"

        def get_memory(self):
            return 1, 2

        def get_type(self):
            return ggml.BackendDevType.ACCEL

        def init_backend(self, params=None):
            return None

        def supports_op(self, op):
            return False
    marker = object()
    reg = SingleDeviceReg("TINY", Tiny, {"ggml_tiny_thing": marker})
    dev = ggml.backend_reg_dev_get(reg, 0)
    assert dev.reg is reg and ggml.backend_reg_dev_count(reg) == 1 and ggml.backend_reg_name(reg) == "TINY"
    assert ggml.backend_reg_get_proc_address(reg, "ggml_tiny_thing") is marker
    assert ggml.backend_reg_get_proc_address(reg, "ggml_backend_set_n_threads") is None
    props = ggml.backend_dev_get_props(dev)
    assert (props.memory_free, props.memory_total, props.type) == (1, 2, ggml.BackendDevType.ACCEL)
    assert props.caps == ggml.BackendDevCaps(async_=False, host_buffer=False, buffer_from_host_ptr=True,
                                             events=False)
    assert ggml.backend_dev_buffer_type(dev) is ggml.backend_cpu_buffer_type()
    assert ggml.backend_dev_supports_buft(dev, ggml.backend_cpu_buffer_type())
    assert not ggml.backend_dev_supports_buft(dev, DeviceBufferType())
    with pytest.raises(GGMLError, match=r"index 1 out of range \[0, 1\)"):
        reg.get_device(1)
    # the CPU and BLAS devices are such host devices: same props shape, same buffer type
    for r in (ggml.backend_cpu_reg(), ggml.backend_blas_reg()):
        d = ggml.backend_reg_dev_get(r, 0)
        assert isinstance(d, HostDevice) and isinstance(r, SingleDeviceReg)
        assert ggml.backend_dev_get_props(d).caps == props.caps


def _gone_graph():
    """A graph over a context that owned its memory and was freed: its tensors are gone."""
    ctx = ggml.init(mem_size=16 * ggml.tensor_overhead() + ggml.graph_overhead() + 1024)
    a = ggml.new_tensor_1d(ctx, Type.F32, 4)
    y = ggml.add(ctx, a, a)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, y)
    ggml.free(ctx)
    return gf, a, y


def test_entry_points_refuse_tensors_and_graphs_that_are_gone():
    gf, a, y = _gone_graph()
    cpu = ggml.backend_cpu_init()
    blas = ggml.backend_blas_init()
    for call in (lambda: ggml.backend_graph_compute(cpu, gf),
                 lambda: cpu.graph_compute(gf),               # the members refuse too, not only the API
                 lambda: blas.graph_compute(gf),
                 lambda: ggml.backend_graph_compute_async(cpu, gf),
                 lambda: ggml.backend_supports_op(cpu, y),
                 lambda: ggml.backend_dev_supports_op(cpu.device, y),
                 lambda: ggml.backend_tensor_get(a),
                 lambda: ggml.backend_tensor_memset(a, 0),
                 lambda: ggml.backend_tensor_copy(a, y),
                 lambda: ggml.backend_tensor_copy_async(cpu, cpu, a, y),
                 lambda: ggml.backend_view_init(a),
                 lambda: ggml.backend_tensor_alloc(ggml.backend_alloc_buffer(cpu, 64), a, 0)):
        with pytest.raises(GGMLError, match="is gone"):
            call()


def test_tallocr_and_alloc_ctx_refuse_tensors_that_are_gone():
    ctx = nctx()
    t = ggml.new_tensor_1d(ctx, Type.F32, 4)
    buf = ggml.backend_buft_alloc_buffer(ggml.backend_cpu_buffer_type(), 64)
    talloc = ggml.tallocr_new(buf)
    ggml.free(ctx)
    with pytest.raises(GGMLError, match="tallocr_alloc: .*is gone"):
        ggml.tallocr_alloc(talloc, t)
    assert talloc.offset == 0


def test_buft_get_alloc_size_default_and_override():
    """nbytes unless the buffer type overrides get_alloc_size; an override's answer is
    used, and one below nbytes is refused with the numbers."""
    ctx = ggml.init(mem_size=4 * ggml.tensor_overhead(), no_alloc=True)
    t = ggml.new_tensor_2d(ctx, Type.F32, 5, 3)
    cpu = ggml.backend_cpu_buffer_type()
    assert ggml.backend_buft_get_alloc_size(cpu, t) == ggml.nbytes(t) == 60

    class Padded(type(cpu)):
        def __init__(self, pad):
            super().__init__("PADDED")
            self.pad = pad

        def get_alloc_size(self, tensor):
            return ggml.nbytes(tensor) + self.pad

    assert ggml.backend_buft_get_alloc_size(Padded(64), t) == 124
    with pytest.raises(GGMLError, match="PADDED says 56 bytes for '.*', less than its "
                                        "nbytes 60"):
        ggml.backend_buft_get_alloc_size(Padded(-4), t)


def test_reg_get_proc_address_defaults_to_none():
    # ggml_backend_reg_get_proc_address returns NULL when the reg's get_proc_address
    # member is NULL: a reg that does not override the member has no extensions
    class BareReg(ggml.BackendReg):
        def get_name(self):
            return "BARE"

        def get_device_count(self):
            return 0

        def get_device(self, index):
            raise GGMLError("no devices")

    assert ggml.backend_reg_get_proc_address(BareReg(), "ggml_backend_set_n_threads") is None
