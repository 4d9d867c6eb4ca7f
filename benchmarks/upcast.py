"""FP8 → bf16 / fp32 upcasts on this CPU: the bit-move upcasts of kernels.cpu.upcast against torch's casts.

    .venv/bin/python benchmarks/upcast.py [--rounds 15]

Shapes: MiniLM's weights (1536×384, 384×384) as the CPU backend upcasts them (into a reused buffer),
and an 8-sentence activation (128×384, freshly allocated). Times are medians of interleaved rounds.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import median, time_interleaved  # noqa: E402

from dbr_quant.kernels.cpu import upcast as R  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}; µs per call, median of {args.rounds} rounds")
    print(f"{'shape':<12}{'torch .to(fp32)':>16}{'bit move fp32':>15}{'speed-up':>10}"
          f"{'torch .to(bf16)':>17}{'bit move bf16':>15}{'speed-up':>10}")
    for shape, reuse in (((1536, 384), True), ((384, 384), True), ((128, 384), False)):
        q = (torch.randn(shape) * 40).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(R.fp8_to_fp32(q), q.float()) and torch.equal(R.fp8_to_bf16(q), q.to(torch.bfloat16))
        inner = max(1, 200_000 // q.numel())
        t = time_interleaved({"cast32": lambda q=q: q.to(torch.float32),
                              "bits32": lambda q=q, reuse=reuse: R.fp8_to_fp32(q, reuse),
                              "cast16": lambda q=q: q.to(torch.bfloat16),
                              "bits16": lambda q=q, reuse=reuse: R.fp8_to_bf16(q, reuse)},
                             rounds=args.rounds, inner=inner)
        us = {k: median(v) * 1e6 for k, v in t.items()}
        print(f"{'×'.join(map(str, shape)):<12}{us['cast32']:>16.1f}{us['bits32']:>15.1f}"
              f"{us['cast32'] / us['bits32']:>9.1f}×{us['cast16']:>17.1f}{us['bits16']:>15.1f}"
              f"{us['cast16'] / us['bits16']:>9.1f}×")


if __name__ == "__main__":
    main()
