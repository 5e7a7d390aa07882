"""The oracle harness of the cpu chapters (tests/backend_ops_cases.py, ggml's test-backend-ops)
run through the backend API: tensors in a backend's buffer (backend_alloc_ctx_tensors), compute
with backend_graph_compute. Every case on the CPU backend; on BLAS every case it claims, and
every other case refused."""
import pytest

import ggml_lite as ggml
from ggml_lite import GGMLError

B = pytest.importorskip("backend_ops_cases", reason="the harness of the cpu chapters is not here")

try:                     # the kernels' known failures, as the compute chapter's harness lists them
    from test_backend_ops import _known as known_failure
except ImportError:
    def known_failure(case):
        return None

HARNESS_CASES = B.make_test_cases()
HARNESS_THREADS = 2
_BACKENDS = {}


def shared_backend(name):
    """One backend per kind for the harness runs (as a program would keep its streams)."""
    if name not in _BACKENDS:
        _BACKENDS[name] = ggml.backend_cpu_init() if name == "CPU" else ggml.backend_blas_init()
        if name == "CPU":
            ggml.backend_cpu_set_n_threads(_BACKENDS[name], HARNESS_THREADS)
    return _BACKENDS[name]


def through(backend):
    """eval_case's hooks for a backend: tensors in its buffer type, compute with backend_graph_compute."""
    return dict(compute=lambda gf, ctx: ggml.backend_graph_compute(backend, gf), no_alloc=True,
                alloc=lambda ctx: ggml.backend_alloc_ctx_tensors(ctx, backend))


def blas_claims(case):
    built = B.build_case(case, no_alloc=True, sentinels=False)
    try:
        blas = shared_backend("BLAS")
        return all(ggml.backend_supports_op(blas, n) for n in built.gf.nodes)
    finally:
        ggml.free(built.ctx)


def _harness_params():
    for case in HARNESS_CASES:
        reason = known_failure(case)
        marks = [pytest.mark.xfail(strict=True, raises=GGMLError, reason=reason)] if reason else []
        yield pytest.param(case, id=case.name(), marks=marks)


@pytest.mark.parametrize("case", list(_harness_params()))
def test_oracle_harness_through_the_cpu_backend(case):
    cpu = shared_backend("CPU")
    built = B.build_case(case, no_alloc=True, sentinels=False)
    assert all(ggml.backend_supports_op(cpu, n) for n in built.gf.nodes), "the CPU claims every case"
    ggml.free(built.ctx)
    verdict = B.eval_case(case, **through(cpu))
    assert verdict.ok, f"{case.name()} on the CPU backend: {verdict}"


BLAS_CASES = [c for c in HARNESS_CASES if blas_claims(c)]


def test_blas_claims_only_large_products_of_the_harness():
    assert len(BLAS_CASES) >= 5
    assert all(c.op == "MUL_MAT" for c in BLAS_CASES)


@pytest.mark.parametrize("case", BLAS_CASES, ids=[c.name() for c in BLAS_CASES])
def test_oracle_harness_through_blas_on_what_it_claims(case):
    verdict = B.eval_case(case, **through(shared_backend("BLAS")))
    assert verdict.ok, f"{case.name()} on BLAS: {verdict}"


def test_blas_refuses_every_other_harness_case():
    blas = shared_backend("BLAS")
    refused, claimed = 0, {id(c) for c in BLAS_CASES}
    for case in HARNESS_CASES:
        if id(case) in claimed:
            continue
        built = B.build_case(case, no_alloc=True, sentinels=False)
        buf = ggml.backend_alloc_ctx_tensors(built.ctx, blas)
        with pytest.raises(GGMLError, match="unsupported node"):
            ggml.backend_graph_compute(blas, built.gf)
        ggml.backend_buffer_free(buf)
        ggml.free(built.ctx)
        refused += 1
    assert refused == len(HARNESS_CASES) - len(BLAS_CASES)
