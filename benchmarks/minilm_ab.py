"""MiniLM converted eager ÷ fp32 eager, two source trees side by side (issue #21's "MiniLM rows no slower").

    .venv/bin/python benchmarks/minilm_ab.py <old tree> <new tree> [--processes 6] [--path fp32|bf16]

Trees alternate, one fresh process each (with that tree on ``sys.path`` and as the working directory),
``--processes`` times; each process times the converted MiniLM and fp32 eager in 7 paired rounds at 1 thread
under the forced CPU GEMM path and reports the median ratio at 1 / 8 / 32 sentences. Printed: the median over
a tree's processes, and every process's figures (their spread is the noise to read a difference against).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

CHILD = r'''
import json, sys, torch
sys.path.insert(0, sys.argv[1] + "/benchmarks")
torch.set_num_threads(1)
from harness import minilm, time_interleaved
from dbr_quant.examples.minilm import EVAL_SENTENCES, encode
from dbr_quant.kernels import use_cpu_gemm
m, out = minilm(), {}
for n in (1, 8, 32):
    b = encode(m.tokenizer, (EVAL_SENTENCES * 4)[:n])
    with use_cpu_gemm(sys.argv[2]):
        t = time_interleaved({"fp32": lambda: m.model(**b), "fp8": lambda: m.converted(**b)}, rounds=7)
    out[n] = sorted(x / y for x, y in zip(t["fp8"], t["fp32"]))[3]
print(json.dumps(out))
'''
SIZES = ("1", "8", "32")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs=2)
    parser.add_argument("--processes", type=int, default=6)
    parser.add_argument("--path", default="fp32", choices=("fp32", "bf16"))
    args = parser.parse_args()
    runs: dict[str, list[dict[str, float]]] = {tree: [] for tree in args.trees}
    for _ in range(args.processes):
        for tree in args.trees:
            r = subprocess.run([sys.executable, "-c", CHILD, tree, args.path], cwd=tree, capture_output=True,
                               text=True, env={**os.environ, "PYTHONPATH": tree}, check=True)
            runs[tree].append(json.loads(r.stdout.strip().splitlines()[-1]))
    print(f"MiniLM FP8 converted eager / fp32 eager, {args.path} GEMM path, 1 thread; median over {args.processes} "
          "processes (each the median of 7 paired rounds) at 1 / 8 / 32 sentences, then every process")
    for tree, rs in runs.items():
        med = [sorted(r[n] for r in rs)[len(rs) // 2] for n in SIZES]
        print(f"{tree}: " + " / ".join(f"{v:.3f}" for v in med) + "   all: "
              + ", ".join("/".join(f"{r[n]:.3f}" for n in SIZES) for r in rs))


if __name__ == "__main__":
    main()
