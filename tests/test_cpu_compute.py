"""The CPU compute layer: plan, threadpool, the compute loop, zero allocation, failures."""
import gc
import threading
import time
import tracemalloc

import numpy as np
import pytest

import ggml_lite as ggml
from ggml_lite import Op, Status, Type

F32 = Type.F32


def seed_graph(ctx):
    """f = a*x^2 + b, the seed's example."""
    x, a, b = (ggml.new_tensor_1d(ctx, F32, 1) for _ in range(3))
    f = ggml.add(ctx, ggml.mul(ctx, a, ggml.mul(ctx, x, x)), b)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, f)
    return gf, x, a, b, f


@pytest.mark.parametrize("n_threads", [1, 2, 3, 4, 8])
def test_seed_example_reuses_one_plan(n_threads):
    ctx = ggml.init(1 << 20)
    gf, x, a, b, f = seed_graph(ctx)
    ggml.set_f32(a, 3.0)
    ggml.set_f32(b, 4.0)
    plan = ggml.graph_plan(gf, n_threads)
    assert plan.work_size == 0 and plan.n_threads == n_threads
    for v in (2.0, 3.0, 4.0):
        ggml.set_f32(x, v)
        assert ggml.graph_compute(gf, plan) == Status.SUCCESS
        assert ggml.get_f32_1d(f, 0) == 3 * v * v + 4


def test_n_tasks_follow_ggml():
    ctx = ggml.init(1 << 20)
    a = ggml.new_tensor_2d(ctx, F32, 8, 3)
    assert ggml.backends.cpu.compute.get_n_tasks(ggml.add(ctx, a, a), 4) == 4
    assert ggml.backends.cpu.compute.get_n_tasks(ggml.sub(ctx, a, a), 4) == 1          # ggml counts one task for SUB
    assert ggml.backends.cpu.compute.get_n_tasks(ggml.soft_max(ctx, a), 8) == 3        # min(n_threads, rows)
    assert ggml.backends.cpu.compute.get_n_tasks(ggml.sum(ctx, a), 4) == 1
    assert ggml.backends.cpu.compute.get_n_tasks(ggml.silu(ctx, a), 4) == 4
    assert ggml.backends.cpu.compute.get_n_tasks(ggml.get_rows(ctx, a, ggml.new_tensor_1d(ctx, Type.I32, 2)), 4) == 1
    assert ggml.backends.cpu.compute.get_n_tasks(ggml.transpose(ctx, a), 4) == 1


@pytest.mark.parametrize("wtype,vdt", [(Type.Q4_0, Type.Q8_0), (Type.Q4_K, Type.Q8_K), (Type.F16, Type.F16),
                                       (Type.F32, None)])
def test_work_size_formula(wtype, vdt):
    ctx = ggml.init(1 << 22)
    w = ggml.new_tensor_2d(ctx, wtype, 256, 16)
    x = ggml.new_tensor_2d(ctx, F32, 256, 5)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, ggml.mul_mat(ctx, w, x))
    plan = ggml.graph_plan(gf, 3)
    want = 0 if vdt is None else ggml.row_size(vdt, 256 * 5) + ggml.backends.cpu.table.CACHE_LINE_SIZE * 3
    assert plan.work_size == want


def test_missing_work_buffer_is_refused():
    ctx = ggml.init(1 << 22)
    w = ggml.new_tensor_2d(ctx, Type.Q8_0, 64, 4)
    x = ggml.new_tensor_2d(ctx, F32, 64, 2)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, ggml.mul_mat(ctx, w, x))
    plan = ggml.graph_plan(gf, 2)
    with pytest.raises(ggml.GGMLError, match=rf"work buffer of {plan.work_size} bytes, work_data has 0"):
        ggml.graph_compute(gf, plan)
    plan.work_data = np.zeros(plan.work_size - 1, np.uint8)
    with pytest.raises(ggml.GGMLError, match=rf"work_data has {plan.work_size - 1}"):
        ggml.graph_compute(gf, plan)


def test_with_ctx_takes_the_work_buffer_from_the_pool():
    ctx = ggml.init(1 << 22)
    w = ggml.new_tensor_2d(ctx, Type.Q4_0, 64, 4)
    x = ggml.new_tensor_2d(ctx, F32, 64, 2)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, ggml.mul_mat(ctx, w, x))
    before = ggml.used_mem(ctx)
    work = ggml.graph_plan(gf, 2).work_size
    assert ggml.graph_compute_with_ctx(ctx, gf, 2) == Status.SUCCESS
    assert ggml.used_mem(ctx) == before + ggml.context.OBJECT_SIZE + (work + 15) // 16 * 16   # ggml_new_buffer


def test_repeated_compute_of_200_nodes_allocates_nothing():
    ctx = ggml.init(64 << 20)
    h = ggml.new_tensor_2d(ctx, F32, 4096, 4)
    s = ggml.new_tensor_1d(ctx, F32, 4096)
    cur = h
    for _ in range(100):
        cur = ggml.add(ctx, ggml.mul(ctx, cur, s), h)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, cur)
    assert ggml.graph_n_nodes(gf) == 200
    h.numpy()[...] = 1.0
    s.numpy()[...] = 0.5
    plan = ggml.graph_plan(gf, 2)
    ggml.graph_compute(gf, plan)
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    for _ in range(10):
        ggml.graph_compute(gf, plan)
    now, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert now - base < 1024                       # nothing kept
    assert peak - base < ggml.nbytes(h) // 4       # nothing tensor-sized made, even briefly
    np.testing.assert_allclose(cur.numpy()[0, 0, 0], 2.0, rtol=1e-6)


def test_raising_kernel_names_the_node_and_the_pool_survives():
    ctx = ggml.init(4 << 20)
    m = ggml.new_tensor_2d(ctx, F32, 8, 4)
    idx = ggml.new_tensor_1d(ctx, Type.I32, 2)
    big = ggml.new_tensor_2d(ctx, F32, 1 << 10, 1 << 7)    # large enough to run on every thread
    out = ggml.add(ctx, ggml.scale(ctx, big, 2.0), big)
    rows = ggml.get_rows(ctx, m, idx)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, out)
    ggml.build_forward_expand(gf, rows)
    plan = ggml.graph_plan(gf, 4)
    idx.numpy()[...] = [0, 9]
    with pytest.raises(ggml.GGMLError, match=r"node \d+ '.*' \(GET_ROWS\) failed on thread 0: .*out of range"):
        ggml.graph_compute(gf, plan)
    idx.numpy()[...] = [0, 3]
    big.numpy()[...] = 1.0
    assert ggml.graph_compute(gf, plan) == Status.SUCCESS
    assert (out.numpy() == 3.0).all()


def test_worker_failure_releases_waiting_threads():
    tp = ggml.threadpool_new(4)
    try:
        def job(ith):
            if ith == 2:
                raise ValueError("boom in worker 2")
            tp.barrier()
            tp.barrier()

        done = []
        t = threading.Thread(target=lambda: done.append(pytest.raises(ValueError, tp.run, job)))
        t.start()
        t.join(timeout=30)
        assert not t.is_alive(), "a failing worker left the pool hanging"
        hits = np.zeros(4, np.int64)

        def count(ith):
            hits[ith] += 1
            tp.barrier()
        for _ in range(5):
            tp.run(count)
        assert hits.tolist() == [5, 5, 5, 5]
    finally:
        ggml.threadpool_free(tp)


def test_barrier_orders_writes_before_reads():
    tp = ggml.threadpool_new(3)
    try:
        slots = np.zeros(3, np.int64)
        seen = np.zeros((3, 3), np.int64)

        def job(ith):
            slots[ith] = ith + 1
            tp.barrier()
            seen[ith] = slots
        for _ in range(20):
            slots[:] = 0
            tp.run(job)
            assert (seen == [1, 2, 3]).all()
    finally:
        ggml.threadpool_free(tp)
    with pytest.raises(ggml.GGMLError, match="after threadpool_free"):
        tp.run(lambda ith: None)
    with pytest.raises(ggml.GGMLError, match=r"n_threads must be in 1..512 \(got 0\)"):
        ggml.threadpool_new(0)


def test_empty_graph_and_more_threads_than_work():
    ctx = ggml.init(1 << 20)
    assert ggml.graph_compute_with_ctx(ctx, ggml.new_graph(ctx), 4) == Status.SUCCESS
    gf, x, a, b, f = seed_graph(ctx)
    for t, v in ((x, 1.5), (a, 2.0), (b, -1.0)):
        ggml.set_f32(t, v)
    assert ggml.graph_compute_with_ctx(ctx, gf, 16) == Status.SUCCESS
    assert ggml.get_f32_1d(f, 0) == 2.0 * 1.5 * 1.5 - 1.0


def test_abort_callback_stops_after_the_node():
    ctx = ggml.init(1 << 20)
    gf, x, a, b, f = seed_graph(ctx)
    plan = ggml.graph_plan(gf, 2)
    calls = []
    plan.abort_callback = lambda data: calls.append(data) or len(calls) == 1
    plan.abort_callback_data = "stop"
    ggml.set_f32(f, -7.0)
    assert ggml.graph_compute(gf, plan) == Status.ABORTED
    assert plan.aborted_at == 1 and calls == ["stop"]
    assert ggml.get_f32_1d(f, 0) == -7.0                     # the last node never ran


@pytest.mark.parametrize("n_threads", [1, 2, 3, 4])
def test_mul_mat_chunks_each_computed_once(n_threads):
    rng = np.random.default_rng(1)
    ctx = ggml.init(16 << 20)
    w = ggml.new_tensor_2d(ctx, Type.Q4_0, 256, 300)
    x = ggml.new_tensor_2d(ctx, F32, 256, 40)
    y = ggml.mul_mat(ctx, w, x)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, y)
    W = rng.uniform(-1, 1, (300, 256)).astype(np.float32)
    X = rng.uniform(-1, 1, (40, 256)).astype(np.float32)
    w.numpy()[0, 0] = ggml.quantize_chunk(Type.Q4_0, W)
    x.numpy()[0, 0] = X
    plan = ggml.graph_plan(gf, n_threads)
    plan.work_data = np.zeros(plan.work_size, np.uint8)
    plan.trace = []
    assert ggml.graph_compute(gf, plan) == Status.SUCCESS
    owner = plan.chunk_owners[0]
    assert (owner >= 0).all() and set(owner.tolist()) <= set(range(n_threads))
    ref = X @ ggml.types.dequantize_rows(Type.Q4_0, w.numpy()[0, 0], 256).T
    got = y.numpy()[0, 0]
    assert ((got - ref) ** 2).sum() / (ref ** 2).sum() < 5e-4


def test_plan_follows_moved_data():
    """A plan prepares views of the tensors; if a tensor's data moves, compute prepares again."""
    ctx = ggml.init(1 << 20)
    gf, x, a, b, f = seed_graph(ctx)
    plan = ggml.graph_plan(gf, 1)
    for t, v in ((x, 2.0), (a, 1.0), (b, 0.0)):
        ggml.set_f32(t, v)
    ggml.graph_compute(gf, plan)
    other = ggml.new_tensor_1d(ctx, F32, 1)
    ggml.set_f32(other, 5.0)
    old = x.data
    x.data = other.data                                  # as a re-allocation would
    try:
        ggml.graph_compute(gf, plan)
        assert ggml.get_f32_1d(f, 0) == 25.0
    finally:
        x.data = old


def test_min_work_per_node_zero_runs_every_node_on_every_thread():
    ctx = ggml.init(1 << 20)
    gf, x, a, b, f = seed_graph(ctx)
    for t, v in ((x, 2.0), (a, 1.0), (b, 1.0)):
        ggml.set_f32(t, v)
    plan = ggml.graph_plan(gf, 3)
    plan.trace = []
    ggml.graph_compute(gf, plan)
    assert {ith for ith, *_ in plan.trace} == {0}            # tiny nodes: thread 0 alone
    plan.min_work_per_node, plan.trace = 0, []
    ggml.graph_compute(gf, plan)                             # ggml's schedule
    assert sorted((i, ith) for ith, i, *_ in plan.trace) == [(i, t) for i in range(3) for t in range(3)]
    assert ggml.get_f32_1d(f, 0) == 5.0


def test_compute_refuses_a_graph_whose_memory_is_gone():
    """A context freed with the pool it owned (or reset): plan, compute and compute_with_ctx refuse
    its graph, naming what is gone, before anything runs."""
    ctx = ggml.init(1 << 20)
    gf, x, a, b, f = seed_graph(ctx)
    plan = ggml.graph_plan(gf, 2)
    ggml.graph_compute(gf, plan)                                  # prepared once
    ggml.free(ctx)
    for call in (lambda: ggml.graph_plan(gf, 2), lambda: ggml.graph_compute(gf, plan),
                 lambda: ggml.graph_compute_with_ctx(ctx, gf, 2)):
        with pytest.raises(ggml.GGMLError, match="is gone"):
            call()
    ctx = ggml.init(1 << 20)
    gf, *_ = seed_graph(ctx)
    ggml.reset(ctx)
    with pytest.raises(ggml.GGMLError, match="graph_plan: .*gone"):
        ggml.graph_plan(gf, 1)


def test_a_graph_over_caller_memory_computes_after_free():
    """ggml's examples/simple/simple-backend.cpp frees the context between building and computing:
    over caller-owned memory (mem_buffer) the tensors and the graph stay usable."""
    mem = np.zeros(1 << 20, np.uint8)
    ctx = ggml.init(mem_size=mem.nbytes, mem_buffer=mem)
    gf, x, a, b, f = seed_graph(ctx)
    for t, v in ((x, 2.0), (a, 3.0), (b, 4.0)):
        ggml.set_f32(t, v)
    ggml.free(ctx)
    plan = ggml.graph_plan(gf, 2)
    assert ggml.graph_compute(gf, plan) == Status.SUCCESS
    assert ggml.get_f32_1d(f, 0) == 16.0


# --------------------------------------------------------------------------- the compiled loop
from ggml_lite.backends.cpu import program as P  # noqa: E402
from ggml_lite.backends.cpu import threadpool as TP  # noqa: E402
from ggml_lite.backends.cpu.compute import _PREPARED  # noqa: E402


def _node_bytes(gf):
    import backend_ops_cases as B
    return [B.read_raw(n) for n in gf.nodes if n.view_src is None]


def _scribble(gf):
    import backend_ops_cases as B
    for n in gf.nodes:
        if n.view_src is None:
            B.write_raw(n, np.full(ggml.nbytes(n), 0xA5, np.uint8))


def test_compiled_loop_equals_the_python_loop_on_every_harness_graph():
    """Every graph of the oracle harness (tests/backend_ops_cases.py), at 1-4 threads, every node
    on every thread: the compiled loop writes the same bytes into every node as the Python loop."""
    import backend_ops_cases as B
    native_tasks = python_tasks = 0
    mismatches = []
    for case in B.make_test_cases():
        built = B.build_case(case)
        try:
            case.initialize_tensors(built, np.random.default_rng(B.case_seed(case)))
            for nt in (1, 2, 3, 4):
                plan = ggml.graph_plan(built.gf, nt)
                plan.work_data = np.zeros(max(int(plan.work_size), 0), np.uint8)
                plan.min_work_per_node = 0
                plan.python_loop = True
                assert ggml.graph_compute(built.gf, plan) == Status.SUCCESS
                ref = _node_bytes(built.gf)
                _scribble(built.gf)
                plan.python_loop = False
                assert ggml.graph_compute(built.gf, plan) == Status.SUCCESS
                got = _node_bytes(built.gf)
                if not all(np.array_equal(a, b) for a, b in zip(ref, got)):
                    mismatches.append(f"{case.name()}-nt{nt}")
                kinds = _PREPARED[built.gf].native.prog[:, P.KIND]
                native_tasks += int((kinds != P.TASK_PYTHON).sum())
                python_tasks += int((kinds == P.TASK_PYTHON).sum())
        finally:
            B.free_built(built)
    assert not mismatches, f"{len(mismatches)} graphs differ: {mismatches[:10]}"
    assert native_tasks > 1000 and python_tasks > 1000      # both paths of the program ran


def _failing_and_good(ctx):
    """A graph whose get_rows fails (index out of range) between two shared compiled nodes, and
    a good graph of the same shape."""
    m = ggml.new_tensor_2d(ctx, F32, 8, 4)
    idx = ggml.new_tensor_1d(ctx, Type.I32, 2)
    big = ggml.new_tensor_2d(ctx, F32, 1 << 9, 1 << 8)
    out = ggml.add(ctx, ggml.scale(ctx, big, 2.0), big)
    rows = ggml.get_rows(ctx, m, idx)
    out2 = ggml.scale(ctx, out, 0.5)
    gf = ggml.new_graph(ctx)
    for t in (out, rows, out2):
        ggml.build_forward_expand(gf, t)
    m.numpy()[...] = np.arange(32, dtype=np.float32).reshape(m.numpy().shape)
    return gf, idx, big, out2, rows


@pytest.mark.parametrize("n, poll", [(10_000, None), (3_000, 0)])
def test_alternating_failing_and_good_graphs_never_hang(n, poll):
    """n computes at 2 threads alternating a graph that fails in a node, a graph aborted by the
    callback, and a good graph: each failure is reported, no worker is left waiting, and every
    good result is right. On the default pool the worker polls between computes; on a pool with
    poll=0 it sleeps after every compute and each kickoff must wake it."""
    ctx = ggml.init(8 << 20)
    gf, idx, big, out2, rows = _failing_and_good(ctx)
    tp = None if poll is None else ggml.threadpool_new(2, poll=poll)
    plan = ggml.graph_plan(gf, 2, tp)
    plan.work_data = np.zeros(plan.work_size, np.uint8)
    done = []

    def body():
        for i in range(n):
            big.numpy()[...] = i % 7
            which = i % 3
            idx.numpy()[...] = [1, 9] if which == 0 else [3, 1]
            plan.abort_callback = (lambda d: True) if which == 1 else None
            if which == 0:
                with pytest.raises(ggml.GGMLError, match=r"\(GET_ROWS\) failed on thread 0: .*out of range"):
                    ggml.graph_compute(gf, plan)
            elif which == 1:
                assert ggml.graph_compute(gf, plan) == Status.ABORTED and plan.aborted_at == 1
            else:
                assert ggml.graph_compute(gf, plan) == Status.SUCCESS
                assert (out2.numpy() == 1.5 * (i % 7)).all()
                assert rows.numpy().reshape(-1).tolist() == list(range(24, 32)) + list(range(8, 16))
        done.append(True)
    t = threading.Thread(target=body)
    t.start()
    t.join(timeout=240)
    assert not t.is_alive(), "a compute hung"
    assert done == [True]
    native = _PREPARED[gf].native
    kinds = native.prog[:, P.KIND]
    assert (kinds == P.TASK_PYTHON).sum() == 0 and (kinds == P.TASK_GET_ROWS).sum() == 1
    # get_rows is compiled; only its failures call back (to raise the error that names the index)
    assert 0 < native.python_calls <= 2 * len(range(0, n, 3))
    if tp is not None:
        ggml.threadpool_free(tp)


def _wait_for(cond, seconds=120):
    """Wait until cond() holds (a liveness check, not a timing: the limit only ends a hang)."""
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.005)
    return cond()


def test_idle_workers_sleep_and_a_collected_pool_stops_its_threads():
    """Workers poll for a bounded time, then sleep; a kickoff wakes them, for Python jobs and for
    compiled programs alike; the caller is worker 0; a pool nobody holds stops its threads."""
    tp = ggml.threadpool_new(3, poll=1)
    sleeping = lambda: TP.ctl_load(tp._ctl, TP.TP_SLEEPING) == 2   # noqa: E731
    assert _wait_for(sleeping), "idle workers kept spinning"
    who = {}
    tp.run(lambda ith: who.__setitem__(ith, threading.get_ident()))
    assert sorted(who) == [0, 1, 2] and who[0] == threading.get_ident() and len(set(who.values())) == 3
    ctx = ggml.init(8 << 20)
    x = ggml.new_tensor_2d(ctx, F32, 1024, 64)
    y = ggml.scale(ctx, ggml.add(ctx, x, x), 0.5)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, y)
    plan = ggml.graph_plan(gf, 3, tp)
    plan.min_work_per_node = 0                     # every node on all three threads
    for i in range(20):
        assert _wait_for(sleeping), "idle workers kept spinning"
        x.numpy()[...] = i
        assert ggml.graph_compute(gf, plan) == Status.SUCCESS
        assert (y.numpy() == i).all()
    workers = list(tp._workers)
    assert all(w.is_alive() for w in workers)
    del tp, plan, sleeping
    gc.collect()
    for w in workers:
        w.join(timeout=120)
    assert not any(w.is_alive() for w in workers), "a collected pool left its threads running"


def test_a_base_exception_in_a_worker_is_raised_and_the_pool_survives():
    """A call-back that raises what Exception does not cover (SystemExit here) on worker 1 still
    meets the other thread at every barrier; the caller gets it, and the pool computes again."""
    ctx = ggml.init(8 << 20)
    gf, idx, big, out2, rows = _failing_and_good(ctx)
    idx.numpy()[...] = [3, 1]
    tp = ggml.threadpool_new(2)
    plan = ggml.graph_plan(gf, 2, tp)
    plan.work_data = np.zeros(plan.work_size, np.uint8)
    plan.min_work_per_node = 0                     # get_rows on both threads
    ggml.graph_compute(gf, plan)
    k, task = next((k, t) for k, t in enumerate(_PREPARED[gf].tasks) if t.node.op == Op.GET_ROWS)
    good = task.run
    _PREPARED[gf].native.prog[k, P.KIND] = P.TASK_PYTHON     # get_rows is compiled: make it call back

    def exits_on_worker_1(ith, nth):
        if ith == 1:
            raise SystemExit("worker 1 exits")
        good(ith, nth)
    outcome = []

    def body():
        task.run = exits_on_worker_1
        outcome.append(pytest.raises(SystemExit, ggml.graph_compute, gf, plan).value.args)
        task.run = good
        big.numpy()[...] = 2
        outcome.append(ggml.graph_compute(gf, plan))
    t = threading.Thread(target=body)
    t.start()
    t.join(timeout=120)
    assert not t.is_alive(), "a compute hung"
    assert outcome == [("worker 1 exits",), Status.SUCCESS]
    assert (out2.numpy() == 3.0).all()
    assert rows.numpy().reshape(-1).tolist() == list(range(24, 32)) + list(range(8, 16))
    ggml.threadpool_free(tp)


def _count_plans(monkeypatch):
    from ggml_lite.backends.cpu import compute as C
    calls = []
    real = C.graph_plan

    def counted(*a, **kw):
        calls.append(1)
        return real(*a, **kw)
    monkeypatch.setattr(C, "graph_plan", counted)
    return calls


def test_graph_compute_with_ctx_plans_an_unchanged_graph_once(monkeypatch):
    """The second compute of an unchanged graph takes its last plan (no graph_plan); a new
    thread count plans again."""
    calls = _count_plans(monkeypatch)
    ctx = ggml.init(16 << 20)
    x, one = ggml.new_tensor_1d(ctx, F32, 64), ggml.new_tensor_1d(ctx, F32, 64)
    y = x
    for _ in range(50):
        y = ggml.add(ctx, y, one)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, y)
    x.numpy()[...], one.numpy()[...] = 1, 1
    for _ in range(3):
        assert ggml.graph_compute_with_ctx(ctx, gf, 1) == Status.SUCCESS
    assert len(calls) == 1 and (y.numpy() == 51).all()
    ggml.graph_compute_with_ctx(ctx, gf, 2)
    assert len(calls) == 2


def test_graph_compute_with_ctx_never_uses_a_stale_plan(monkeypatch):
    """A graph changed after its compute is planned again: more nodes (one of them needing a work
    buffer the first plan did not have), a node given another source; each result is right."""
    calls = _count_plans(monkeypatch)
    ctx = ggml.init(16 << 20)
    rng = np.random.default_rng(0)
    x, b, c = (ggml.new_tensor_2d(ctx, F32, 64, 4) for _ in range(3))
    w = ggml.new_tensor_2d(ctx, Type.Q8_0, 64, 8)
    for t in (x, b, c):
        t.numpy()[...] = rng.uniform(-1, 1, t.numpy().shape)
    wf = rng.uniform(-1, 1, (8, 64)).astype(np.float32)
    w.numpy()[...] = ggml.quantize_chunk(Type.Q8_0, wf).reshape(w.numpy().shape)
    s = ggml.add(ctx, x, b)
    gf = ggml.new_graph(ctx)
    ggml.build_forward_expand(gf, s)
    ggml.graph_compute_with_ctx(ctx, gf, 2)
    assert np.array_equal(s.numpy(), x.numpy() + b.numpy())
    m = ggml.mul_mat(ctx, w, s)                        # a node with a work buffer: src1 to Q8_0
    ggml.build_forward_expand(gf, m)
    ggml.graph_compute_with_ctx(ctx, gf, 2)
    assert len(calls) == 2
    ref = s.numpy().reshape(4, 64) @ wf.T                # Q8_0 weights and activations: close, not equal
    assert np.abs(m.numpy().reshape(4, 8) - ref).max() < 0.1
    s.src[1] = c                                       # the same nodes, one source changed
    ggml.graph_compute_with_ctx(ctx, gf, 2)
    assert len(calls) == 3 and np.array_equal(s.numpy(), x.numpy() + c.numpy())
    ggml.graph_compute_with_ctx(ctx, gf, 2)
    assert len(calls) == 3                             # and unchanged again: no new plan


def test_a_plan_trusted_by_graph_uid_still_sees_its_changed_fields():
    """A graph the scheduler numbered (uid != 0) computed again with the same plan is not walked
    again, but a trace or min_work_per_node set on the plan since is honoured."""
    ctx = ggml.init(1 << 20)
    gf, x, a, b, f = seed_graph(ctx)
    for t, v in ((x, 2.0), (a, 1.0), (b, 1.0)):
        ggml.set_f32(t, v)
    gf.uid = 424242                                          # as the scheduler numbers its splits
    plan = ggml.graph_plan(gf, 3)
    ggml.graph_compute(gf, plan)                             # compiled, untraced
    plan.trace = []
    ggml.graph_compute(gf, plan)
    assert {ith for ith, *_ in plan.trace} == {0} and len(plan.trace) == 3
    plan.min_work_per_node, plan.trace = 0, []
    ggml.graph_compute(gf, plan)
    assert sorted((i, ith) for ith, i, *_ in plan.trace) == [(i, t) for i in range(3) for t in range(3)]
    assert ggml.get_f32_1d(f, 0) == 5.0
