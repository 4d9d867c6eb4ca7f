"""What a ``dbr_quant::`` graph op costs on top of the kernel it wraps: ``torch.ops.dbr_quant.fp8_linear`` vs
``dbr_quant.kernels.fp8_linear`` on a 1×16·16×16 GEMM (so the kernel is small and the call overhead shows).

CPU time of this thread (``time.thread_time``), one torch thread, median over rounds: steady on a shared
machine. Run: ``python benchmarks/op_overhead.py [--rounds 41]``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import dbr_quant  # noqa: F401  (defines the ops)
from dbr_quant import kernels
from dbr_quant.formats import FP8Format


def per_call_us(fn, calls: int, rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        t0 = time.thread_time()
        for _ in range(calls):
            fn()
        samples.append((time.thread_time() - t0) / calls * 1e6)
    return statistics.median(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=41)
    parser.add_argument("--calls", type=int, default=200)
    args = parser.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x, sx, sw = torch.randn(1, 16, generator=gen), torch.tensor(0.05), torch.tensor(0.01)
    xq = (x / sx).to(torch.float8_e4m3fn)
    wq = (torch.randn(16, 16, generator=gen) / sw).clamp(-448, 448).to(torch.float8_e4m3fn)
    bias = torch.randn(16, generator=gen)
    op = torch.ops.dbr_quant.fp8_linear.default

    def direct():
        return kernels.fp8_linear(xq, sx, wq, sw, bias=bias, activation=None, residual=None,
                                  out_dtype=torch.float32, out_scale=None, out_fmt=FP8Format.E4M3)

    def graph_op():
        return op(xq, sx, wq, sw, bias, "", None, torch.float32, None, "e4m3")

    assert torch.equal(direct(), graph_op())
    print(f"torch {torch.__version__}, 1 thread, median of {args.rounds} rounds × {args.calls} calls (µs per call)")
    for mode, ctx in (("grad mode on", torch.enable_grad), ("no_grad", torch.no_grad),
                      ("inference_mode", torch.inference_mode)):
        with ctx():
            kernel = min(per_call_us(direct, args.calls, args.rounds), per_call_us(direct, args.calls, args.rounds))
            via_op = per_call_us(graph_op, args.calls, args.rounds)
        print(f"{mode:<16} kernel {kernel:6.1f}   op {via_op:6.1f}   op overhead {via_op - kernel:5.1f}")


if __name__ == "__main__":
    main()
