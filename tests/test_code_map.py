"""The appendix book/91_code_map.ipynb: what its stored tables claim is true of the package.

The map is computed by the chapter; these tests re-check each claim independently, from the
module files' own text (the tangler's `# %% book/NN_x.ipynb` cell markers), and check the symbol
list of tests/data/ggml_symbols.json (written by tests/ggml_ref/symbols_ref.py from ggml 0.15.3).
"""
import importlib
import json
import re
from pathlib import Path

import pytest

import ggml_lite

ROOT = Path(__file__).resolve().parent.parent
SYMBOLS = json.loads((ROOT / "tests" / "data" / "ggml_symbols.json").read_text())
HEADERS = SYMBOLS["headers"]
NB = json.loads((ROOT / "book" / "91_code_map.ipynb").read_text())
TOC = set(re.findall(r"^\s*(?:-\s*)?(?:file|root):\s*(\S+)", (ROOT / "_toc.yml").read_text(), re.M))
INTERFACES = ["ggml_backend_buffer_type_i", "ggml_backend_buffer_i", "ggml_backend_i",
              "ggml_backend_device_i", "ggml_backend_reg_i"]


def source(cell):
    return "".join(cell["source"])


def output(cell):
    return "".join("".join(o.get("text", "")) for o in cell.get("outputs", []))


def cells_calling(fn):
    """{header: stored output} of the code cells whose source is `fn("header")`."""
    found = {}
    for cell in NB["cells"]:
        m = re.fullmatch(rf'{fn}\("([^"]+)"\)\s*', source(cell)) if cell["cell_type"] == "code" else None
        if m:
            found[m.group(1)] = output(cell)
    return found


IMPLEMENTED = cells_calling("show_implemented")
MISSING = cells_calling("show_missing")


def rows(text):
    """(ggml symbol, ggml_lite name, module, chapter) of an implemented table. The table
    writes "·" for the name the rule gives (the symbol without ggml_) and a chapter by its
    number ("07a" for book/07a_backend_buffers): both expanded here."""
    out = []
    for line in text.splitlines():
        if line.startswith("ggml_") and len(line.split()) == 4:
            symbol, name, module, chapter = line.split()
            name = symbol.removeprefix("ggml_") if name == "·" else name
            full = [c for c in TOC if c.startswith(f"book/{chapter}_")]
            out.append((symbol, name, module, full[0] if len(full) == 1 else chapter))
    return out


def missing_names(text):
    return [w for line in text.splitlines()[1:] for w in line.split()]


def defined_in(module_name, name):
    """The chapter whose cell defines `name` at top level of ggml_lite.<module_name>, or None."""
    module = importlib.import_module("ggml_lite." + module_name)
    text = Path(module.__file__).read_text()
    m = re.search(rf"^(?:(?:def|class)\s+{re.escape(name)}\b|{re.escape(name)}\s*[:=])", text, re.M)
    if m is None:
        return None
    marks = re.findall(r"^# %% (book/[^ .]+)\.ipynb", text[:m.start()], re.M)
    return marks[-1] if marks else None


# --- the symbol list ------------------------------------------------------------------------

def test_symbols_cover_the_headers():
    assert SYMBOLS["ggml_version"] == "0.15.3"
    assert list(HEADERS) == ["ggml.h", "ggml-backend.h", "ggml-alloc.h", "ggml-cpu.h", "ggml-blas.h",
                             "ggml-rpc.h", "ggml-cuda.h", "src/ggml-backend-impl.h", "src/ggml-backend.cpp"]


def test_symbol_counts_are_sane():
    fns = {h: len(d["functions"]) for h, d in HEADERS.items()}
    assert 300 <= fns["ggml.h"] <= 500, fns            # every op constructor, with its _inplace twin
    assert 80 <= fns["ggml-backend.h"] <= 200, fns
    assert 5 <= fns["ggml-alloc.h"] <= 30 and 30 <= fns["ggml-cpu.h"] <= 100, fns
    assert all(1 <= fns[h] <= 20 for h in ("ggml-blas.h", "ggml-rpc.h", "ggml-cuda.h")), fns
    assert fns["src/ggml-backend-impl.h"] == fns["src/ggml-backend.cpp"] == 0


def test_symbol_names_are_clean_and_unique():
    """Each name once per kind across the public headers (ggml-backend.h has both a function and a
    struct ggml_backend_graph_copy; src/ggml-backend.cpp defines the struct ggml-backend.h declares)."""
    for kind in ("functions", "structs"):
        seen = set()
        for header, d in HEADERS.items():
            names = d[kind]
            assert all(re.fullmatch(r"ggml_\w+", n) for n in names), (header, kind)
            assert len(names) == len(set(names)), (header, kind)
            if not header.startswith("src/"):
                assert not seen & set(names), (header, seen & set(names))
                seen |= set(names)


@pytest.mark.parametrize("header,kind,name", [
    ("ggml.h", "functions", "ggml_mul_mat"), ("ggml.h", "functions", "ggml_add1"),   # a deprecated one too
    ("ggml.h", "structs", "ggml_tensor"), ("ggml.h", "structs", "ggml_context"), ("ggml.h", "structs", "ggml_cgraph"),
    ("ggml-backend.h", "functions", "ggml_backend_sched_graph_compute_async"),
    ("ggml-backend.h", "structs", "ggml_backend_sched"), ("ggml-alloc.h", "functions", "ggml_gallocr_new"),
    ("ggml-alloc.h", "structs", "ggml_tallocr"), ("ggml-cpu.h", "functions", "ggml_graph_compute"),
    ("ggml-cpu.h", "structs", "ggml_cplan"), ("ggml-blas.h", "functions", "ggml_backend_blas_init"),
    ("ggml-rpc.h", "functions", "ggml_backend_rpc_start_server"), ("ggml-cuda.h", "functions", "ggml_backend_cuda_init"),
    ("src/ggml-backend.cpp", "structs", "ggml_backend_sched"),
])
def test_symbols_known_to_be_there(header, kind, name):
    assert name in HEADERS[header][kind]


def test_interface_structs_literally():
    assert HEADERS["src/ggml-backend-impl.h"]["structs"] == INTERFACES


# --- the per-header tables ------------------------------------------------------------------

def test_every_header_has_its_two_tables():
    assert set(IMPLEMENTED) == set(MISSING) == set(HEADERS)
    assert all(rows(IMPLEMENTED[h]) for h in ("ggml.h", "ggml-backend.h", "ggml-alloc.h")), "outputs not stored"


@pytest.mark.parametrize("header", list(HEADERS))
def test_tables_account_for_every_symbol_once(header):
    listed = [r[0] for r in rows(IMPLEMENTED[header])] + missing_names(MISSING[header])
    symbols = HEADERS[header]["functions"] + HEADERS[header]["structs"]
    assert sorted(listed) == sorted(symbols)


@pytest.mark.parametrize("header", list(HEADERS))
def test_implemented_rows_are_true(header):
    functions = set(HEADERS[header]["functions"])
    for symbol, name, module, chapter in rows(IMPLEMENTED[header]):
        mod = importlib.import_module("ggml_lite." + module)
        assert name in mod.__all__, (symbol, name, module)
        obj = getattr(mod, name)
        if symbol in functions:
            assert name == symbol.removeprefix("ggml_") and callable(obj), (symbol, name)
        else:
            assert isinstance(obj, type), (symbol, name)
        assert defined_in(module, name) == chapter, (symbol, name, module, chapter)
        assert chapter in TOC, chapter


@pytest.mark.parametrize("header", list(HEADERS))
def test_missing_functions_are_missing(header):
    """A function the map calls not implemented has no public ggml_lite name under the rule."""
    functions = set(HEADERS[header]["functions"])
    for symbol in missing_names(MISSING[header]):
        if symbol in functions:
            assert symbol.removeprefix("ggml_") not in ggml_lite.__all__, symbol


def test_summary_counts_agree_with_the_tables():
    cell = next(c for c in NB["cells"] if c["cell_type"] == "code" and output(c).startswith("header "))
    summary = {line.split()[0]: line.split()[1:] for line in output(cell).splitlines()[1:]}
    assert set(summary) == set(HEADERS)
    for header, (fns, structs) in summary.items():
        done = {r[0] for r in rows(IMPLEMENTED[header])}
        for cellval, kind in ((fns, "functions"), (structs, "structs")):
            names = HEADERS[header][kind]
            want = f"{len(done & set(names))}/{len(names)}" if names else "–"
            assert cellval == want, (header, kind, cellval, want)


# --- the architecture table -----------------------------------------------------------------

def concept_rows():
    cell = next(c for c in NB["cells"] if c["cell_type"] == "markdown" and "| concept | ggml file |" in source(c))
    out = []
    for line in source(cell).splitlines():
        cells = [c.strip().strip("`") for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[0] not in ("concept",) and not set(cells[0]) <= {"-"}:
            out.append(cells)
    return out


def test_concept_table_names_the_spec_concepts():
    symbols = {r[2] for r in concept_rows()}
    for s in ("ggml_tensor", "ggml_context", "ggml_cgraph", "ggml_threadpool", "ggml_barrier", "ggml_backend_i",
              "ggml_backend_sched", "ggml_backend_sched_split_graph", "ggml_backend_load_all", "ggml_gallocr_new"):
        assert s in symbols, s


@pytest.mark.parametrize("row", concept_rows(), ids=lambda r: r[2])
def test_concept_table_rows_are_true(row):
    _, ggml_file, symbol, name, module, chapter = row
    assert re.fullmatch(r"(include|src)/[\w./-]+\.(h|c|cpp)", ggml_file), ggml_file
    top, _, attr = name.partition(".")
    mod = importlib.import_module("ggml_lite." + module)
    assert top in mod.__all__ or (top.islower() and hasattr(mod, top)), (name, module)   # a public name, or an internal function
    obj = getattr(mod, top)
    if attr:
        assert callable(getattr(obj, attr)), name
    assert defined_in(module, top) == "book/" + chapter, (name, module, chapter)
    assert "book/" + chapter in TOC, chapter
