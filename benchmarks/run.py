"""One command, one table: dbr_quant on the real all-MiniLM-L6-v2, measured side by side on this CPU.

    .venv/bin/python benchmarks/run.py        (or: make bench)

Rows: 32 sentences and batch 1. Each ratio is the median over rounds of the two times measured in the
same round (lower is faster); fp32 ms is the median fp32 time. Plus weight bytes and the embedding
cosine against fp32 on held-out sentences.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import linear_weight_bytes, median, paired_ratio, state_dict_bytes, time_interleaved  # noqa: E402

import dbr_quant as dq  # noqa: E402
from dbr_quant.examples.minilm import (  # noqa: E402
    CALIBRATION_SENTENCES,
    EVAL_SENTENCES,
    encode,
    load_minilm,
    sentence_embeddings,
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    model, tok = load_minilm()
    calib = [encode(tok, CALIBRATION_SENTENCES[i:i + 8]) for i in range(0, len(CALIBRATION_SENTENCES), 8)]
    prepared = dq.prepare(model, example_kwargs=calib[0])
    dq.calibrate(prepared, calib, progress=False)
    converted = dq.convert(prepared)
    bf16 = copy.deepcopy(model).to(torch.bfloat16)

    print(f"dbr_quant benchmark: all-MiniLM-L6-v2 on CPU, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, {args.rounds} interleaved rounds, paired ratios")
    header = (f"{'batch':<14}{'fp32 ms':>9}{'bf16/fp32':>11}{'calib/fp32':>12}{'fp8/fp32':>10}"
              f"{'fp8/bf16':>10}{'cosine':>9}")
    print(header)
    print("-" * len(header))
    for label, sentences in (("32 sentences", EVAL_SENTENCES[:32]), ("batch 1", EVAL_SENTENCES[:1])):
        batch = encode(tok, sentences)
        t = time_interleaved({
            "fp32": lambda batch=batch: model(**batch),
            "bf16": lambda batch=batch: bf16(**batch),
            "calib": lambda batch=batch: prepared(**batch),
            "fp8": lambda batch=batch: converted(**batch),
        }, rounds=args.rounds)
        cos = (sentence_embeddings(model, batch) * sentence_embeddings(converted, batch)).sum(-1).mean()
        bf, ca, f8, fb = (paired_ratio(t, a, b) for a, b in (("bf16", "fp32"), ("calib", "fp32"), ("fp8", "fp32"),
                                                               ("fp8", "bf16")))
        print(f"{label:<14}{median(t['fp32']) * 1e3:>9.2f}{bf:>11.2f}{ca:>12.2f}{f8:>10.2f}{fb:>10.2f}"
              f"{cos.item():>9.4f}")
    wb, wq = linear_weight_bytes(model), linear_weight_bytes(converted)
    sb, sq = state_dict_bytes(model), state_dict_bytes(converted)
    print(f"\nlinear weight bytes: fp32 {wb / 2**20:.2f} MiB -> fp8 {wq / 2**20:.2f} MiB "
          f"(ratio {wq / wb:.3f}, goal <= 0.27)")
    print(f"whole state_dict:    fp32 {sb / 2**20:.2f} MiB -> fp8 {sq / 2**20:.2f} MiB (ratio {sq / sb:.3f}; "
          "embeddings, norms and biases stay fp32)")
    print("goals at 32 sentences: calib/fp32 <= 1.3, fp8/fp32 <= 1.0")


if __name__ == "__main__":
    main()
