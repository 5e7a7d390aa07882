#!/usr/bin/env python3
"""Tangle the book into the package: book/*.ipynb -> ggml_lite/*.py.

The chapters are the source. Their code cells carry nbdev-style directives on their first lines:

    #| default_exp tensor          the chapter's default target module (ggml_lite/tensor.py)
    #| export                      this cell goes into the default module; its names go into __all__
    #| exporti                     the same, but internal: its names stay out of __all__
    #| export backends.cpu.ops     this one cell goes into another module
    #| module_only                 with an export: the cell's names stay public in their module
                                   (its __all__) but out of the package face, which is ggml's
                                   public headers; `#| module_only a b` does that for a and b only
    #| hide                        the rendered book does not show this cell (tag remove-cell)
    #| hide_input                  the rendered book shows only the cell's output (tag remove-input)

Kernel sources that are not Python (CUDA C) live in markdown cells, so that the book shows them
highlighted and no Python kernel runs them: a markdown cell that is one fenced block whose first
line is an export directive with a file path goes, verbatim, into that file under ggml_lite/:

    ```cuda
    //| export backends/cuda/mmvq.cu
    ... CUDA C ...
    ```

Several cells may write one file (in notebook order); the suffix must be one of SOURCE_SUFFIXES.

Chapters are read in _toc.yml order, cells in notebook order, so the generated files are stable.
The package face ggml_lite/__init__.py re-exports every module's __all__, in that order, less the
names marked `#| module_only` (a module none of whose names is in the face is not imported there).

    python tools/tangle.py            write ggml_lite/ (and tag #| hide cells remove-cell)
    python tools/tangle.py --check    exit 1, naming files, if ggml_lite/ differs from the book
    python tools/tangle.py --list     the chapter notebooks, in order

Only the standard library is used, so the check runs before any virtualenv exists.
"""
from __future__ import annotations

import argparse
import ast
import json
import os
import re
import sys
from pathlib import Path

PACKAGE = "ggml_lite"
DIRECTIVE = re.compile(r"^#\|\s*(\S+)\s*(.*?)\s*$")
HIDE_TAGS = {"hide": "remove-cell", "hide_input": "remove-input"}
SOURCE_SUFFIXES = (".cu", ".cuh")
SOURCE_CELL = re.compile(r"^```[\w+-]*\n//\|\s*export\s+(\S+)\s*\n(.*?)\n?```\s*$", re.S)


class TangleError(Exception):
    pass


# --- reading the book ------------------------------------------------------------------------

def toc_notebooks(root: Path) -> list[Path]:
    """The chapters named in _toc.yml (root first), in order, that are notebooks."""
    entries = []
    for line in (root / "_toc.yml").read_text().splitlines():
        m = re.match(r"^\s*(?:-\s*)?(?:root|file):\s*(\S+)\s*$", line)
        if m:
            entries.append(m.group(1))
    return [root / f"{e}.ipynb" for e in entries if (root / f"{e}.ipynb").exists()]


def split_directives(source: str) -> tuple[list[tuple[str, str]], str]:
    """Leading `#| name arg` lines of a cell, and the code after them."""
    lines = source.splitlines()
    directives = []
    i = 0
    while i < len(lines):
        m = DIRECTIVE.match(lines[i])
        if not m:
            break
        directives.append((m.group(1), m.group(2)))
        i += 1
    return directives, "\n".join(lines[i:]).strip("\n")


def cell_source(cell: dict) -> str:
    src = cell.get("source", "")
    return "".join(src) if isinstance(src, list) else src


def chapter_title(nb: dict, nb_path: str) -> str:
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            for line in cell_source(cell).splitlines():
                if line.startswith("# "):
                    return line[2:].strip()
    raise TangleError(f"{nb_path}: no '# Title' line in any markdown cell")


# --- building modules ------------------------------------------------------------------------

class Module:
    def __init__(self, name: str, title: str, notebook: str):
        self.name = name
        self.notebooks = [notebook]
        self.titles = [title]                        # each notebook's chapter title
        self.cells: list[tuple[str, str, str]] = []  # (notebook, cell id, code)
        self.public: list[str] = []
        self.module_only: set[str] = set()   # public names the package face leaves out

    def add(self, notebook: str, cell_id: str, code: str, public: bool, title: str, module_only=None):
        """module_only: None (every name in the face), True (none), or the names to leave out."""
        if notebook not in self.notebooks:
            self.notebooks.append(notebook)
            self.titles.append(title)
        self.cells.append((notebook, cell_id, code))
        where = f"{notebook} #{cell_id}"
        names = public_names(code, where) if public else []
        if isinstance(module_only, list):
            unknown = [n for n in module_only if n not in names]
            if unknown:
                raise TangleError(f"{where}: '#| module_only' names {', '.join(unknown)}, which the cell does not define")
        for name in names:
            if name not in self.public:
                self.public.append(name)
            if module_only is True or (module_only and name in module_only):
                self.module_only.add(name)

    def face_names(self) -> list[str]:
        return [n for n in self.public if n not in self.module_only]

    def render(self) -> str:
        sources = ", ".join(self.notebooks)
        titles = self.titles
        title = titles[0] if len(titles) == 1 else "Written by the chapters: " + "; ".join(f"\u201c{t}\u201d" for t in titles)
        out = [f'"""{title}"""', f"# AUTOGENERATED from {sources} — edit the notebook, then run make tangle", ""]
        out.append("__all__ = [" + ", ".join(repr(n) for n in self.public) + "]")
        for notebook, cell_id, code in self.cells:
            out += ["", f"# %% {notebook} #{cell_id}", code]
        return "\n".join(out) + "\n"


class Source:
    """A non-Python file (CUDA C) made of the fenced markdown cells that export to it."""

    def __init__(self, path: str, notebook: str):
        self.path = path
        self.notebooks = [notebook]
        self.cells: list[tuple[str, str, str]] = []

    def add(self, notebook: str, cell_id: str, code: str):
        if notebook not in self.notebooks:
            self.notebooks.append(notebook)
        self.cells.append((notebook, cell_id, code))

    def render(self) -> str:
        out = [f"// AUTOGENERATED from {', '.join(self.notebooks)} — edit the notebook, then run make tangle"]
        for notebook, cell_id, code in self.cells:
            out += ["", f"// %% {notebook} #{cell_id}", code]
        return "\n".join(out) + "\n"


def source_cell(cell: dict, rel: str):
    """(path, code) of a markdown cell that exports a kernel source file, else None."""
    src = cell_source(cell).strip()
    lines = src.split("\n", 2)
    if len(lines) < 2 or not lines[0].startswith("```") or not lines[1].startswith("//|"):
        return None
    m = SOURCE_CELL.match(src)
    if not m:
        raise TangleError(f"{rel}: a markdown cell with '//| export' must be one fenced block whose "
                          f"first line is '//| export path/file.cu'")
    path, code = m.group(1), m.group(2).strip("\n")
    if not path.endswith(SOURCE_SUFFIXES) or path.startswith("/") or ".." in path.split("/"):
        raise TangleError(f"{rel}: '//| export {path}': a source file must be a relative path inside "
                          f"{PACKAGE}/ ending in one of {', '.join(SOURCE_SUFFIXES)}")
    if "id" not in cell:
        raise TangleError(f"{rel}: an exported cell has no id (nbformat >= 4.5 needed)")
    return path, code


def public_names(code: str, where: str) -> list[str]:
    """Top-level names a cell defines: def, class, assignment. `_private` names stay out."""
    try:
        tree = ast.parse(code)
    except SyntaxError as e:
        raise TangleError(f"{where}: exported cell does not parse: {e}") from None
    names = []
    for node in tree.body:
        targets = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            targets = [node.name]
        elif isinstance(node, ast.Assign):
            for t in node.targets:
                targets += [n.id for n in ast.walk(t) if isinstance(n, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            targets = [node.target.id]
        for n in targets:
            dunder = n.startswith("__") and n.endswith("__") and n != "__all__"
            if (not n.startswith("_") or dunder) and n not in names:
                names.append(n)
    return names


def module_path(name: str, packages: set[str]) -> str:
    parts = name.split(".")
    if name in packages:
        return "/".join([PACKAGE, *parts, "__init__.py"])
    return "/".join([PACKAGE, *parts[:-1], parts[-1] + ".py"])


def read_chapters(root: Path) -> tuple[dict[str, Module], list[tuple[Path, dict]]]:
    modules, _, books = read_book(root)
    return modules, books


def read_book(root: Path) -> tuple[dict[str, Module], dict[str, Source], list[tuple[Path, dict]]]:
    """The modules, the kernel sources and the notebooks of the chapters in _toc.yml."""
    modules: dict[str, Module] = {}
    sources: dict[str, Source] = {}
    books = []
    for path in toc_notebooks(root):
        rel = path.relative_to(root).as_posix()
        nb = json.loads(path.read_text())
        books.append((path, nb))
        default = None
        title = None
        for cell in nb["cells"]:
            if cell["cell_type"] == "markdown":
                found = source_cell(cell, rel)
                if found:
                    sources.setdefault(found[0], Source(found[0], rel)).add(rel, cell["id"], found[1])
            if cell["cell_type"] != "code":
                continue
            directives, code = split_directives(cell_source(cell))
            only = [arg.split() or True for name, arg in directives if name == "module_only"]
            if only and not any(name == "export" for name, _ in directives):
                raise TangleError(f"{rel}: '#| module_only' needs '#| export' (an exporti or unexported "
                                  f"cell has no public names)")
            for name, arg in directives:
                if name == "default_exp":
                    default = arg
                elif name in ("export", "exporti"):
                    target = arg or default
                    if not target:
                        raise TangleError(f"{rel}: '#| {name}' before any '#| default_exp'")
                    if "id" not in cell:
                        raise TangleError(f"{rel}: an exported cell has no id (nbformat >= 4.5 needed)")
                    title = title or chapter_title(nb, rel)
                    mod = modules.setdefault(target, Module(target, title, rel))
                    mod.add(rel, cell["id"], code, public=(name == "export"), title=title,
                            module_only=only[0] if only else None)
                elif name != "module_only" and name not in HIDE_TAGS:
                    raise TangleError(f"{rel}: unknown directive '#| {name}'")
    return modules, sources, books


def face(modules: dict[str, Module]) -> str:
    """ggml_lite/__init__.py: every module's public names but the module_only ones, in book order."""
    out = ['"""ggml_lite: ggml, layer by layer, as a book that builds a library."""',
           "# AUTOGENERATED by tools/tangle.py from the book's chapters in _toc.yml order — do not edit", ""]
    owner: dict[str, str] = {}
    for mod in modules.values():
        shown = mod.face_names()
        if not shown:
            continue
        for n in shown:
            if n in owner:
                raise TangleError(f"'{n}' is public in both ggml_lite.{owner[n]} and ggml_lite.{mod.name}")
            owner[n] = mod.name
        if len(shown) == len(mod.public):
            out.append(f"from .{mod.name} import *  # noqa: F401,F403  ({', '.join(mod.notebooks)})")
        else:
            out.append(f"from .{mod.name} import (  # noqa: F401  ({', '.join(mod.notebooks)})")
            out += [f"    {n}," for n in shown] + [")"]
    out += ["", "__all__ = [" + ", ".join(repr(n) for n in owner) + "]"]
    return "\n".join(out) + "\n"


def tangle(root: Path) -> dict[str, str]:
    """Every file under ggml_lite/ as the book produces it: {relative path: text}."""
    return {path: text for path, (text, _) in build(root).items()}


def build(root: Path) -> dict[str, tuple[str, str]]:
    """{relative path: (text, the notebooks it comes from)}."""
    modules, sources, _ = read_book(root)
    if "__init__" in modules:
        raise TangleError("no chapter may export to __init__: the package face is generated")
    names = set(modules)
    packages = {".".join(n.split(".")[:i]) for n in names for i in range(1, len(n.split(".")))}
    files = {}
    for name, mod in modules.items():
        files[module_path(name, packages)] = (mod.render(), ", ".join(mod.notebooks))
    for pkg in sorted(packages - names):
        text = f'"""ggml_lite.{pkg}"""\n# AUTOGENERATED by tools/tangle.py — do not edit\n'
        files[module_path(pkg, packages)] = (text, "tools/tangle.py")
    files[f"{PACKAGE}/__init__.py"] = (face(modules), "tools/tangle.py and _toc.yml")
    for path, source in sources.items():
        target = f"{PACKAGE}/{path}"
        if target in files:
            raise TangleError(f"{target} is written both as a module and as a kernel source")
        files[target] = (source.render(), ", ".join(source.notebooks))
    return files


# --- the #| hide cells -----------------------------------------------------------------------

def hide_tags(books: list[tuple[Path, dict]]) -> list[Path]:
    """Tag `#| hide` cells remove-cell and `#| hide_input` cells remove-input (and no others).
    Changes the notebooks in memory; returns the paths of those changed."""
    changed = []
    for path, nb in books:
        dirty = False
        for cell in nb["cells"]:
            if cell["cell_type"] != "code":
                continue
            directives, _ = split_directives(cell_source(cell))
            want = [HIDE_TAGS[d] for d, _ in directives if d in HIDE_TAGS]
            tags = cell.setdefault("metadata", {}).get("tags", [])
            kept = [t for t in tags if t not in HIDE_TAGS.values()]
            if sorted(tags) != sorted(kept + want):
                if kept + want:
                    cell["metadata"]["tags"] = kept + want
                else:
                    cell["metadata"].pop("tags", None)
                dirty = True
        if dirty:
            changed.append(path)
    return changed


# --- write and check -------------------------------------------------------------------------

def on_disk(root: Path) -> dict[str, str]:
    pkg = root / PACKAGE
    files = {}
    if pkg.exists():
        for p in sorted(pkg.rglob("*")):
            if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith((".pyc", ".nbi", ".nbc")):
                files[p.relative_to(root).as_posix()] = p.read_text()
    return files


def check(root: Path) -> list[str]:
    want = build(root)
    have = on_disk(root)
    _, books = read_chapters(root)
    problems = []
    for path, (text, src) in want.items():
        if path not in have:
            problems.append(f"{path} is missing: run make tangle ({src})")
        elif have[path] != text:
            problems.append(f"{path} differs from what {src} produces: edit the notebook, then run make tangle")
    for path in have:
        if path not in want:
            problems.append(f"{path} comes from no notebook: move its code into a chapter, or delete it")
    for nb in hide_tags(books):
        problems.append(f"{nb.relative_to(root).as_posix()}: '#| hide'/'#| hide_input' cells and their remove-* tags disagree: run make tangle")
    return problems


def _clear_numba_caches(root: Path) -> list[str]:
    """numba's cache (cache=True) is keyed on each function's own source file: a cached kernel
    keeps the compiled code of every function it calls from other modules, so after a module
    changes the old code would run on. Dropping every cached kernel of the package after a write
    makes the next run compile them from the new modules."""
    dirs = [root / "ggml_lite"]
    env = os.environ.get("NUMBA_CACHE_DIR")
    if env and Path(env).resolve().is_relative_to(root.resolve()):
        dirs.append(Path(env))
    stale = [p for d in dirs if d.is_dir() for p in d.rglob("*") if p.suffix in (".nbi", ".nbc")]
    for p in stale:
        p.unlink(missing_ok=True)
    return [f"cleared {len(stale)} numba cache files (kernels compile again on first use)"] if stale else []


def write(root: Path) -> list[str]:
    want = tangle(root)
    have = on_disk(root)
    written = []
    for path in have:
        if path not in want:
            (root / path).unlink()
            written.append(f"removed {path}")
    for path, text in want.items():
        if have.get(path) != text:
            (root / path).parent.mkdir(parents=True, exist_ok=True)
            (root / path).write_text(text)
            written.append(f"wrote {path}")
    if written:
        written += _clear_numba_caches(root)
    _, books = read_chapters(root)
    for path in hide_tags(books):
        nb = next(nb for p, nb in books if p == path)
        path.write_text(json.dumps(nb, indent=1, ensure_ascii=False) + "\n")
        written.append(f"tagged #| hide cells in {path.relative_to(root).as_posix()}")
    return written


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare instead of writing; exit 1 on any difference")
    ap.add_argument("--list", action="store_true", help="print the chapter notebooks in _toc.yml order")
    ap.add_argument("--root", type=Path, default=Path(__file__).resolve().parent.parent)
    args = ap.parse_args(argv)
    try:
        if args.list:
            print("\n".join(p.relative_to(args.root).as_posix() for p in toc_notebooks(args.root)))
            return 0
        if args.check:
            problems = check(args.root)
            for p in problems:
                print(f"tangle --check: {p}")
            if problems:
                return 1
            print(f"tangle --check: ggml_lite/ agrees with the book ({len(tangle(args.root))} files)")
            return 0
        for line in write(args.root) or ["ggml_lite/ already agrees with the book"]:
            print(f"tangle: {line}")
        return 0
    except TangleError as e:
        print(f"tangle: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
