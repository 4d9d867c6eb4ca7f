"""FP8 GEMM on the GPU (issue #23, first rows): dbr_quant's Triton ``fp8_linear`` vs ``torch._scaled_mm``
(cuBLASLt FP8) vs bf16 ``torch.matmul``, on Llama-3-8B layer shapes at decode and prefill M, one table of
times, TFLOP/s and ratios measured side by side in one run. Needs CUDA (prints why not, else).

    python benchmarks/gpu.py
"""

from __future__ import annotations

import statistics

import torch

# (name, N, K) of Llama-3-8B linears: qkv, o, gate+up, down
SHAPES = [("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 28672, 4096), ("down", 4096, 14336)]
MS = [1, 16, 512, 4096]


def timed(fn, reps: int = 30) -> float:
    """Median milliseconds of ``fn`` over ``reps`` runs after warm-up, CUDA events around each run."""
    for _ in range(5):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def gemm_times(x: torch.Tensor, w: torch.Tensor, w_q: torch.Tensor, w_s: torch.Tensor) -> tuple[float, float, float]:
    """Milliseconds of (dbr_quant's Triton FP8 linear, cuBLASLt FP8, bf16 matmul), bf16 out, x quantized per tensor."""
    from dbr_quant import kernels
    from dbr_quant.formats import FP8Format

    x_q, x_s = kernels.dynamic_quantize(x, FP8Format.E4M3)
    with kernels.use_backend("triton"):
        ours = timed(lambda: kernels.fp8_linear(x_q, x_s, w_q, w_s, out_dtype=torch.bfloat16))
    cublas = timed(lambda: torch._scaled_mm(x_q, w_q.t(), scale_a=x_s.float(), scale_b=w_s.float(),
                                            out_dtype=torch.bfloat16))
    return ours, cublas, timed(lambda: torch.matmul(x, w.t()))


def main() -> None:
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here; run it on a GPU machine")
        return
    import triton

    from dbr_quant import kernels
    from dbr_quant.formats import FP8Format

    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}, "
          f"CUDA {torch.version.cuda}")
    header = f"{'shape':<10}{'M':>6}{'N':>7}{'K':>7}  {'bf16 ms':>9}{'cuBLAS fp8':>11}{'ours fp8':>10}" \
             f"  {'TFLOP/s ours':>12}{'cuBLAS':>8}{'bf16':>7}  {'ours/cuBLAS':>11}{'ours/bf16':>10}"
    print(header + "\n" + "-" * len(header))
    for name, n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        w_q, w_s = kernels.dynamic_quantize(w, FP8Format.E4M3)  # per tensor: what _scaled_mm takes for both
        for m in MS:
            ours, cublas, bf16 = gemm_times(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), w, w_q, w_s)
            tf = [2 * m * n * k / t / 1e9 for t in (ours, cublas, bf16)]
            print(f"{name:<10}{m:>6}{n:>7}{k:>7}  {bf16:>9.4f}{cublas:>11.4f}{ours:>10.4f}  {tf[0]:>12.0f}"
                  f"{tf[1]:>8.0f}{tf[2]:>7.0f}  {cublas / ours:>11.2f}{bf16 / ours:>10.2f}")
    print("ours/cuBLAS and ours/bf16 are speed-ups (> 1: ours faster); times are medians of 30 CUDA-event runs")


if __name__ == "__main__":
    main()
