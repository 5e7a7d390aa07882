"""The rpc chapter (book/10_rpc.ipynb, ggml_lite/backends/rpc/): ggml-rpc 4.0.1's wire format, the
client and the server, against fixtures from real ggml 0.15.3 (tests/ggml_ref/rpc_ref.py): real
ggml's client's recorded requests replayed to ggml_lite's server, ggml_lite's client talking to
real ggml's recorded server. Servers run as child processes on loopback with a bounded lifetime."""
import base64
import json
import socket
import struct
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import ggml_lite as ggml
from ggml_lite import GGMLError
from ggml_lite.backends.rpc import backend as R
from rpc_helpers import LiteServer, closed_by_peer, connect, hello, recv_exact, request, response

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "ggml_ref"))
import rpc_lite_run as RUN  # noqa: E402
import rpc_scenarios as S  # noqa: E402

REF = json.loads((HERE / "data" / "rpc_ref.json").read_text())
C = R.RpcCmd


@pytest.fixture(scope="module")
def server():
    s = LiteServer(lifetime=600)
    yield s
    s.stop()


def test_wire_constants_are_ggml_0_15_3():
    assert (R.RPC_PROTO_MAJOR_VERSION, R.RPC_PROTO_MINOR_VERSION, R.RPC_PROTO_PATCH_VERSION) == (4, 0, 1)
    assert R.RPC_TENSOR_SIZE == 296 and R.RPC_TENSOR_SIZE % 8 == 0
    assert [c.name for c in C][:3] == ["ALLOC_BUFFER", "GET_ALIGNMENT", "GET_MAX_SIZE"]
    assert C.HELLO == 14 and C.GRAPH_RECOMPUTE == 16 and C.COUNT == 17
    assert R._REQUEST_SIZE[C.GET_ALLOC_SIZE] == 4 + 11 * 296
    assert R._REQUEST_SIZE[C.SET_TENSOR_HASH] == 312 and R._REQUEST_SIZE[C.BUFFER_CLEAR] == 9


def test_tensor_record_layout():
    t = R.RpcTensor(id=0x1122334455667788, type=8, buffer=0xAB, ne=(64, 2, 1, 1), nb=(34, 68, 136, 136),
                    op=29, op_params=tuple(range(16)), flags=16, src=tuple(range(1, 11)), view_src=7,
                    view_offs=9, data=0xDEAD, name=b"w")
    raw = t.pack()
    assert len(raw) == 296
    assert raw[:8] == struct.pack("<Q", 0x1122334455667788) and raw[8:12] == struct.pack("<I", 8)
    assert raw[20:36] == struct.pack("<4I", 64, 2, 1, 1)               # ne as uint32, right after buffer
    assert raw[52:56] == struct.pack("<I", 29)                          # op
    assert raw[120:124] == struct.pack("<i", 16)                        # flags after 16 op_params
    assert raw[220:228] == struct.pack("<Q", 0xDEAD)                     # data before name[64]
    assert raw[228:230] == b"w\0" and raw[292:] == bytes(4)             # name, then 4 bytes of padding
    back = R.RpcTensor.unpack(raw)
    assert back.pack() == raw and back.name.rstrip(b"\0") == b"w" and back.src == t.src


def test_fnv_1a_64():
    assert R.rpc_fnv_hash(b"") == 0xcbf29ce484222325
    assert R.rpc_fnv_hash(b"a") == 0xaf63dc4c8601ec8c
    assert R.rpc_fnv_hash(b"foobar") == 0x85944171f73967e8


def test_a_tensor_too_large_for_the_wire_raises():
    ctx = ggml.init(mem_size=4 * ggml.tensor_overhead(), no_alloc=True)
    t = ggml.new_tensor_2d(ctx, ggml.Type.F32, 2**31, 2)
    with pytest.raises(GGMLError, match="uint32"):
        R.rpc_serialize_tensor(t)


# --- the recorded sessions -----------------------------------------------------------------------

def frames(raw):
    """[(cmd, payload)] of a client's byte stream."""
    out, pos = [], 0
    while pos < len(raw):
        n = struct.unpack_from("<Q", raw, pos + 1)[0]
        out.append((C(raw[pos]), raw[pos + 9:pos + 9 + n]))
        pos += 9 + n
    assert pos == len(raw)
    return out


def responses(raw, reqs):
    """The server's response to each request (None where the command has none)."""
    out, pos = [], 0
    for cmd, _ in reqs:
        if cmd in R._NO_RESPONSE:
            out.append(None)
            continue
        n = struct.unpack_from("<Q", raw, pos)[0]
        out.append(raw[pos + 8:pos + 8 + n])
        pos += 8 + n
    assert pos == len(raw)
    return out


def sessions():
    return [(base64.b64decode(s["c2s"]), base64.b64decode(s["s2c"])) for s in REF["sessions"]]


def tensor_slots(cmd, payload):
    """Byte offsets of the rpc_tensor records in a request."""
    if cmd in (C.SET_TENSOR, C.SET_TENSOR_HASH, C.GET_TENSOR, C.INIT_TENSOR):
        return [0]
    if cmd == C.COPY_TENSOR:
        return [0, 296]
    if cmd == C.GET_ALLOC_SIZE:
        return [4 + 296 * i for i in range(11)]
    if cmd == C.GRAPH_COMPUTE:
        n_nodes = struct.unpack_from("<I", payload, 4)[0]
        first = 12 + 8 * n_nodes
        n_tensors = struct.unpack_from("<I", payload, first - 4)[0]
        return [first + 296 * i for i in range(n_tensors)]
    return []


def rewrite(cmd, payload, ids=None, ptr=None):
    """The request with tensor ids renamed by ids(old) and buffer handles/addresses by ptr(old)."""
    p = bytearray(payload)
    ident = lambda v: v  # noqa: E731
    ids, ptr = ids or ident, ptr or ident
    for off in tensor_slots(cmd, payload):
        t = R.RpcTensor.unpack(p, off)
        if t.id == 0 and not any(t.src):
            continue
        t.id, t.src = ids(t.id), tuple(ids(s) if s else 0 for s in t.src)
        t.view_src = ids(t.view_src) if t.view_src else 0
        t.buffer, t.data = (ptr(t.buffer) if t.buffer else 0), (ptr(t.data) if t.data else 0)
        p[off:off + 296] = t.pack()
    if cmd == C.GRAPH_COMPUTE:
        n_nodes = struct.unpack_from("<I", p, 4)[0]
        for i in range(n_nodes):
            struct.pack_into("<Q", p, 8 + 8 * i, ids(struct.unpack_from("<Q", p, 8 + 8 * i)[0]))
    if cmd in (C.FREE_BUFFER, C.BUFFER_GET_BASE):
        p[0:8] = struct.pack("<Q", ptr(struct.unpack_from("<Q", p)[0]))
    if cmd == C.BUFFER_CLEAR:
        p[0:8] = struct.pack("<Q", ptr(struct.unpack_from("<Q", p)[0]))
    return bytes(p)


class Renamer:
    """Tensor ids by order of first appearance, forgotten at FREE_BUFFER (the end of a scenario,
    after which a client may reuse addresses)."""

    def __init__(self):
        self.map = {}

    def __call__(self, v):
        return self.map.setdefault(v, len(self.map) + 1)


def real_client_stream():
    """Real ggml's client's requests and the real server's responses over all its connections,
    with the HELLO of every connection after the first left out (ggml_lite keeps one connection)."""
    reqs, rsps = [], []
    for k, (c2s, s2c) in enumerate(sessions()[:-1]):
        fr = frames(c2s)
        rs = responses(s2c, fr)
        for f, r in zip(fr, rs):
            if f[0] == C.HELLO and reqs:
                continue
            reqs.append(f)
            rsps.append(r)
    return reqs, rsps


class FakeServer:
    """Plays the real server's recorded responses to whoever connects, checking each request
    against the real client's (ids renamed). .mismatch holds the first difference."""

    def __init__(self, reqs, rsps):
        self.reqs, self.rsps, self.mismatch, self.served = reqs, rsps, None, 0
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(1)
        self.endpoint = f"127.0.0.1:{self.sock.getsockname()[1]}"
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self):
        c, _ = self.sock.accept()
        c.settimeout(30)
        mine, theirs = Renamer(), Renamer()
        try:
            for (cmd, want), rsp in zip(self.reqs, self.rsps):
                got_cmd = recv_exact(c, 1)[0]
                got = recv_exact(c, struct.unpack("<Q", recv_exact(c, 8))[0])
                if got_cmd != cmd or rewrite(cmd, got, mine) != rewrite(cmd, want, theirs):
                    self.mismatch = (self.served, C(got_cmd).name, cmd.name)
                    return
                if cmd == C.FREE_BUFFER:
                    mine.map.clear(), theirs.map.clear()
                if rsp is not None:
                    c.sendall(struct.pack("<Q", len(rsp)) + rsp)
                self.served += 1
        except (OSError, ConnectionError) as e:
            self.mismatch = (self.served, "connection", str(e))
        finally:
            c.close()


def test_ggml_lite_client_against_the_recorded_real_server():
    """ggml_lite's client, now, makes real ggml's client's requests byte for byte (tensor ids
    renamed) and computes with the real server's answers: the outputs are real ggml's."""
    reqs, rsps = real_client_stream()
    fake = FakeServer(reqs, rsps)
    backend = ggml.backend_rpc_init(fake.endpoint, 0)
    outs = {name: RUN.run_scenario(backend, name).hex() for name in S.SCENARIOS}
    fake.thread.join(30)
    assert fake.mismatch is None, fake.mismatch
    assert fake.served == len(reqs)
    for name in S.SCENARIOS:
        assert outs[name] == REF["scenarios"][name]["real_client_real_server"] == REF["scenarios"][name]["local"]


def replay_to(server, c2s, s2c):
    """Real ggml's client's requests of one connection, sent to a ggml_lite server with the real
    server's buffer handles and addresses translated to this server's; the GET_TENSOR results."""
    reqs = frames(c2s)
    rsps = responses(s2c, reqs)
    handles, bases = {}, []                     # real handle -> mine; (real base, size, my base)
    real_bases = {}

    def ptr(v):
        if v in handles:
            return handles[v]
        for rb, size, mb in bases:
            if rb <= v <= rb + size:
                return mb + (v - rb)
        raise AssertionError(f"address 0x{v:x} of no recorded buffer")

    got = []
    s = connect(server.port)
    try:
        for (cmd, payload), want in zip(reqs, rsps):
            s.sendall(request(cmd, rewrite(cmd, payload, ptr=ptr)))
            if want is None:
                continue
            mine = response(s)
            assert len(mine) == len(want), cmd.name
            if cmd == C.ALLOC_BUFFER:
                (rh, rsize), (mh, msize) = struct.unpack("<QQ", want), struct.unpack("<QQ", mine)
                assert rsize == msize
                handles[rh] = mh
                real_bases[mh] = rsize
            elif cmd == C.BUFFER_GET_BASE:
                mh = ptr(struct.unpack_from("<Q", payload)[0])
                bases.append((struct.unpack("<Q", want)[0], real_bases[mh], struct.unpack("<Q", mine)[0]))
            elif cmd == C.GET_TENSOR:
                got.append(mine)
            elif cmd not in (C.GET_DEVICE_MEMORY,):
                assert mine == want, cmd.name          # HELLO, alignment, max size, alloc sizes, ...
    finally:
        s.close()
    return got


def test_real_clients_requests_replayed_to_ggml_lite_server(server):
    """Every recorded connection of real ggml's client, replayed to ggml_lite's server: the same
    answers (version, device count, alignment, max size, buffer sizes, alloc sizes), and each
    graph's output equal to ggml_lite computing it locally and to what real ggml's client got
    from ggml_lite's server when the fixture was made."""
    cpu = ggml.backend_cpu_init()
    ggml.backend_cpu_set_n_threads(cpu, 1)
    outputs = []
    for c2s, s2c in sessions()[:-1]:
        outputs += replay_to(server, c2s, s2c)
    assert len(outputs) == len(S.SCENARIOS)
    for name, raw in zip(S.SCENARIOS, outputs):
        assert raw.hex() == RUN.run_scenario(cpu, name).hex() == REF["scenarios"][name]["real_client_lite_server"]
        real = RUN.output_values(name, bytes.fromhex(REF["scenarios"][name]["local"]))
        lite = RUN.output_values(name, raw)
        assert np.sum((real - lite) ** 2) <= 5e-4 * np.sum(real ** 2), name
    assert server.alive()
