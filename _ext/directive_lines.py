"""Sphinx extension: the rendered book shows code, not the tangler's directive lines.

A chapter's code cell may start with `#| export`, `#| exporti backends.cpu`, `#| module_only`,
`#| default_exp tensor`, ... (tools/tangle.py reads them). They matter to the package, not to a
reader: this drops them from the shown source, and drops a cell whose source was nothing but
directives (and that has no output). nbval's markers (`# NBVAL_IGNORE_OUTPUT`) are the test
runner's, not the reader's, and go the same way. A markdown cell that is one fenced CUDA block starts with
`//| export backends/cuda/FILE` instead; that line goes too. The notebooks themselves are
unchanged.
"""
import re

from docutils import nodes

DIRECTIVE = re.compile(r"#\|\s|# NBVAL_")   # the tangler's lines and nbval's markers
C_DIRECTIVE = re.compile(r"//\|\s")         # the first line of a fenced .cu block


def strip_directives(source, directive=DIRECTIVE):
    """The source without its leading directive lines (and the blank lines right after them)."""
    lines = source.split("\n")
    i = 0
    while i < len(lines) and directive.match(lines[i]):
        i += 1
    if i == 0:
        return source
    while i < len(lines) and not lines[i].strip():
        i += 1
    return "\n".join(lines[i:])


def _code_cells(doctree):
    for cell in doctree.findall(nodes.container):
        if cell.get("nb_element") == "cell_code":
            yield cell


def drop_directive_lines(app, doctree):
    for cell in list(_code_cells(doctree)):
        for block in cell.findall(nodes.literal_block):
            parent = block.parent
            if parent is None or parent.get("nb_element") != "cell_code_source":
                continue
            text = strip_directives(block.astext())
            if text == block.astext():
                continue
            if not text.strip():
                parent.parent.remove(parent)            # nothing left to show of the source
                continue
            block.rawsource = text                      # what Sphinx highlights
            block.children = [nodes.Text(text)]
        if not any(c.get("nb_element") in ("cell_code_source", "cell_code_output")
                   for c in cell.children if isinstance(c, nodes.Element)):
            cell.parent.remove(cell)                    # a directive-only cell without output


def drop_c_directive_lines(app, doctree):
    """Fenced blocks of markdown cells (CUDA sources) lose their leading `//| ...` lines."""
    for block in list(doctree.findall(nodes.literal_block)):
        parent = block.parent
        if parent is not None and parent.get("nb_element") == "cell_code_source":
            continue
        text = strip_directives(block.astext(), C_DIRECTIVE)
        if text == block.astext():
            continue
        if not text.strip():
            parent.remove(block)
            continue
        block.rawsource = text
        block.children = [nodes.Text(text)]


def setup(app):
    app.connect("doctree-read", drop_directive_lines)
    app.connect("doctree-read", drop_c_directive_lines)
    return {"parallel_read_safe": True, "parallel_write_safe": True, "version": "1"}
