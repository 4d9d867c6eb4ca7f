"""Where the converted MiniLM's time goes next to fp32 eager, per CPU GEMM path and batch size (issue #10's
"remaining gap explained with a profile").

    .venv/bin/python benchmarks/gap_profile.py [--rounds 9] [--sentences 1,8,32]

One intra-op thread. For each path and batch: fp32 eager and converted forward times (median of interleaved
rounds, unprofiled), then one profiled converted forward split into
* GEMM: torch's GEMM ops (aten::mm / addmm / bmm / baddbmm, self time; fp32 eager's own GEMMs beside it);
* C kernels: dbr_quant's one-pass E4M3 upcasts, quantize and small linears (kernels/cpu/csrc/e4m3.c), timed
  around each ctypes call (torch's profiler does not see them);
* other torch ops: everything else torch's profiler saw (attention, LayerNorm, GELU, casts, epilogues), and
  the same for fp32 eager;
* Python: the rest of the converted forward (dispatch, the define-by-run runtime, module calls).
The profiled forward is slower than an unprofiled one; the split is shown in shares of it and scaled to the
unprofiled time. Also prints the CPU features.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import functools
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import median, minilm, time_interleaved  # noqa: E402

from dbr_quant.examples.minilm import EVAL_SENTENCES, encode  # noqa: E402
from dbr_quant.kernels import use_cpu_gemm
from dbr_quant.kernels.cpu import e4m3 as cpu_e4m3  # noqa: E402
from dbr_quant.kernels.cpu import features as cpu

GEMM_OPS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::_scaled_mm"}
C_CALLS = ("quantize_e4m3", "decode_e4m3", "decode_e4m3_scaled", "small_linear")


@contextlib.contextmanager
def timed_c_calls(spent: collections.Counter):
    """Wrap cpu_e4m3's entry points (looked up through the module by the CPU backend) with timers."""
    originals = {name: getattr(cpu_e4m3, name) for name in C_CALLS}

    def wrap(name, fn):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[name] += time.perf_counter() - t0
        return timed

    for name, fn in originals.items():
        setattr(cpu_e4m3, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            setattr(cpu_e4m3, name, fn)


def op_times(fn, reps: int) -> tuple[float, float, float]:
    """(wall seconds, GEMM self seconds, other torch-op self seconds) per call, under torch's profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        wall = (time.perf_counter() - t0) / reps
    gemm = other = 0.0
    for e in prof.key_averages():
        if e.key.startswith("aten::"):
            if e.key in GEMM_OPS:
                gemm += e.self_cpu_time_total / 1e6 / reps
            else:
                other += e.self_cpu_time_total / 1e6 / reps
    return wall, gemm, other


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--sentences", default="1,8,32")
    args = parser.parse_args()
    torch.set_num_threads(1)
    m = minilm()
    model, tok, converted = m.model, m.tokenizer, m.converted
    print(cpu.describe())
    print("ms per forward, 1 thread; the converted forward split by one profiled run, scaled to its unprofiled time")
    print("| path | sentences | fp32 eager | converted | ratio | GEMM (fp32's) | C kernels | other torch ops "
          "(fp32's) | Python (fp32's) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for path in cpu.GEMM_PATHS:
        for n in (int(s) for s in args.sentences.split(",")):
            batch = encode(tok, (EVAL_SENTENCES * 4)[:n])
            with use_cpu_gemm(path), torch.no_grad():
                t = time_interleaved({"fp32": lambda b=batch: model(**b), "fp8": lambda b=batch: converted(**b)},
                                     rounds=args.rounds)
                reps = 5 if n > 8 else 20
                wall32, gemm32, other32 = op_times(lambda b=batch: model(**b), reps)
                spent: collections.Counter = collections.Counter()
                with timed_c_calls(spent):
                    wall, gemm, other = op_times(lambda b=batch: converted(**b), reps)
            c_kernels = sum(spent.values()) / reps
            python = wall - gemm - other - c_kernels
            scale = median(t["fp8"]) / wall * 1e3  # profiled seconds → unprofiled ms
            scale32 = median(t["fp32"]) / wall32 * 1e3
            cells = [f"{gemm * scale:.2f} ({gemm32 * scale32:.2f})", f"{c_kernels * scale:.2f}",
                     f"{other * scale:.2f} ({other32 * scale32:.2f})",
                     f"{python * scale:.2f} ({(wall32 - gemm32 - other32) * scale32:.2f})"]
            print(f"| {path} | {n} | {median(t['fp32']) * 1e3:.2f} | {median(t['fp8']) * 1e3:.2f} | "
                  f"{median(t['fp8']) / median(t['fp32']):.2f} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
