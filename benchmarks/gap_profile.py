"""Where the converted MiniLM's time goes next to the faster high-precision eager model (fp32 or bf16, whichever
is faster here: issue #25's "remaining gap explained with a profile"), per CPU GEMM path, batch and thread count.

    .venv/bin/python benchmarks/gap_profile.py [--rounds 9] [--sentences 1,8,32] [--threads 1,default]

For each path, thread count and batch: fp32, bf16 and converted eager forward times (median of interleaved rounds,
unprofiled), then one profiled forward of the converted model and of the faster high-precision one, split into
* GEMM: torch's GEMM ops (aten::mm / addmm / bmm / baddbmm, self time) plus dbr_quant's fused C FP8 GEMM
  (kernels/cpu/csrc/fp8_gemm.c, timed around its ctypes call: torch's profiler does not see it);
* C kernels: dbr_quant's other C calls (quantize, dynamic quantize, upcasts, small linears; csrc/e4m3.c);
* other torch ops: everything else torch's profiler saw (attention, LayerNorm, GELU, casts, epilogues);
* Python: the rest of the forward (dispatch, the define-by-run runtime, module calls).
The high-precision model's figures are in parentheses. A profiled forward is slower than an unprofiled one; the
split is shown in shares of it and scaled to the unprofiled time. Also prints the CPU features.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import copy
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
GEMM_C_CALLS = ("fp8_gemm",)
C_CALLS = (*GEMM_C_CALLS, "quantize_e4m3", "dynamic_quantize_e4m3", "decode_e4m3", "decode_e4m3_scaled",
           "small_linear")


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
    parser.add_argument("--threads", default="1", help="comma-separated: counts and/or 'default' (torch's)")
    args = parser.parse_args()
    default_threads = torch.get_num_threads()
    m = minilm()
    models = {"fp32": m.model, "bf16": copy.deepcopy(m.model).to(torch.bfloat16), "fp8": m.converted}
    print(cpu.describe())
    print("ms per forward; the converted forward split by one profiled run, scaled to its unprofiled time; in "
          "parentheses the faster high-precision model's (hp)")
    print("| path | threads | sentences | fp32 | bf16 | converted | ÷ hp | GEMM (hp) | C kernels "
          "| other torch ops (hp) | Python (hp) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for threads in (default_threads if t == "default" else int(t) for t in args.threads.split(",")):
        torch.set_num_threads(threads)
        for path in cpu.GEMM_PATHS:
            for n in (int(s) for s in args.sentences.split(",")):
                batch = encode(m.tokenizer, (EVAL_SENTENCES * 4)[:n])
                with use_cpu_gemm(path), torch.no_grad():
                    t = time_interleaved({k: lambda b=batch, mod=mod: mod(**b) for k, mod in models.items()},
                                         rounds=args.rounds)
                    hp = min(("fp32", "bf16"), key=lambda k: median(t[k]))
                    reps = 5 if n > 8 else 20
                    wall_hp, gemm_hp, other_hp = op_times(lambda b=batch, mod=models[hp]: mod(**b), reps)
                    spent: collections.Counter = collections.Counter()
                    with timed_c_calls(spent):
                        wall, gemm, other = op_times(lambda b=batch: models["fp8"](**b), reps)
                c_gemm = sum(spent[k] for k in GEMM_C_CALLS) / reps
                c_kernels = sum(spent.values()) / reps - c_gemm
                python = wall - gemm - c_gemm - other - c_kernels
                scale = median(t["fp8"]) / wall * 1e3  # profiled seconds → unprofiled ms
                scale_hp = median(t[hp]) / wall_hp * 1e3
                cells = [f"{(gemm + c_gemm) * scale:.2f} ({gemm_hp * scale_hp:.2f})", f"{c_kernels * scale:.2f}",
                         f"{other * scale:.2f} ({other_hp * scale_hp:.2f})",
                         f"{python * scale:.2f} ({(wall_hp - gemm_hp - other_hp) * scale_hp:.2f})"]
                times = " | ".join(f"{median(t[k]) * 1e3:.2f}" for k in models)
                print(f"| {path} | {threads} | {n} | {times} | {median(t['fp8']) / median(t[hp]):.2f} × {hp} | "
                      + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
