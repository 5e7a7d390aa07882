"""Per-chapter figures a reader feels: cells, exported-cell lengths, pictures, long code lines.

    python tools/book_stats.py [book/NN_x.ipynb ...]

Exported cell: a code cell whose first line is an `#| export...` directive; its length counts the
lines after the directive. A picture: an image output, or a markdown image. Long line: a code line
(directives excluded) over 88 characters, in any code cell the rendered book shows (cells tagged
remove-cell or remove-input are not shown).
"""
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def stats(path):
    nb = json.loads(Path(path).read_text())
    n_cells = len(nb["cells"])
    exported, pictures, shown, long_lines = [], 0, 0, 0
    for cell in nb["cells"]:
        src = "".join(cell["source"]).splitlines()
        tags = cell.get("metadata", {}).get("tags", [])
        if cell["cell_type"] == "markdown":
            pictures += sum(line.count("![") for line in src) + sum(line.count("<img") for line in src)
            continue
        if cell["cell_type"] != "code":
            continue
        for out in cell.get("outputs", []):
            if any(k.startswith("image/") for k in out.get("data", {})):
                pictures += 1
        if src and src[0].startswith("#| export"):
            exported.append(len(src) - 1)
        if "remove-cell" in tags or "remove-input" in tags:
            continue
        for line in src:
            if line.startswith("#| "):
                continue
            shown += 1
            long_lines += len(line) > 88
    return dict(chapter=Path(path).stem, cells=n_cells, exported=len(exported),
                median=statistics.median(exported) if exported else 0,
                longest=max(exported) if exported else 0,
                over60=sum(n > 60 for n in exported), pictures=pictures,
                long_pct=100.0 * long_lines / shown if shown else 0.0)


def main(paths):
    paths = paths or sorted(str(p) for p in (ROOT / "book").glob("[0-9]*.ipynb"))
    print(f"{'chapter':24} {'cells':>5} {'exp':>4} {'median':>6} {'longest':>7} {'>60':>4} {'pics':>4} {'>88col%':>7}")
    for p in paths:
        s = stats(p)
        print(f"{s['chapter']:24} {s['cells']:5} {s['exported']:4} {s['median']:6.1f} {s['longest']:7} "
              f"{s['over60']:4} {s['pictures']:4} {s['long_pct']:7.1f}")


if __name__ == "__main__":
    main(sys.argv[1:])
