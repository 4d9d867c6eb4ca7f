"""Timing and table helpers shared by benchmarks/gpu.py and benchmarks/gpu_moe.py."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch
from torch import nn


def timed(fn: Callable[..., object], *args: object, reps: int = 25, **kwargs: object) -> float:
    """Median milliseconds of ``fn(*args, **kwargs)`` over ``reps`` runs after warm-up, CUDA events around each
    (wall clock without CUDA: the ``--dry`` run)."""
    for _ in range(3):
        fn(*args, **kwargs)
    if not torch.cuda.is_available():
        return statistics.median(_wall_ms(fn, *args, **kwargs) for _ in range(reps))
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args, **kwargs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def _wall_ms(fn: Callable[..., object], *args: object, **kwargs: object) -> float:
    start = time.perf_counter()
    fn(*args, **kwargs)
    return (time.perf_counter() - start) * 1e3


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    widths = [max([len(str(h))] + [len(f"{r[i]}") for r in rows]) for i, h in enumerate(header)]
    print("  ".join(f"{h:>{w}}" for h, w in zip(header, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for r in rows:
        print("  ".join(f"{c:>{w}}" for c, w in zip(r, widths, strict=True)), flush=True)


def convert(model: nn.Module, example: dict[str, torch.Tensor], fuse: bool = True) -> nn.Module:
    import dbr_quant as dq

    prepared = dq.prepare(model, example_kwargs=example, qconfig=dq.QConfig(fuse=fuse))
    dq.calibrate(prepared, [example], progress=False)
    return dq.convert(prepared)
