"""The layering the architecture page (docs/architecture.md) draws, checked on the source: data flows one way."""

from __future__ import annotations

from import_graph import read_graph

# Lowest first. A module may import from its own layer or a lower one, never a higher one. An entry names a
# folder or module under dbr_quant/ (the longest that matches decides): the accelerate integration is what the
# runtime asks about hooks and offloaded weights, below it; distributed calibration merges the runtime's
# observers and Hessians for api.convert, above it.
LAYERS: list[tuple[str, ...]] = [
    ("formats",),
    ("kernels",),
    ("observers",),
    ("qconfig",),
    ("quantize",),
    ("ops",),
    ("moe",),
    ("integrations.accelerate",),
    ("runtime",),
    ("integrations.distributed",),
    ("api",),
    ("checkpoints", "fx_rewriter", "inspect"),
    ("__main__", "examples"),
]
MAX_TOP_LEVEL_MODULES = 8
MAX_LOCAL_IMPORTS = 5


def _layer(module: str) -> int | None:
    name = module.removeprefix("dbr_quant.")
    if name == "dbr_quant":  # the package's __init__: the public re-exports, above everything
        return None
    matches = [(len(entry), rank) for rank, names in enumerate(LAYERS) for entry in names
               if name == entry or name.startswith(entry + ".")]
    if matches:
        return max(matches)[1]
    raise AssertionError(f"{module}: not in any layer of tests/test_architecture.py; add its folder to LAYERS")


GRAPH = read_graph()


def test_every_import_goes_down_the_layers():
    upward = []
    for module, targets in GRAPH.edges.items():
        for target in targets:
            low, high = _layer(module), _layer(target)
            if low is not None and high is not None and high > low:
                upward.append(f"{module} imports {target}")
    assert not upward, "imports against the layering (lowest first: " + " -> ".join(
        " | ".join(names) for names in LAYERS) + "):\n" + "\n".join(sorted(upward))


def test_no_import_cycles():
    assert GRAPH.cycles() == []


def test_few_modules_at_the_top():
    assert len(GRAPH.top_level_modules()) <= MAX_TOP_LEVEL_MODULES, GRAPH.top_level_modules()


def test_imports_inside_functions_are_few_and_say_why():
    local = GRAPH.local_imports
    assert len(local) <= MAX_LOCAL_IMPORTS, "\n".join(f"{li.module}:{li.line} -> {li.target}" for li in local)
    assert all(li.commented for li in local), [f"{li.module}:{li.line}" for li in local if not li.commented]
