"""The tiny stack's per-op cost (benchmarks/tiny_stack.py) of several source trees, side by side: is a change to the
runtime faster or slower than a checkout of another commit?

    git worktree add /tmp/old <commit>
    .venv/bin/python benchmarks/tiny_stack_ab.py /tmp/old . [--processes 8] [--rounds 15] [--clock wall]

Each sample is a fresh Python process with ``PYTHONPATH`` set to one tree, running that tree's own
``benchmarks/tiny_stack.py`` helpers (so each patches the kernel entry points its runtime really calls); the trees
take turns, in alternating order, process after process, so that load from other programs on a shared machine
falls on all of them alike. Per process: the best of ``--rounds`` rounds of 20 forwards (``--clock``: CPU time of
the thread, ``time.thread_time``, by default, so that other programs on a shared machine count less; ``process``:
``time.process_time``; ``wall``: ``time.perf_counter``; one intra-op thread), runtime only (kernels replaced by
no-ops) and runtime + kernel (bf16 GEMMs). The table gives the best and the median over processes, per quantized
op, and each tree's ratio to the first tree's.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

# run in the child with PYTHONPATH=<tree>: that tree's dbr_quant and its own benchmark helpers
_CHILD = r"""
import json, os, sys, time, torch
sys.path.insert(0, os.path.join(os.environ["AB_TREE"], "benchmarks"))
import tiny_stack as ts
torch.set_num_threads(1)
torch.manual_seed(0)
model = ts.tiny_stack()
converted = ts.convert_tiny_stack(model)
x = torch.randn(1, ts.WIDTH)
layers = sum(isinstance(m, torch.nn.Linear) for m in model.modules())

def runtime_only():
    with ts.kernels_replaced_by_no_ops():
        converted(x)

clock = {"thread": time.thread_time, "process": time.process_time, "wall": time.perf_counter}[os.environ["AB_CLOCK"]]
best = {"runtime": float("inf"), "fp8": float("inf")}
with torch.no_grad(), ts.use_cpu_gemm("bf16"):
    variants = {"runtime": runtime_only, "fp8": lambda: converted(x)}
    for fn in variants.values():
        for _ in range(5):
            fn()
    for _ in range(int(os.environ["AB_ROUNDS"])):
        for name, fn in variants.items():
            t0 = clock()
            for _ in range(20):
                fn()
            best[name] = min(best[name], (clock() - t0) / 20 / layers * 1e6)
print(json.dumps(best))
"""


CLOCKS = {"thread": "thread CPU time (time.thread_time)", "process": "process CPU time (time.process_time)",
          "wall": "wall time (time.perf_counter)"}


def sample(tree: str, rounds: int, clock: str = "thread") -> dict[str, float]:
    """One process's best per-op figures (µs) for ``tree``."""
    env = dict(os.environ, PYTHONPATH=tree, AB_TREE=tree, AB_ROUNDS=str(rounds), AB_CLOCK=clock)
    # cwd: the tree (``python -c`` puts the working directory first on sys.path)
    done = subprocess.run([sys.executable, "-c", _CHILD], env=env, cwd=tree, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"tiny_stack_ab: the tree {tree} failed:\n{done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="+", help="source trees (repository roots); the first is the baseline")
    parser.add_argument("--processes", type=int, default=8, help="processes per tree")
    parser.add_argument("--rounds", type=int, default=15, help="rounds of 20 forwards per process")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="thread",
                        help="what a round's time is (default: the thread's CPU time)")
    args = parser.parse_args()
    trees = [os.path.abspath(t) for t in args.trees]
    got: dict[str, dict[str, list[float]]] = {t: {"runtime": [], "fp8": []} for t in trees}
    for i in range(args.processes):
        for tree in trees if i % 2 == 0 else trees[::-1]:
            for name, value in sample(tree, args.rounds, args.clock).items():
                got[tree][name].append(value)
    print(f"tiny stack, µs per quantized op ({CLOCKS[args.clock]}): best / median over {args.processes} processes "
          f"per tree (each the best of {args.rounds} rounds), trees interleaved")
    base = got[trees[0]]
    for tree in trees:
        row = got[tree]
        cells = []
        for name, label in (("runtime", "runtime only"), ("fp8", "runtime + kernel")):
            best, median = min(row[name]), statistics.median(row[name])
            ratio = best / min(base[name])
            cells.append(f"{label} {best:5.2f} / {median:5.2f} (best x{ratio:.3f})")
        print(f"{tree}: " + "; ".join(cells))


if __name__ == "__main__":
    main()
