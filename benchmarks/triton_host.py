"""Host-side Python cost of the Triton backend's wrappers at decode size (M = 1, K = N = 4096), measured on the CPU.

On a GPU a decode step is bound by the host: every FP8 linear runs our Python (entry point, checks, scale and output
tensors, launch arguments) before Triton's own launch. This measures that Python without a GPU: the wrappers run
under the ``triton-interpret`` backend on CPU tensors with the kernel launch replaced by a stub (Triton's
``InterpretedFunction.__getitem__`` returns a function that takes the arguments and does nothing), so what is timed is
everything up to the launch (``Kernel.__getitem__`` included) and nothing of Triton's. Per row: µs per call (best
and median over processes, each the best of ``--rounds`` rounds of ``--calls`` calls, CPU time of the thread), the
stubbed launch alone with the same arguments (the floor: what ``kernel[grid](...)`` with ~40 arguments costs in
Python before Triton's work), and the aten ops one call runs (all of them / those that allocate: on a GPU each
costs host time, ≈ 3-5 µs per CUDA allocation or copy against < 1 µs on the CPU, so the counts carry over and the
CPU µs do not; counted by a TorchDispatchMode, under which ``view(dtype)`` shows as a view and a detach).

    python benchmarks/triton_host.py                      # this tree
    python benchmarks/triton_host.py /work/main .         # trees side by side, alternating fresh processes
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable

M, K, N = 1, 4096, 4096
ALLOCATING = ("empty", "zeros", "ones", "full", "_to_copy", "copy", "clone", "reciprocal", "contiguous", "new_")


def cases() -> dict[str, Callable[[], object]]:
    """Each row's call, on decode-size CPU tensors (imports here: the tree comes from PYTHONPATH)."""
    import torch

    from dbr_quant import kernels
    from dbr_quant.formats import FP8Format
    from dbr_quant.kernels.triton import gemm, quantize, weight_only_gemm

    gen = torch.Generator().manual_seed(0)
    x_q = torch.randn(M, K, generator=gen).to(torch.float8_e4m3fn)
    x_q3 = x_q.reshape(1, M, K)  # (batch, sequence, hidden): what a converted model passes
    w_q = torch.randn(N, K, generator=gen).to(torch.float8_e4m3fn)
    w13_q = torch.randn(2 * N, K, generator=gen).to(torch.float8_e4m3fn)
    sx, sw = torch.tensor(0.02), torch.tensor(0.01)
    sx_token, sw_channel = torch.rand(M, 1, generator=gen) + 0.01, torch.rand(N, generator=gen) + 0.01
    sw13_channel, h_scale = torch.rand(2 * N, generator=gen) + 0.01, torch.tensor(0.05)
    x_bf16 = torch.randn(M, K, generator=gen).to(torch.bfloat16)
    bf16 = torch.bfloat16
    return {
        "fp8_linear per-tensor, bf16 out": lambda: gemm.fp8_linear(x_q, sx, w_q, sw, out_dtype=bf16),
        "fp8_linear per-token/channel, bf16 out": lambda: gemm.fp8_linear(x_q, sx_token, w_q, sw_channel,
                                                                          out_dtype=bf16),
        "fp8_linear per-tensor, FP8 out": lambda: gemm.fp8_linear(x_q, sx, w_q, sw, out_scale=h_scale),
        "fp8_linear swiglu (gated), FP8 out": lambda: gemm.fp8_linear(x_q, sx_token, w13_q, sw13_channel,
                                                                      activation="swiglu", out_scale=h_scale),
        "fp8_weight_only_linear, bf16": lambda: weight_only_gemm.fp8_weight_only_linear(x_bf16, w_q, sw_channel,
                                                                                        out_dtype=bf16),
        "dynamic_quantize per-token, bf16 x": lambda: quantize.dynamic_quantize(x_bf16, FP8Format.E4M3, True),
        "kernels.fp8_linear (entry point), per-tensor": lambda: kernels.fp8_linear(x_q, sx, w_q, sw, out_dtype=bf16),
        "kernels.fp8_linear, x (1, 1, K) as in a model": lambda: kernels.fp8_linear(x_q3, sx, w_q, sw, out_dtype=bf16),
        "kernels.dynamic_quantize (entry point)": lambda: kernels.dynamic_quantize(x_bf16, FP8Format.E4M3, True),
    }


def measure(rounds: int, calls: int) -> dict[str, list[float]]:
    """{row: [µs per call, µs of the stubbed launch alone, aten ops, allocating aten ops]} in this process."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from triton.runtime.interpreter import InterpretedFunction

    from dbr_quant.kernels import use_backend

    launched: list[tuple] = []

    def stub(self, grid):
        def launch(*args, **kwargs):
            launched.append((self, grid, args, kwargs))
        return launch

    class CountOps(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.ops: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    torch.set_num_threads(1)
    InterpretedFunction.__getitem__ = stub  # type: ignore[method-assign]
    results = {}
    with torch.no_grad(), use_backend("triton-interpret"):
        for name, fn in cases().items():
            for _ in range(20):
                fn()
            launched.clear()
            fn()
            last = launched[-1]
            kernel, grid, args, kwargs = last

            def floor(kernel=kernel, grid=grid, args=args, kwargs=kwargs) -> None:
                stub(kernel, grid)(*args, **kwargs)

            best = {"call": float("inf"), "floor": float("inf")}
            for _ in range(rounds):
                for key, f in (("call", fn), ("floor", floor)):
                    t0 = time.thread_time_ns()
                    for _ in range(calls):
                        f()
                    best[key] = min(best[key], (time.thread_time_ns() - t0) / calls / 1e3)
                launched.clear()
            with CountOps() as counter:
                fn()
            allocating = sum(op.startswith(ALLOCATING) for op in counter.ops)
            results[name] = [best["call"], best["floor"], len(counter.ops), allocating]
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trees", nargs="*", help="source trees to compare (the first is the baseline); none: this one")
    parser.add_argument("--processes", type=int, default=3, help="fresh processes per tree")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(measure(args.rounds, args.calls)))
        return
    trees = [os.path.abspath(t) for t in args.trees or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))]]
    got: dict[str, list[dict[str, list[float]]]] = {t: [] for t in trees}
    for i in range(args.processes):
        for tree in trees if i % 2 == 0 else trees[::-1]:
            env = dict(os.environ, PYTHONPATH=tree)
            cmd = [sys.executable, os.path.abspath(__file__), "--child", "--rounds", str(args.rounds),
                   "--calls", str(args.calls)]
            done = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"triton_host: the tree {tree} failed:\n{done.stderr[-3000:]}")
            got[tree].append(json.loads(done.stdout.strip().splitlines()[-1]))
    import torch
    import triton
    print(f"Triton wrappers' host Python at M={M}, K={K}, N={N} (CPU tensors, launch stubbed; torch "
          f"{torch.__version__}, triton {triton.__version__}); µs per call, CPU time of the thread: best / median "
          f"over {args.processes} processes per tree (each the best of {args.rounds} rounds × {args.calls} calls), "
          "trees interleaved")
    print("floor: the stubbed launch alone with the same arguments; ops: aten ops per call (all / allocating)")
    rows = list(got[trees[0]][0])
    for tree in trees:
        print(f"\n{tree}")
        print(f"  {'row':<46} {'µs best':>8} {'median':>8} {'floor':>6} {'ops':>4} {'alloc':>5}"
              + (f" {'x base':>7}" if len(trees) > 1 else ""))
        for row in rows:
            calls = [r[row][0] for r in got[tree]]
            base = min(r[row][0] for r in got[trees[0]])
            floor = min(r[row][1] for r in got[tree])
            _, _, ops, alloc = got[tree][0][row]
            ratio = f" {min(calls) / base:7.3f}" if len(trees) > 1 else ""
            print(f"  {row:<46} {min(calls):8.2f} {statistics.median(calls):8.2f} {floor:6.2f} {int(ops):4d}"
                  f" {int(alloc):5d}{ratio}")


if __name__ == "__main__":
    main()
