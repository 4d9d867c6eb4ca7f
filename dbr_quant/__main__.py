"""Command line: ``python -m dbr_quant demo`` quantizes the real all-MiniLM-L6-v2 end to end on CPU."""

from __future__ import annotations

import argparse
import contextlib
import copy
import statistics
import time

import torch

import dbr_quant as dq
from dbr_quant.examples.minilm import (
    CALIBRATION_SENTENCES,
    EVAL_SENTENCES,
    encode,
    load_minilm,
    sentence_embeddings,
)
from dbr_quant.kernels import use_cpu_gemm
from dbr_quant.kernels.cpu import features as cpu
from dbr_quant.quantize.weights import fp8_weight_bytes


def demo(rounds: int = 7, cpu_gemm: str | None = None) -> None:
    """``cpu_gemm``: force the CPU GEMM path ("bf16" / "fp32" / "auto"); None: $DBR_QUANT_CPU_GEMM or auto."""
    with use_cpu_gemm(cpu_gemm) if cpu_gemm else contextlib.nullcontext():
        _demo(rounds)


def _demo(rounds: int) -> None:
    torch.manual_seed(0)
    print("dbr_quant demo: all-MiniLM-L6-v2 (real pretrained weights) → FP8 (E4M3), CPU backend")
    print(f"{cpu.describe()}\n")
    model, tok = load_minilm()
    calib = [encode(tok, CALIBRATION_SENTENCES[i:i + 4]) for i in range(0, len(CALIBRATION_SENTENCES), 4)]
    prepared = dq.prepare(model, example_kwargs=calib[0])
    dq.calibrate(prepared, calib)
    converted = dq.convert(prepared)

    rows = dq.report(converted)
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    fp32_bytes = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    fp8_bytes = fp8_weight_bytes(converted)
    batch = encode(tok, EVAL_SENTENCES[:8])
    cos = (sentence_embeddings(model, batch) * sentence_embeddings(converted, batch)).sum(-1)

    # against the faster high-precision dtype on this CPU: bf16 where it has BF16 dot products is ~2× fp32
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    times: dict[str, list[float]] = {"fp32": [], "bf16": [], "fp8": []}
    with torch.no_grad():
        for _ in range(rounds):  # interleaved so all see the same machine load
            for name, m in (("fp32", model), ("bf16", bf16), ("fp8", converted)):
                t0 = time.perf_counter()
                m(**batch)
                times[name].append(time.perf_counter() - t0)
    t32, t16, t8 = (statistics.median(times[k]) * 1e3 for k in ("fp32", "bf16", "fp8"))
    best, t_best = ("bf16", t16) if t16 < t32 else ("fp32", t32)
    fused = sorted({r["fusion"] for r in rows if r["fusion"]})

    table = [
        ("nn.Linear layers converted to FP8", f"{sum(r['fp8'] for r in rows if r['kind'] == 'linear')} of "
                                              f"{len(linears)}"),
        ("fused subgraphs", ", ".join(fused) or "-"),
        ("linear weight bytes", f"{fp32_bytes / 2**20:.2f} MiB fp32 → {fp8_bytes / 2**20:.2f} MiB fp8 "
                                f"({fp8_bytes / fp32_bytes:.3f}×)"),
        ("embedding cosine vs fp32 (8 held-out sentences)", f"mean {cos.mean():.4f}, min {cos.min():.4f}"),
        ("forward time, 8 sentences (median)", f"fp32 {t32:.1f} ms, bf16 {t16:.1f} ms, fp8 {t8:.1f} ms "
                                               f"({t8 / t_best:.2f}× the faster, {best}; "
                                               f"{cpu.current_gemm_path()} GEMMs)"),
    ]
    width = max(len(k) for k, _ in table)
    for k, v in table:
        print(f"  {k:<{width}}  {v}")
    high = [r for r in rows if not r["fp8"]]
    if high:
        print(f"\n  {len(high)} op(s) stay in high precision:")
        for r in high:
            print(f"    {r['fqn']}: {r['reason']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m dbr_quant")
    sub = parser.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="quantize the real all-MiniLM-L6-v2 on CPU and print a summary")
    d.add_argument("--rounds", type=int, default=7, help="timing rounds")
    d.add_argument("--cpu-gemm", choices=["auto", "bf16", "fp32"], default=None,
                   help="force the CPU GEMM path (default: $DBR_QUANT_CPU_GEMM, else auto from the CPU's features)")
    args = parser.parse_args(argv)
    if args.command == "demo":
        demo(args.rounds, args.cpu_gemm)


if __name__ == "__main__":
    main()
