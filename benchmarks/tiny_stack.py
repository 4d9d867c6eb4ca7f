"""The runtime's own cost per quantized op: 48 × (Linear(16,16) + ReLU) at batch 1, where the GEMMs are tiny
and whatever dbr_quant's define-by-run runtime does per op is most of the time (issue #10, goal ≤ 10 µs per op).

    PYTHONPATH=. .venv/bin/python benchmarks/tiny_stack.py [--rounds 15] [--cpu-gemm bf16|fp32]

Three variants, interleaved round by round, each timed with ``time.thread_time`` (CPU time of this thread,
so other processes on a shared machine do not count) with one intra-op thread (all of the work runs on this
thread): fp32 eager; the converted FP8 model (runtime + kernel); the same converted model with the CPU backend's
kernel entry points the runtime calls (``dbr_quant.kernels.cpu.backend.<op>``, reached through the dispatch in
``dbr_quant.kernels``) replaced by no-ops that return a tensor of the right shape and dtype (runtime only).
Per op = per forward / number of quantized linears (one fused ``Linear + ReLU`` each); the kernel launches
per forward are printed too.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import os
import statistics
import sys
import time
from collections.abc import Callable, Iterator

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from harness import paired_ratio  # noqa: E402

import dbr_quant as dq  # noqa: E402
from dbr_quant.kernels import count_launches, use_cpu_gemm
from dbr_quant.kernels.cpu import backend as cpu_backend  # noqa: E402

LAYERS, WIDTH = 48, 16


def tiny_stack(layers: int = LAYERS, width: int = WIDTH) -> nn.Sequential:
    return nn.Sequential(*[m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())])


def convert_tiny_stack(model: nn.Module, width: int = WIDTH) -> nn.Module:
    torch.manual_seed(1)
    example = torch.randn(1, width)
    prepared = dq.prepare(model, (example,))
    dq.calibrate(prepared, [(torch.randn(1, width),) for _ in range(8)], progress=False)
    return dq.convert(prepared)


class _Outputs:
    """A tensor of each (shape, dtype, device) made once: what a no-op kernel returns (values unused)."""

    def __init__(self) -> None:
        self._cache: dict[tuple, torch.Tensor] = {}

    def __call__(self, shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (tuple(shape), dtype, device)
        t = self._cache.get(key)
        if t is None:
            t = self._cache[key] = torch.zeros(key[0], dtype=dtype, device=device)
        return t


def _no_op_kernels() -> dict[str, Callable]:
    """No-op stand-ins for the CPU backend's kernels the dense runtime calls, same signatures and output shapes."""
    out = _Outputs()
    scalar = lambda x: out((), torch.float32, x.device)  # noqa: E731

    def quantize(x, scale, fmt):
        return out(x.shape, fmt.dtype, x.device)

    def dequantize(q, scale, dtype=torch.float32):
        return out(q.shape, dtype, q.device)

    def dynamic_scale(x, fmt, per_token):
        return out((*x.shape[:-1], 1), torch.float32, x.device) if per_token else scalar(x)

    def dynamic_quantize(x, fmt, per_token):
        return quantize(x, None, fmt), dynamic_scale(x, fmt, per_token)

    def fp8_linear(x_q, x_scale, w_q, w_scale, *, bias=None, activation=None, residual=None,
                   out_dtype=torch.float32, out_scale=None, out_fmt=None):
        dtype = out_fmt.dtype if out_scale is not None else out_dtype
        return out((*x_q.shape[:-1], w_q.shape[0]), dtype, x_q.device)

    def fp8_matmul(a_q, a_scale, b_q, b_scale):
        return out((*a_q.shape[:-1], b_q.shape[-1]), torch.float32, a_q.device)

    def layer_norm_quantize(x, weight, bias, eps, scale, fmt, *, rms=False):
        return out(x.shape, x.dtype, x.device), quantize(x, scale, fmt)

    return {f.__name__: f for f in (quantize, dequantize, dynamic_scale, dynamic_quantize, fp8_linear, fp8_matmul,
                                    layer_norm_quantize)}


def _counting(name: str, fn: Callable, calls: collections.Counter) -> Callable:
    def counted(*args, **kwargs):
        calls[name] += 1
        return fn(*args, **kwargs)
    return counted


@contextlib.contextmanager
def kernels_replaced_by_no_ops(calls: collections.Counter | None = None) -> Iterator[None]:
    """Within the block, the CPU backend's entry points (what ``dbr_quant.kernels.<op>`` calls on the
    CPU: ``_impl(x).<op>(...)``, looked up at call time) return preallocated tensors and compute nothing.
    ``calls`` counts the no-op calls (so a check can confirm that the runtime really reached them)."""
    no_ops = _no_op_kernels()
    saved = {name: getattr(cpu_backend, name) for name in no_ops}
    try:
        for name, fn in no_ops.items():
            setattr(cpu_backend, name, fn if calls is None else _counting(name, fn, calls))
        yield
    finally:
        for name, fn in saved.items():
            setattr(cpu_backend, name, fn)


def _time_thread(variants: dict[str, Callable[[], object]], rounds: int, inner: int) -> dict[str, list[float]]:
    """Seconds of this thread's CPU time per call, one sample (mean of ``inner`` calls) per round, interleaved."""
    samples: dict[str, list[float]] = {k: [] for k in variants}
    with torch.no_grad():
        for fn in variants.values():
            for _ in range(3):
                fn()
        for _ in range(rounds):
            for name, fn in variants.items():
                t0 = time.thread_time()
                for _ in range(inner):
                    fn()
                samples[name].append((time.thread_time() - t0) / inner)
    return samples


def measure(path: str, rounds: int = 15, inner: int = 20) -> dict[str, float]:
    """The tiny-stack figures on CPU GEMM path ``path``, one intra-op thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.manual_seed(0)
        model = tiny_stack()
        converted = convert_tiny_stack(model)
        x = torch.randn(1, WIDTH)
        with torch.no_grad(), use_cpu_gemm(path), count_launches() as launches:
            converted(x)
        layers = sum(isinstance(m, nn.Linear) for m in model.modules())
        no_op_calls: collections.Counter = collections.Counter()
        with torch.no_grad(), kernels_replaced_by_no_ops(no_op_calls):
            converted(x)
        # else "runtime only" would time kernels that the patch did not reach
        if sum(no_op_calls.values()) != sum(launches.values()):
            raise RuntimeError(f"tiny stack: the no-op kernels saw {dict(no_op_calls)} but the forward launched "
                               f"{dict(launches)}; the runtime no longer reaches "
                               "dbr_quant.kernels.cpu.backend.<op> at call time: "
                               "update kernels_replaced_by_no_ops to patch what it calls")

        def runtime_only() -> None:
            with kernels_replaced_by_no_ops():
                converted(x)

        def pinned() -> None:
            with use_cpu_gemm(path):
                converted(x)

        with use_cpu_gemm(path):
            t = _time_thread({"fp32": lambda: model(x), "fp8": pinned, "runtime": runtime_only}, rounds, inner)
    finally:
        torch.set_num_threads(threads)
    per_op = lambda k: statistics.median(t[k]) / layers * 1e6  # noqa: E731
    return {"ratio": paired_ratio(t, "fp8", "fp32"), "fp32_us": per_op("fp32"), "fp8_us": per_op("fp8"),
            "runtime_us": per_op("runtime"), "layers": layers, "launches": sum(launches.values()),
            "launch_kinds": dict(launches)}


def measure_in_fresh_process(path: str, rounds: int = 15, inner: int = 20) -> dict[str, float]:
    """:func:`measure` in a new Python process. ``benchmarks/run.py`` uses it: in its own process, after MiniLM,
    its compiled graphs and their caches were built, every Python call costs more (the same tiny stack read
    9.6-10.2 µs of runtime per op there against 8.5-8.6 µs alone), which is not the runtime's own cost."""
    import json
    import subprocess

    code = (f"import json, sys; sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r}); "
            f"import tiny_stack; print(json.dumps(tiny_stack.measure({path!r}, {rounds}, {inner})))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def format_row(path: str, r: dict[str, float]) -> str:
    kinds = ", ".join(f"{k} {v}" for k, v in r["launch_kinds"].items())
    return (f"tiny stack, {r['layers']}x Linear({WIDTH},{WIDTH})+ReLU, batch 1 [{path} GEMMs]: converted / fp32 "
            f"{r['ratio']:.2f} (goal <= 3); per quantized op: runtime only {r['runtime_us']:.1f} us (goal <= 10), "
            f"runtime + kernel {r['fp8_us']:.1f} us; fp32 eager {r['fp32_us']:.1f} us per layer; "
            f"{r['launches']} kernel launches per forward ({kinds})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--inner", type=int, default=20, help="forwards per sample")
    parser.add_argument("--cpu-gemm", choices=["bf16", "fp32"], action="append",
                        help="CPU GEMM path(s) (repeatable; default: both)")
    args = parser.parse_args()
    print("thread CPU time (time.thread_time), 1 intra-op thread, median of rounds")
    for path in args.cpu_gemm or ["bf16", "fp32"]:
        print(format_row(path, measure(path, args.rounds, args.inner)))


if __name__ == "__main__":
    main()
