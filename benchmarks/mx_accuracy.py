"""Accuracy of MXFP8 (OCP MX: E4M3 elements, one power-of-two E8M0 scale per 1×32 block along K, weights and
dynamic activations) and of weight-only FP8 (W8A16), next to the other FP8 schemes, against fp32 on held-out text.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/mx_accuracy.py

The real all-MiniLM-L6-v2, calibrated on dbr_quant.examples.minilm's calibration sentences (static schemes only),
evaluated on its 32 evaluation sentences (disjoint): mean-pooled sentence-embedding cosine to fp32 (mean, min per
sentence), SQNR of the last hidden state over real tokens, FP8 weight bytes (data + scales). Reference-exact CPU
kernels (``use_backend("reference")``), so the figures are the schemes', not a GEMM path's. "block 1×32 (fp32
scales)" is MX's granularity with amax/448 scales: the gap to MXFP8 is the cost of rounding scales to powers of two
(floor, the OCP rule, saturates the largest values of about a fifth of the blocks; ceil saturates nothing).
"""

from __future__ import annotations

import time

import torch
from block_accuracy import minilm_rows

import dbr_quant as dq

SCHEMES: dict[str, dq.QConfig] = {
    "W8A8 tensor (static) / channel": dq.QConfig(),
    "W8A8 token (dynamic) / channel": dq.QConfig(activation=dq.TensorQConfig(granularity="token"), dynamic=True),
    "W8A8 tensor (static) / tensor": dq.QConfig(weight=dq.TensorQConfig(granularity="tensor")),
    "block 128x128 / group 128": dq.QConfig.fp8_block((128, 128)),
    "block 1x32 / group 32 (fp32 scales)": dq.QConfig.fp8_block((1, 32)),
    "MXFP8 (E8M0 per 1x32, floor: OCP)": dq.QConfig.mxfp8(),
    "MXFP8 (E8M0 per 1x32, ceil)": dq.QConfig.mxfp8(scale_rounding="ceil"),
    "weight-only channel (W8A16)": dq.QConfig.fp8_weight_only(),
    "weight-only tensor (W8A16)": dq.QConfig.fp8_weight_only("tensor"),
}


def format_rows(rows: list[dict]) -> str:
    lines = [f"{'scheme':<38} {'cos mean':>9} {'cos min':>8} {'SQNR dB':>8} {'FP8 weights KiB':>16}"]
    for r in rows:
        lines.append(f"{r['scheme']:<38} {r['cos_mean']:>9.5f} {r['cos_min']:>8.5f} {r['sqnr_db']:>8.2f} "
                     f"{r['weight_bytes'] / 1024:>16.1f}")
    return "\n".join(lines)


def main() -> None:
    torch.manual_seed(0)
    t0 = time.perf_counter()
    with dq.kernels.use_backend("reference"):
        rows = minilm_rows(schemes=SCHEMES)
    print("FP8 schemes vs fp32 on all-MiniLM-L6-v2 (32 held-out sentences; reference kernels, CPU): sentence "
          "embedding cosine, last-hidden-state SQNR over real tokens")
    print(format_rows(rows))
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
