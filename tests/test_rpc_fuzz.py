"""Thousands of malformed ggml-rpc frames sent to one ggml_lite server (a child process on loopback
with a bounded lifetime): truncated, oversized, unknown commands and devices, bad buffer handles
and tensor ids, out-of-bounds offsets, cyclic, oversized and ill-shaped graphs, wrong handshakes,
random bit flips of good requests. The server must survive every one (each connection ends, the
process stays up, no internal error is logged), then serve a well-formed client correctly."""
import gc
import socket
import struct

import numpy as np
import pytest

import ggml_lite as ggml
from ggml_lite.backends.rpc import backend as R
from rpc_helpers import LiteServer, connect, hello, request, response

C = R.RpcCmd
N_PER_KIND = 400
BUF = 4096


@pytest.fixture(scope="module")
def server():
    s = LiteServer(lifetime=600)
    yield s
    s.stop()


def pick(rng, values, size=None):
    """values[i] for a random i (numpy's choice would turn 64-bit values into floats)."""
    if size is None:
        return values[int(rng.integers(len(values)))]
    return [values[int(i)] for i in rng.integers(len(values), size=size)]


def rec(rng, handle, base, ids=None, op=None, random_shape=False):
    """A plausible rpc_tensor in the session's buffer, with some fields drawn at random."""
    if random_shape:
        ne = tuple(int(v) for v in pick(rng, [0, 1, 2, 3, 8, 31, 32, 64, 1 << 16, 0xFFFFFFFF], 4))
        nb = tuple(int(v) for v in pick(rng, [0, 1, 2, 4, 32, 256, 1 << 20, 0xFFFFFFFF], 4))
        typ = int(pick(rng, [0, 1, 2, 3, 4, 8, 12, 14, 26, 30, 39, 1000]))
    else:
        ne, nb, typ = (8, 1, 1, 1), (4, 32, 32, 32), 0
    ids = ids or [1, 2, 3]
    return R.RpcTensor(id=int(pick(rng, ids)), type=typ,
                       buffer=handle if rng.random() < 0.9 else int(rng.integers(0, 1 << 62)),
                       ne=ne, nb=nb, op=int(rng.integers(0, 100)) if op is None else op,
                       op_params=tuple(int(v) for v in rng.integers(-4, 64, 16)), flags=int(rng.integers(0, 32)),
                       src=tuple(int(pick(rng, ids + [0, 0, 0])) for _ in range(10)),
                       view_src=int(pick(rng, ids + [0] * 6)), view_offs=int(rng.integers(0, 64)),
                       data=(base + int(pick(rng, [0, 32, 64, BUF - 4, BUF, BUF + 32, -base]))) % (1 << 64),
                       name=bytes(rng.integers(0, 256, 64, dtype=np.uint8)))


def good_requests(handle, base):
    """One good request of each command, for truncation and bit flips."""
    t = R.RpcTensor(id=1, type=0, buffer=handle, ne=(8, 1, 1, 1), nb=(4, 32, 32, 32), data=base, name=b"t")
    u = R.RpcTensor(id=2, type=0, buffer=handle, ne=(8, 1, 1, 1), nb=(4, 32, 32, 32), op=int(ggml.Op.ADD),
                    src=(1, 1) + (0,) * 8, data=base + 32, name=b"u")
    graph = struct.pack("<II", 0, 1) + struct.pack("<Q", 2) + struct.pack("<I", 2) + t.pack() + u.pack()
    return [request(C.SET_TENSOR, t.pack() + struct.pack("<Q", 0) + bytes(32)),
            request(C.GET_TENSOR, t.pack() + struct.pack("<QQ", 0, 32)),
            request(C.COPY_TENSOR, t.pack() + u.pack()),
            request(C.GRAPH_COMPUTE, graph),
            request(C.SET_TENSOR_HASH, t.pack() + struct.pack("<QQ", 0, 99)),
            request(C.INIT_TENSOR, t.pack()),
            request(C.GET_ALLOC_SIZE, struct.pack("<I", 0) + t.pack() + bytes(296 * 10)),
            request(C.BUFFER_CLEAR, struct.pack("<QB", handle, 7)),
            request(C.ALLOC_BUFFER, struct.pack("<IQ", 0, 64)),
            request(C.GET_DEVICE_MEMORY, struct.pack("<I", 0)),
            request(C.GRAPH_RECOMPUTE, struct.pack("<I", 0)),
            request(C.FREE_BUFFER, struct.pack("<Q", handle))]


def graph_frame(rng, handle, base):
    """A graph with random links (cycles included), ops, shapes, types and counts."""
    n = int(rng.integers(1, 12))
    ids = [int(i) for i in rng.integers(1, 1 << 40, n)]
    recs = [rec(rng, handle, base, ids, random_shape=rng.random() < 0.5) for _ in range(n)]
    for r, i in zip(recs, ids):
        r.id = i
    nodes = [int(pick(rng, ids + [0, 12345])) for _ in range(int(rng.integers(1, 6)))]
    n_nodes = len(nodes) if rng.random() < 0.8 else int(pick(rng, [0, 1 << 31, 0xFFFFFFFF, len(nodes) + 3]))
    n_tensors = n if rng.random() < 0.8 else int(pick(rng, [0, n + 1, 1 << 28, 0xFFFFFFFF]))
    body = (struct.pack("<II", int(pick(rng, [0, 0, 0, 1, 0xFFFFFFFF])), n_nodes) + struct.pack(f"<{len(nodes)}Q", *nodes)
            + struct.pack("<I", n_tensors) + b"".join(r.pack() for r in recs))
    return request(C.GRAPH_COMPUTE, body)


OPS = [ggml.Op.ADD, ggml.Op.MUL, ggml.Op.SUB, ggml.Op.DIV, ggml.Op.MUL_MAT, ggml.Op.CPY, ggml.Op.CONT,
       ggml.Op.DUP, ggml.Op.SCALE, ggml.Op.NORM, ggml.Op.RMS_NORM, ggml.Op.SOFT_MAX, ggml.Op.ROPE,
       ggml.Op.GET_ROWS, ggml.Op.CONCAT, ggml.Op.SUM, ggml.Op.SUM_ROWS, ggml.Op.MEAN, ggml.Op.REPEAT,
       ggml.Op.UNARY, ggml.Op.GLU, ggml.Op.DIAG_MASK_INF, ggml.Op.VIEW, ggml.Op.NONE]
SHAPES = [(8, 1, 1, 1), (4, 2, 1, 1), (2, 4, 1, 1), (8, 2, 1, 1), (4, 4, 1, 1), (1, 1, 1, 1), (2, 2, 2, 1),
          (16, 1, 1, 1), (0, 1, 1, 1), (32, 1, 1, 1)]


def shaped_graph(rng, handle, base):
    """A well-formed graph (every id present, every tensor inside the buffer, sources before
    their users) of small F32/F16/I32 tensors with random ops, shapes and op_params: what is left
    to refuse is each op's own rules, and what passes is computed."""
    recs = []
    for k in range(int(rng.integers(2, 8))):
        ne = pick(rng, SHAPES)
        typ = pick(rng, [0, 0, 0, 1, 26])
        es = 2 if typ == 1 else 4
        nb = (es, es * ne[0], es * ne[0] * ne[1], es * ne[0] * ne[1] * ne[2])
        n_src = 0 if k == 0 else int(rng.integers(0, 4))
        src = tuple(int(rng.integers(1, k + 1)) for _ in range(n_src)) + (0,) * (10 - n_src)
        params = [int(v) for v in rng.integers(-2, 12, 16)]
        if rng.random() < 0.5:
            params[0] = int(np.float32(pick(rng, [0.5, 1e-5, 2.0])).view(np.int32))
        recs.append(R.RpcTensor(id=k + 1, type=typ, buffer=handle, ne=ne, nb=nb,
                                op=int(pick(rng, OPS)) if n_src else 0, op_params=tuple(params),
                                src=src, data=base + 256 * k, name=f"t{k}".encode()))
    nodes = [r.id for r in recs if r.op != 0] or [recs[-1].id]
    body = (struct.pack("<II", 0, len(nodes)) + struct.pack(f"<{len(nodes)}Q", *nodes)
            + struct.pack("<I", len(recs)) + b"".join(r.pack() for r in recs))
    return request(C.GRAPH_COMPUTE, body) + request(C.GET_TENSOR, recs[-1].pack() + struct.pack("<QQ", 0, 4))


def kinds(rng, handle, base):
    """name -> a function making one malformed frame (bytes sent after HELLO and the buffer)."""
    good = good_requests(handle, base)
    t = lambda: rec(rng, handle, base, random_shape=rng.random() < 0.3).pack()  # noqa: E731
    return {
        "truncated": lambda: (lambda g: g[:int(rng.integers(1, len(g)))])(good[int(rng.integers(len(good)))]),
        "oversized": lambda: bytes([int(pick(rng, [6, 10, 8, 0]))]) + struct.pack(
            "<Q", int(pick(rng, [1 << 63, 1 << 40, 1 << 31, 2**64 - 1]))) + bytes(int(rng.integers(0, 400))),
        "wrong_size": lambda: (lambda c: request(c, bytes(int(rng.integers(0, 600)))))(
            int(pick(rng, [c for c in C if c not in (C.COUNT, C.SET_TENSOR, C.GRAPH_COMPUTE)]))),
        "unknown_command": lambda: bytes([int(rng.integers(17, 256))]) + bytes(int(rng.integers(0, 20))),
        "bad_device": lambda: request(int(pick(rng, [C.GET_ALIGNMENT, C.GET_MAX_SIZE, C.GET_DEVICE_MEMORY,
                                                      C.GRAPH_RECOMPUTE])), struct.pack("<I", int(rng.integers(1, 1 << 32)))),
        "bad_handle": lambda: request(int(pick(rng, [C.FREE_BUFFER, C.BUFFER_GET_BASE])),
                                      struct.pack("<Q", int(rng.integers(0, 1 << 63)))),
        "out_of_bounds": lambda: request(int(pick(rng, [C.SET_TENSOR, C.GET_TENSOR])),
                                         t() + struct.pack("<QQ", int(pick(rng, [0, BUF - 8, BUF, 1 << 62, 2**64 - 8])),
                                                           int(pick(rng, [0, 8, BUF, 1 << 40, 2**64 - 1])))),
        "bad_copy": lambda: request(C.COPY_TENSOR, t() + t()),
        "bad_alloc_size": lambda: request(C.GET_ALLOC_SIZE, struct.pack("<I", 0) + b"".join(t() for _ in range(11))),
        "graph": lambda: graph_frame(rng, handle, base),
        "graph_shapes": lambda: shaped_graph(rng, handle, base),
        "bit_flip": lambda: (lambda g: bytes(b ^ (1 << int(rng.integers(8))) if rng.random() < 0.02 else b for b in g))(
            good[int(rng.integers(len(good)))]),
        "handshake": None,
    }


def handshake_frame(rng):
    """Bytes of a connection that gets the handshake wrong."""
    return [request(int(rng.integers(0, 14)), bytes(24)),                      # not HELLO first
            request(C.HELLO, bytes(int(pick(rng, [0, 23, 25, 1 << 10])))),     # the size of another version
            request(C.HELLO, bytes(24)) + request(C.HELLO, bytes(24))][int(rng.integers(3))]


def send_and_drain(port, frame, with_session=True):
    """One connection: HELLO and a 4 KiB buffer (unless the frame is a handshake), the frame, the
    end of our writing; then whatever the server answers until it closes. The number of bytes
    it answered to the frame, or None if it hung."""
    s = connect(port, timeout=20)
    try:
        if with_session:
            hello(s)
            s.sendall(request(C.ALLOC_BUFFER, struct.pack("<IQ", 0, BUF)))
            handle = struct.unpack("<QQ", response(s))[0]
            s.sendall(request(C.BUFFER_GET_BASE, struct.pack("<Q", handle)))
            base = struct.unpack("<Q", response(s))[0]
            frame = frame(handle, base)
        try:
            s.sendall(frame)
            s.shutdown(socket.SHUT_WR)
        except OSError:
            return 0                          # closed before we were done: refused early
        got = 0
        while True:
            try:
                d = s.recv(1 << 16)
            except ConnectionResetError:
                return got
            except socket.timeout:
                return None
            if not d:
                return got
            got += len(d)
    finally:
        s.close()


def test_the_server_survives_thousands_of_malformed_frames(server):
    gc.collect()
    rng = np.random.default_rng(20261203)
    sent, computed = 0, 0
    for kind in kinds(rng, 0, 0):
        for i in range(N_PER_KIND):
            if kind == "handshake":
                ok = send_and_drain(server.port, handshake_frame(rng), with_session=False)
            else:
                ok = send_and_drain(server.port, lambda h, b: kinds(rng, h, b)[kind]())
            assert ok is not None, f"{kind} #{i}: the server did not close the connection"
            computed += kind == "graph_shapes" and ok == 8 + 4      # the GET_TENSOR after it answered
            sent += 1
        assert server.alive(), f"the server died on a {kind} frame"
    assert sent >= 3000
    log = server.log()
    assert "unexpected error" not in log, log[log.find("unexpected error") - 2000:][:4000]
    refused = log.count("closing the connection")
    assert refused >= sent // 3, (refused, sent)
    print(f"{sent} malformed frames, {refused} refused with a reason, the rest ended by the client")
    print(f"{computed} of {N_PER_KIND} well-formed graphs of random ops passed every check and were computed")
    assert 0 < computed < N_PER_KIND
    backend = ggml.backend_rpc_init(server.endpoint, 0)                 # a good client after all that
    ctx = ggml.init(mem_size=16 * ggml.tensor_overhead() + ggml.graph_overhead(), no_alloc=True)
    a = ggml.new_tensor_2d(ctx, ggml.Type.F32, 4, 3)
    b = ggml.new_tensor_2d(ctx, ggml.Type.F32, 4, 2)
    out = ggml.mul_mat(ctx, a, b)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, out)
    buf = ggml.backend_alloc_ctx_tensors(ctx, backend)
    x, y = np.arange(12, dtype=np.float32).reshape(3, 4), np.ones((2, 4), np.float32)
    ggml.backend_tensor_set(a, x)
    ggml.backend_tensor_set(b, y)
    assert ggml.backend_graph_compute(backend, gf) == ggml.Status.SUCCESS
    assert np.array_equal(ggml.backend_tensor_get(out).reshape(2, 3), y @ x.T)
    ggml.backend_buffer_free(buf)
