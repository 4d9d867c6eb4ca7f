"""Nearest vs GPTQ weight rounding through the product path on the real all-MiniLM-L6-v2, with and without the
error-per-FLOP fallback (issue #15).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/gptq_fallback_minilm.py [--budgets 0.1,0.2] [--threads 1]

Per rounding: ``prepare`` → ``calibrate`` (the 16 calibration sentences, 4 batches of 4) → ``convert`` with
``QConfig(weight_rounding=...)`` (timed: wall and process CPU seconds). "all FP8" is the converted model's
mean-pooled embedding cosine vs fp32 on the 32 evaluation sentences, disjoint from the calibration ones
(mean and minimum per sentence). The fallback rows choose layers with
``auto_fallback(converted, <calibration sentences>, reference=fp32, rank="error_per_flop",
max_high_precision_flops=budget)`` — tuned on the calibration sentences only — and report that choice on
the held-out evaluation sentences: the converted model with the chosen layers run in high precision with
their original weights (inspect's ``DisableFP8``; the same numbers a re-prepare with ``result.qconfig()``
gives, since calibration runs in fp32 and so the other layers' scales and GPTQ weights do not change).
The "target 0.999, rank error" row is today's ``auto_fallback(target=0.999)`` for comparison.

Measured 2026-11-23 (1 thread, shared 2-core CPU, load ~5), held-out mean / min cosine, FP8 share of linear FLOPs:

    nearest  all FP8                 0.99777 / 0.99695  100.0 %   convert 0.2 s CPU
    nearest  target 0.999 (error)    0.99899 / 0.99821   63.9 %   (0.99905 on the calibration sentences)
    nearest  ≤ 10 % FLOPs, err/FLOP  0.99846 / 0.99743   90.3 %
    nearest  ≤ 20 % FLOPs, err/FLOP  0.99870 / 0.99790   80.6 %
    gptq     all FP8                 0.99808 / 0.99680  100.0 %   convert 24.5 s CPU (38 s wall)
    gptq     target 0.999 (error)    0.99843 / 0.99720   93.1 %   (0.99901 on the calibration sentences)
    gptq     ≤ 10 % FLOPs, err/FLOP  0.99871 / 0.99742   90.3 %
    gptq     ≤ 20 % FLOPs, err/FLOP  0.99886 / 0.99783   82.0 %
"""

from __future__ import annotations

import argparse
import time
import warnings

import torch
import torch.nn.functional as F

import dbr_quant as dq
import dbr_quant.inspect as dqi
from dbr_quant.examples.minilm import CALIBRATION_SENTENCES, EVAL_SENTENCES, encode, load_minilm, sentence_embeddings
from dbr_quant.runtime.hessians import gptq_report


def heldout(converted, model, evaluation, ref, fallback=()) -> torch.Tensor:
    """Per-sentence embedding cosines of ``converted`` with ``fallback`` layers in high precision (original weights)."""
    with dqi.fallback_applied(converted, fallback, reference=model):
        emb = sentence_embeddings(converted, evaluation)
    return F.cosine_similarity(emb, ref, dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--budgets", default="0.1,0.2", help="max_high_precision_flops values (fractions)")
    parser.add_argument("--roundings", default="nearest,gptq")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (GPTQ's column loop is many small "
                                                                "ops: one thread is fastest on a shared CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")
    model, tok = load_minilm()
    calib = [encode(tok, CALIBRATION_SENTENCES[i:i + 4]) for i in range(0, len(CALIBRATION_SENTENCES), 4)]
    evaluation = encode(tok, EVAL_SENTENCES)
    ref = sentence_embeddings(model, evaluation)
    print(f"all-MiniLM-L6-v2, E4M3, per-channel weights, static per-tensor activations; calibration "
          f"{len(CALIBRATION_SENTENCES)} sentences ({len(calib)} batches), evaluation {len(EVAL_SENTENCES)} disjoint "
          f"sentences; torch threads {args.threads}\n")
    rows = []
    for rounding in args.roundings.split(","):
        p = dq.prepare(model, example_kwargs=calib[0], qconfig=dq.QConfig(weight_rounding=rounding))
        dq.calibrate(p, calib, progress=False)
        wall, cpu = time.perf_counter(), time.process_time()
        c = dq.convert(p)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        report = gptq_report(c)
        dampings: dict[str, int] = {}
        for r in report.values():
            dampings[f"{r.damping.damping:g}"] = dampings.get(f"{r.damping.damping:g}", 0) + 1
        cos = heldout(c, model, evaluation, ref)
        rows.append((rounding, "all FP8", cos, 1.0, f"convert {wall:.1f} s wall / {cpu:.1f} s CPU"
                     + (f"; dampings {dampings}" if dampings else "")))
        runs = [dict(target=0.999, rank="error")] + [dict(max_high_precision_flops=float(b), rank="error_per_flop")
                                                      for b in args.budgets.split(",")]
        t = time.perf_counter()
        sens = dqi.sensitivity(c, calib, reference=model, output_fn=sentence_embeddings, by="cosine")
        print(f"{rounding}: sensitivity of {len(sens)} layers in {time.perf_counter() - t:.0f} s", flush=True)
        for kw in runs:
            t = time.perf_counter()
            res = dqi.auto_fallback(c, calib, reference=model, output_fn=sentence_embeddings, sensitivity=sens, **kw)
            label = ("target 0.999, rank error" if "target" in kw
                     else f"≤ {100 * kw['max_high_precision_flops']:g} % FLOPs HP, rank error/FLOP")
            cos = heldout(c, model, evaluation, ref, res.fallback)
            rows.append((rounding, label, cos, res.fp8_flop_fraction,
                         f"{len(res.fallback)} layers HP, calib cos {res.cosine:.5f}, "
                         f"{time.perf_counter() - t:.0f} s"))
        if rounding == "gptq":
            print("GPTQ curve at the largest budget (calibration sentences):")
            print(res.curve_table(), "\n")
    print("| rounding | fallback | held-out mean cos | held-out min cos | FP8 share of linear FLOPs | notes |")
    print("| --- | --- | --- | --- | --- | --- |")
    for rounding, label, cos, frac, note in rows:
        print(f"| {rounding} | {label} | {cos.mean():.5f} | {cos.min():.5f} | {100 * frac:.1f} % | {note} |")


if __name__ == "__main__":
    main()
