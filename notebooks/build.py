"""Build the notebooks from their ``.py`` sources (percent format) and execute them with nbclient.

    .venv/bin/python notebooks/build.py            # all notebooks
    .venv/bin/python notebooks/build.py 02         # the ones whose name starts with 02

Cells: ``# %%`` starts a code cell, ``# %% [markdown]`` a markdown cell (its lines start with ``# ``).
The kernel is ``python3``: ipykernel's wheel installs that kernelspec into ``.venv/share/jupyter`` and
jupyter_client runs its ``python`` as the current interpreter, so the venv that runs this script runs
the notebooks too (nothing to register).
"""

from __future__ import annotations

import pathlib
import sys
import time

import nbformat
from nbclient import NotebookClient

HERE = pathlib.Path(__file__).resolve().parent
SOURCES = sorted(HERE.glob("[0-9][0-9]_*.py"))


def to_notebook(src: pathlib.Path) -> nbformat.NotebookNode:
    cells, kind, lines = [], None, []

    def flush():
        text = "\n".join(lines).strip("\n")
        if kind == "markdown":
            text = "\n".join(line[2:] if line.startswith("# ") else line.lstrip("#") for line in text.splitlines())
            cells.append(nbformat.v4.new_markdown_cell(text))
        elif kind == "code" and text:
            cells.append(nbformat.v4.new_code_cell(text))

    for line in src.read_text().splitlines():
        if line.startswith("# %%"):
            flush()
            kind, lines = ("markdown" if "[markdown]" in line else "code"), []
        elif kind is not None:
            lines.append(line)
    flush()
    nb = nbformat.v4.new_notebook(cells=cells)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


def execute(nb: nbformat.NotebookNode, timeout: int = 300) -> nbformat.NotebookNode:
    NotebookClient(nb, timeout=timeout, kernel_name="python3", resources={"metadata": {"path": str(HERE)}}).execute()
    return nb


def main(prefixes: list[str]) -> None:
    for src in SOURCES:
        if prefixes and not any(src.name.startswith(p) for p in prefixes):
            continue
        t = time.perf_counter()
        nb = execute(to_notebook(src))
        out = src.with_suffix(".ipynb")
        nbformat.write(nb, out)
        print(f"{out.name}: executed in {time.perf_counter() - t:.1f} s")


if __name__ == "__main__":
    main(sys.argv[1:])
