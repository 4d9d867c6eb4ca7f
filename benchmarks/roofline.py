"""Roofline ESTIMATE, not a measurement, of what fused FP8 kernels should buy on an H100 SXM.

    .venv/bin/python benchmarks/roofline.py [--launch-overhead-us 3] [--hidden 4096 8192]

Each kernel launch costs max(compute time, HBM time) + a fixed launch overhead; a sequence of launches costs the
sum. Shapes: Llama-3-8B (hidden 4096, FFN 14336) and Llama-3-70B (hidden 8192, FFN 28672), one sequence of M
tokens. Use the numbers to rank fusions and to see where memory vs compute bounds bite, not as predicted timings.

Assumptions (identical for the fused and unfused columns, so the comparison is fair):
- Bytes = every operand read once + every output written once, per launch. No L2 reuse across launches: an
  intermediate written by one kernel is read back from HBM by the next. Within one launch, tiles reused through
  L2/SMEM count once (a GEMM reads its weight once; flash attention reads K and V once).
- bf16 = 2 bytes, FP8 = 1 byte. Scale tensors (M + N fp32 values) are ignored: < 0.1% of bytes for these shapes.
  Except in table 1f (block-scaled FP8), whose scale grids are counted: M x K/128 activation scales are ~3% of
  the FP8 activation bytes.
- Matmul FLOPs (2*M*N*K) run on tensor cores at the dense bf16/FP8 peak; elementwise FLOPs (norm, softmax,
  activation, epilogue) run on CUDA cores at the FP32 peak (67 TFLOP/s). The two compute times add.
- "Unfused" = one launch per logical op, each op already a single kernel (RMSNorm, per-token quantize, GEMM,
  SiLU*mul, add), as in a per-nn.Linear FP8 swap of HF Llama: separate q/k/v and gate/up projections.
- FP8 written by a GEMM epilogue uses a static (calibrated) per-tensor scale, because a per-token amax needs the
  whole row and a row spans many N tiles; norm+quantize owns whole rows, so it can use dynamic per-token scales.
- Batch 1. RoPE and KV-cache writes are left out of both columns (unfused would need one more elementwise launch;
  fused could fold RoPE into the qkv epilogue), so the block tables slightly understate the fusion gain.
- Tables 4 and 5 use other GPUs' datasheet peaks (dense), with the same model: 4 (MXFP8) a B200 (HGX B200: FP8 and
  MXFP8 4.5 PFLOP/s, bf16 2.25 PFLOP/s, HBM3e 8 TB/s; CUDA cores 80 TFLOP/s assumed) and, for comparison, the
  sm_90 path on the H100 above (the block GEMM with 1x32 blocks: no scaled MMA, so every 32-wide K step's partial
  product is scaled on CUDA cores); 5 (weight-only FP8) an A100 SXM (bf16 312 TFLOP/s, no FP8 tensor cores, HBM2e
  2.04 TB/s, CUDA cores 19.5 TFLOP/s fp32 / 19.5 TOP/s int32). MX scales are uint8 and counted (M x K/32 + N x K/32
  bytes); the weight-only kernel's decode (DECODE_OPS integer ops per weight element) runs once per BLOCK_M-row
  tile of the output (16 rows up to M = 16, then 64, then 128: the wrapper's tiles) and is counted as CUDA-core work.
  Above weight_only_gemm.DECODE_ONCE_ABOVE_M rows the wrapper decodes W once per call instead (a Triton pass reading
  1 byte and writing 2 per weight element, DECODE_OPS + 1 ops each) and runs cuBLAS's bf16 GEMM, assumed to reach
  the bf16 peak like the fused kernel; that threshold is this model's crossover (weight_only_crossover_m: the
  smallest M from which decoding once is estimated faster for every Llama-3 linear shape) -- an estimate, not a
  measurement on an A100.
- Table 6 (which sm_90 GEMM kernel) models the kernels themselves instead of the peak; its assumptions are in
  gemm_kernel_model's docstring.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from dbr_quant.kernels.triton import block_gemm as triton_block_gemm
from dbr_quant.kernels.triton import gemm as triton_gemm
from dbr_quant.kernels.triton import tma_gemm
from dbr_quant.kernels.triton import weight_only_gemm as triton_weight_only

BF16, FP8 = 2, 1  # bytes per element

# H100 SXM datasheet peaks (dense, i.e. without 2:4 sparsity).
BF16_FLOPS = 989e12
FP8_FLOPS = 1979e12
VECTOR_FLOPS = 67e12  # FP32 on CUDA cores: what elementwise/softmax math runs on
HBM_BYTES_PER_S = 3.35e12

# Elementwise FLOPs per element. Rough counts: they only matter where bytes are tiny or in softmax.
NORM_FLOPS = 4  # square, accumulate, x * rsqrt, * gamma
AMAX_FLOPS = 2  # |x|, running max
QUANT_FLOPS = AMAX_FLOPS + 1  # + x * (1 / scale); clamp and cast not counted
ACT_FLOPS = 5  # SiLU / GELU, roughly
SWIGLU_FLOPS = ACT_FLOPS + 1  # silu(gate) * up
SOFTMAX_FLOPS = 5  # max, subtract, exp, sum, divide
SCALE_FLOPS = 2  # acc * row_scale * col_scale in every FP8 GEMM epilogue
SCALE_BLOCK = 128  # block-scaled FP8 (DeepSeek-V3 layout): 128x128 weight blocks, 1x128 activation groups
BLOCK_SCALE_FLOPS = 3  # per accumulator element per K block: partial * a_scale * w_scale, added to the accumulator

HEAD_DIM, KV_HEADS = 128, 8  # Llama-3 8B and 70B both use 8 KV heads of dim 128 (GQA)
TOKENS = (1, 16, 128, 1024, 4096, 16384)
LABEL = "estimated from a roofline model, not measured"


@dataclass(frozen=True)
class Kernel:
    """One launch: tensor-core FLOPs, CUDA-core FLOPs and HBM bytes."""

    name: str
    mma_flops: float
    vec_flops: float
    bytes: float
    mma_peak: float = FP8_FLOPS
    vector_peak: float = VECTOR_FLOPS
    hbm_bytes_per_s: float = HBM_BYTES_PER_S

    @property
    def flops(self) -> float:
        return self.mma_flops + self.vec_flops

    def compute_s(self) -> float:
        return self.mma_flops / self.mma_peak + self.vec_flops / self.vector_peak

    def memory_s(self) -> float:
        return self.bytes / self.hbm_bytes_per_s

    def time_s(self, overhead_s: float) -> float:
        return max(self.compute_s(), self.memory_s()) + overhead_s


Seqs = dict[str, list[Kernel]]  # named launch sequences; the last one is the fused variant


def elementwise(name: str, n: float, read: int, write: int, flops: float, extra_bytes: float = 0.0) -> Kernel:
    """n elements, `read`/`write` bytes per element; extra_bytes for small side operands (gamma, bias)."""
    return Kernel(name, 0.0, flops * n, n * (read + write) + extra_bytes)


def gemm(
    name: str,
    m: int,
    n: int,
    k: int,
    *,
    in_bytes: int = FP8,
    out_bytes: int = BF16,
    out_cols: int | None = None,
    epi_flops: float = SCALE_FLOPS,
    extra_bytes: float = 0.0,
) -> Kernel:
    """C[m, out_cols] = epilogue(A[m, k] @ W[n, k]^T). A and W are read once each, C written once.

    out_cols < n when the epilogue combines columns (SwiGLU halves them); epi_flops is per accumulator element;
    extra_bytes covers epilogue operands (bias, residual).
    """
    out_cols = n if out_cols is None else out_cols
    peak = FP8_FLOPS if in_bytes == FP8 else BF16_FLOPS
    nbytes = (m * k + n * k) * in_bytes + m * out_cols * out_bytes + extra_bytes
    return Kernel(name, 2.0 * m * n * k, epi_flops * m * n, nbytes, peak)


def quantize(m: int, k: int) -> Seqs:
    """(a) Dynamic per-token bf16 -> FP8: amax kernel + quantize kernel (two reads) vs one kernel (one read)."""
    return {
        "unfused FP8": [
            elementwise("amax", m * k, BF16, 0, AMAX_FLOPS),
            elementwise("quantize", m * k, BF16, FP8, QUANT_FLOPS - AMAX_FLOPS),
        ],
        "fused FP8": [elementwise("quantize (per-token, 1 pass)", m * k, BF16, FP8, QUANT_FLOPS)],
    }


def norm_quant(m: int, k: int) -> Seqs:
    """(b) RMSNorm writing bf16 + quantize reading it back vs one kernel writing FP8 directly."""
    # The unfused quantize is the one-pass kernel from (a), so this isolates the norm fusion.
    return {
        "unfused FP8": [
            elementwise("rmsnorm", m * k, BF16, BF16, NORM_FLOPS, k * BF16),
            quantize(m, k)["fused FP8"][0],
        ],
        "fused FP8": [elementwise("rmsnorm+quantize", m * k, BF16, FP8, NORM_FLOPS + QUANT_FLOPS, k * BF16)],
    }


def gemm_epilogue(m: int, n: int, k: int, *, bias: bool, act: bool, residual: bool, fp8_out: bool) -> Seqs:
    """(c) FP8 GEMM with scale/bias/act/residual/FP8-out fused vs FP8 GEMM writing bf16 + one kernel per op."""
    # Every FP8 GEMM applies its scales in the epilogue (as torch._scaled_mm does), so scaling is never separate.
    unfused = [gemm("fp8 gemm (bf16 out)", m, n, k)]
    epi, extra = float(SCALE_FLOPS), 0.0
    if bias:
        unfused.append(elementwise("bias add", m * n, BF16, BF16, 1, n * BF16))
        epi, extra = epi + 1, extra + n * BF16
    if act:
        unfused.append(elementwise("activation", m * n, BF16, BF16, ACT_FLOPS))
        epi += ACT_FLOPS
    if residual:
        unfused.append(elementwise("residual add", m * n, 2 * BF16, BF16, 1))
        epi, extra = epi + 1, extra + m * n * BF16
    if fp8_out:
        unfused.append(elementwise("quantize (static)", m * n, BF16, FP8, 1))
        epi += 1
    fused = gemm("fp8 gemm + epilogue", m, n, k, out_bytes=FP8 if fp8_out else BF16, epi_flops=epi, extra_bytes=extra)
    return {"unfused FP8": unfused, "fused FP8": [fused]}


def mlp(m: int, h: int, f: int) -> Seqs:
    """(d) Llama MLP x + down(silu(gate(n)) * up(n)), n = rmsnorm(x): bf16, unfused FP8 (8), fused FP8 (3)."""
    bf16 = [
        elementwise("rmsnorm", m * h, BF16, BF16, NORM_FLOPS, h * BF16),
        gemm("gate_proj", m, f, h, in_bytes=BF16, epi_flops=0),
        gemm("up_proj", m, f, h, in_bytes=BF16, epi_flops=0),
        elementwise("silu(gate)*up", m * f, 2 * BF16, BF16, SWIGLU_FLOPS),
        gemm("down_proj", m, h, f, in_bytes=BF16, epi_flops=0),
        elementwise("residual add", m * h, 2 * BF16, BF16, 1),
    ]
    unfused = [
        *norm_quant(m, h)["unfused FP8"],  # 1 rmsnorm, 2 quantize
        gemm("gate_proj fp8", m, f, h),  # 3
        gemm("up_proj fp8", m, f, h),  # 4
        elementwise("silu(gate)*up", m * f, 2 * BF16, BF16, SWIGLU_FLOPS),  # 5
        quantize(m, f)["fused FP8"][0],  # 6
        gemm("down_proj fp8", m, h, f),  # 7
        elementwise("residual add", m * h, 2 * BF16, BF16, 1),  # 8
    ]
    # fc1: gate and up as one GEMM of 2f columns (interleaved so each tile holds matching gate/up columns); the
    # epilogue emits silu(gate)*up in FP8, so only f columns hit HBM. SwiGLU + quantize run on half the outputs.
    fc1_epi = SCALE_FLOPS + (SWIGLU_FLOPS + 1) / 2
    fused = [
        *norm_quant(m, h)["fused FP8"],
        gemm("gate|up + SwiGLU (FP8 out)", m, 2 * f, h, out_bytes=FP8, out_cols=f, epi_flops=fc1_epi),
        gemm("down + residual", m, h, f, epi_flops=SCALE_FLOPS + 1, extra_bytes=m * h * BF16),
    ]
    return {"bf16": bf16, "unfused FP8": unfused, "fused FP8": fused}


def attention(s: int, h: int) -> Seqs:
    """(e) Causal GQA attention over one sequence of s tokens; Q, K, V already FP8, output O quantized to FP8."""
    heads, d = h // HEAD_DIM, HEAD_DIM
    q, kv = s * heads * d, s * KV_HEADS * d  # elements of Q (= O) and of each of K, V
    pairs = s * (s + 1) / 2  # causal: query i attends keys 0..i, so flash attention skips the masked half
    flash = Kernel(
        "flash attention fp8 (FP8 out)",
        4.0 * d * heads * pairs,  # QK^T and PV: 2*d FLOPs each per (query, key) pair per head
        SOFTMAX_FLOPS * heads * pairs,
        (q + 2 * kv) * FP8 + q * FP8,  # S and P stay on chip; O written once in FP8
    )
    # Unfused batched GEMMs and softmax process the full s x s scores: they do not skip masked tiles.
    scores = heads * s * s
    unfused = [
        Kernel("S = QK^T (bf16 out)", 2.0 * d * scores, scores, (q + kv) * FP8 + scores * BF16),
        elementwise("mask + softmax (FP8 P)", scores, BF16, FP8, SOFTMAX_FLOPS),
        Kernel("O = PV (bf16 out)", 2.0 * d * scores, q, scores * FP8 + kv * FP8 + q * BF16),
        elementwise("quantize O", q, BF16, FP8, QUANT_FLOPS),
    ]
    return {"unfused FP8": unfused, "fused FP8": [flash]}


def block(s: int, h: int, f: int) -> Seqs:
    """Pre-norm Llama block: x += o_proj(attn(qkv(norm(x)))); x += mlp(x). Unfused FP8 (22) vs fused FP8 (7)."""
    q_cols, kv_cols = h, KV_HEADS * HEAD_DIM
    att, ml = attention(s, h), mlp(s, h, f)
    unfused = [
        *norm_quant(s, h)["unfused FP8"],
        gemm("q_proj fp8", s, q_cols, h),
        gemm("k_proj fp8", s, kv_cols, h),
        gemm("v_proj fp8", s, kv_cols, h),
        quantize(s, q_cols)["fused FP8"][0],
        quantize(s, kv_cols)["fused FP8"][0],
        quantize(s, kv_cols)["fused FP8"][0],
        *att["unfused FP8"],
        gemm("o_proj fp8", s, h, q_cols),
        elementwise("residual add", s * h, 2 * BF16, BF16, 1),
        *ml["unfused FP8"],
    ]
    fused = [
        *norm_quant(s, h)["fused FP8"],
        gemm("qkv (FP8 out)", s, q_cols + 2 * kv_cols, h, out_bytes=FP8, epi_flops=SCALE_FLOPS + 1),
        *att["fused FP8"],
        gemm("o_proj + residual", s, h, q_cols, epi_flops=SCALE_FLOPS + 1, extra_bytes=s * h * BF16),
        *ml["fused FP8"],
    ]
    return {"unfused FP8": unfused, "fused FP8": fused}


MOE_EXPERTS, MOE_TOP_K = 8, 2  # Mixtral-8x7B: 8 experts, top-2, hidden 4096, expert FFN 14336 (= ffn(4096))


def moe_block(m: int, h: int, f: int, experts: int = MOE_EXPERTS, top_k: int = MOE_TOP_K) -> Seqs:
    """(3) MoE experts after routing: out[t] = sum_j w[t, j] * down_e(silu(gate_e(x_t)) * up_e(x_t)).

    Routing (router GEMM, softmax, top-k, sort) is identical in every column and left out. The m*top_k rows
    are assumed spread over min(experts, m*top_k) experts evenly (balanced load: the most weight traffic, and
    what a uniform router gives at decode as soon as m*top_k >= experts). Loops run one expert at a time, as
    HF's eager MixtralExperts does; "fused FP8 grouped" is dbr_quant's kernels.fp8_moe_block: per-token
    quantize, gate|up grouped GEMM with SwiGLU and FP8 out, down grouped GEMM with the routing-weighted
    scatter-add as fp32 atomics (counted as one 4-byte write per row element), plus the memset that zeroes
    the fp32 output (3 kernels + 1 memset). Tensor-core FLOPs count useful rows only: at decode a grouped
    tile pads each expert's rows to 64, which costs tensor-core time but no bytes, and decode is memory-bound.
    """
    rows = m * top_k
    active = min(experts, rows)
    per = rows // active  # rows per active expert; whole for TOKENS (m*top_k is 2, or a multiple of 8)
    bf16, fp8 = [], []
    for _ in range(active):
        # the combine: out[tokens] += w * y, reading y and out, writing out (bf16)
        combine = elementwise("x routing weight, index_add", per * h, 2 * BF16, BF16, 2)
        gather = elementwise("gather rows", per * h, BF16, BF16, 0)
        bf16 += [
            gather,
            gemm("gate_up", per, 2 * f, h, in_bytes=BF16, epi_flops=0),
            elementwise("silu(gate)*up", per * f, 2 * BF16, BF16, SWIGLU_FLOPS),
            gemm("down", per, h, f, in_bytes=BF16, epi_flops=0),
            combine,
        ]
        fp8 += [gather, quantize(per, h)["fused FP8"][0], mlp(per, h, f)["fused FP8"][1],  # gate|up+SwiGLU, FP8 out
                gemm("down fp8", per, h, f), combine]

    def grouped(name: str, n: int, k: int, out_bytes: int, out_cols: int, epi: float) -> Kernel:
        """One launch over every active expert: each gathered row and each active expert's weight read once."""
        nbytes = (rows * k + active * n * k) * FP8 + rows * out_cols * out_bytes
        return Kernel(name, 2.0 * rows * n * k, epi * rows * n, nbytes)

    fused = [
        quantize(m, h)["fused FP8"][0],
        elementwise("zero fp32 output (memset)", m * h, 0, 4, 0),
        grouped("gate|up grouped + SwiGLU (FP8 out)", 2 * f, h, FP8, f, SCALE_FLOPS + (SWIGLU_FLOPS + 1) / 2),
        grouped("down grouped + weighted scatter-add", h, f, 4, h, SCALE_FLOPS + 2),
    ]
    return {"bf16 loop": bf16, "FP8 loop": fp8, "fused FP8 grouped": fused}
def block_scaled(m: int, n: int, k: int) -> Seqs:
    """(f) One FP8 linear, bf16 x in, bf16 out: per-tensor scales vs block scales (128x128 W, per-token 1x128 x).

    per-tensor: static-scale quantize (one pass) + GEMM scaling once in the epilogue. block: dynamic per-token-group
    quantize (one pass, also writes M x K/128 fp32 scales) + a GEMM that scales every K block's partial product on
    CUDA cores (BLOCK_SCALE_FLOPS per output per K block, not overlapped with the MMAs here) and reads both scale
    grids. The activation-side cost of block scaling is the dynamic amax, which per-token FP8 pays as well.
    """
    kb, nb = math.ceil(k / SCALE_BLOCK), math.ceil(n / SCALE_BLOCK)
    a_scales, w_scales = m * kb * 4, nb * kb * 4  # fp32
    return {
        "per-tensor FP8": [
            elementwise("quantize (static per-tensor)", m * k, BF16, FP8, QUANT_FLOPS - AMAX_FLOPS),
            gemm("fp8 gemm (per-tensor scales)", m, n, k),
        ],
        "block FP8": [
            elementwise("group quantize (dynamic, 1 pass)", m * k, BF16, FP8, QUANT_FLOPS, a_scales),
            gemm("block fp8 gemm", m, n, k, epi_flops=BLOCK_SCALE_FLOPS * kb, extra_bytes=a_scales + w_scales),
        ],
    }


# Table 6: sustained fraction of the dense FP8 peak of a Triton FP8 GEMM main loop at large shapes on an H100 SXM,
# both with fast accumulation (no promotion), from published measurements:
TMA_PERSISTENT_EFFICIENCY = 1347 / 1979  # TMA-persistent tutorial kernel, 8192x8192x4096 (triton-lang/triton#5461)
POINTER_EFFICIENCY = 1280 / 1979  # pointer loads (cp.async) + wgmma, tutorial 03, 3584^3 (triton-lang/triton#3546)
H100_SMS = 132
PROMOTE_FLOPS = 1  # per accumulator element per K step: the step's wgmma partial added to the fp32 accumulator


def gemm_kernel_model(cfg: triton_gemm.GemmConfig, efficiency: float, m: int, n: int, k: int, *,
                      block_scaled: bool = False) -> Kernel:
    """(6) One dbr_quant FP8 linear (bf16 out) run by the kernel with tile config ``cfg``. Assumptions:

    - The main loop sustains ``efficiency`` x the dense FP8 peak per SM (the anchors above; whatever TMA and
      persistence buy beyond that is not modelled), one CTA per SM (both kernels use ~230 of 255 registers with
      256 threads), and a tile takes the same time on every SM.
    - Wave quantization and padding: ceil(M/BM) x ceil(N/BN) tiles run in ceil(tiles / 132) waves and a
      partial tile costs a whole one, so tensor-core time is that of the padded tiles in whole waves. A
      persistent kernel has the same waves; it saves the launch of each CTA, not modelled.
    - Per K step, each accumulator element is promoted (dense: max_num_imprecise_acc = BLOCK_K) or scaled
      (block: BLOCK_SCALE_FLOPS) on CUDA cores, not overlapped with the MMAs (an upper bound): BLOCK_K 128
      (TMA) pays this half as often as BLOCK_K 64 (the pointer kernel's large tile).
    - Bytes as gemm(): operands and output once (HBM roofline), scale tensors ignored.
    - Nothing else of the tile shape: the TMA kernel's 128x64 tile (gated and block-scaled linears, chosen so the
      epilogue does not spill) reads 1.33x the shared memory per FLOP of the anchors' 128x128+ tiles, which may
      keep it below the anchor; dense ungated linears take the 128x128x128 "tma-wide" tile (tma_gemm.tma_config).
    """
    tiles_m, tiles_n = math.ceil(m / cfg.BLOCK_M), math.ceil(n / cfg.BLOCK_N)
    tiles = tiles_m * tiles_n
    waves = math.ceil(tiles / H100_SMS)
    utilization = (m * n) / (tiles_m * cfg.BLOCK_M * tiles_n * cfg.BLOCK_N) * tiles / (waves * H100_SMS)
    steps = math.ceil(k / cfg.BLOCK_K)
    epi = SCALE_FLOPS + steps * (BLOCK_SCALE_FLOPS if block_scaled else PROMOTE_FLOPS)
    base = gemm(cfg.name, m, n, k, epi_flops=epi)
    return dataclasses.replace(base, mma_peak=FP8_FLOPS * efficiency * utilization)


def sm90_gemms(m: int, n: int, k: int) -> dict[str, Kernel]:
    """(6) The dense and block-scaled linears by the pointer kernel (gemm.pick_config / block_gemm's config for M)
    and by the TMA persistent kernel (tma_gemm.TMA_CONFIGS), whichever the dispatcher would pick."""
    return {
        "dense pointer": gemm_kernel_model(triton_gemm.pick_config(m), POINTER_EFFICIENCY, m, n, k),
        "dense TMA": gemm_kernel_model(tma_gemm.tma_config(False, False), TMA_PERSISTENT_EFFICIENCY, m, n, k),
        "block pointer": gemm_kernel_model(triton_block_gemm.pick_block_config(m), POINTER_EFFICIENCY, m, n, k,
                                           block_scaled=True),
        "block TMA": gemm_kernel_model(tma_gemm.tma_config(False, True), TMA_PERSISTENT_EFFICIENCY, m, n, k,
                                       block_scaled=True),
    }


def print_sm90_gemm_table(hiddens: list[int], overhead_s: float) -> None:
    """(6) Estimated TFLOP/s of each kernel on Llama-3 linear shapes, the dispatcher's pick, and TMA's speedup."""
    print(f"\n6. H100 sm_90 FP8 linear (bf16 out) by kernel: pointer (cp.async) vs TMA persistent -- {LABEL}. "
          "Measured on an H100 (README, 'Measured on a GPU'): both kernels reach 400-700 TFLOP/s at M >= 512 and the "
          "TMA one is slower in 24 of 25 rows, so the dispatcher picks the pointer kernel "
          f"(tma_gemm.AUTO_TMA={tma_gemm.AUTO_TMA}); 'picked' below is the rule with AUTO_TMA on "
          f"(TMA for M > {tma_gemm.TMA_MIN_ROWS})")
    names = list(sm90_gemms(1, 128, 128))
    print(f"{'layer':>22} {'M':>6} {'N':>6} {'K':>6} | " + " ".join(f"{n:>13}" for n in names)
          + f" | {'picked':>7} | TMA speedup dense, block")
    for h in hiddens:
        f = ffn(h)
        layers = {f"{h} qkv": (h + 2 * KV_HEADS * HEAD_DIM, h), f"{h} o_proj": (h, h), f"{h} gate|up": (2 * f, h),
                  f"{h} down": (h, f)}
        for m in (1, 16, 512, 2048, 8192):
            for layer, (n, k) in layers.items():
                times = {name: kern.time_s(overhead_s) for name, kern in sm90_gemms(m, n, k).items()}
                tflops = " ".join(f"{2.0 * m * n * k / t / 1e12:>13.0f}" for t in times.values())
                picked = "TMA" if m > tma_gemm.TMA_MIN_ROWS else "pointer"
                dense, block = (times[f"{kind} pointer"] / times[f"{kind} TMA"] for kind in ("dense", "block"))
                print(f"{layer:>22} {m:>6} {n:>6} {k:>6} | {tflops} | {picked:>7} | {dense:>5.2f}x {block:>5.2f}x")
    anchor = sm90_gemms(8192, 8192, 4096)["dense TMA"]
    print(f"  anchor 8192x8192x4096: TMA {2.0 * 8192 * 8192 * 4096 / anchor.time_s(0.0) / 1e12:.0f} TFLOP/s modelled "
          f"(with per-step promotion) vs 1347 measured with fast accumulation (triton-lang/triton#5461)")


@dataclass(frozen=True)
class Gpu:
    """Datasheet peaks (dense) of a GPU other than the H100 above; fp8 0 where it has no FP8 tensor cores."""

    name: str
    bf16: float
    fp8: float
    vector: float
    hbm: float

    def on(self, k: Kernel) -> Kernel:
        """``k`` with this GPU's peaks (its tensor-core peak picked by the operand type it was built for)."""
        peak = self.bf16 if k.mma_peak == BF16_FLOPS or not k.mma_flops else self.fp8
        if k.mma_flops and not peak:
            raise ValueError(f"{self.name} has no FP8 tensor cores to run {k.name!r}")
        return Kernel(k.name, k.mma_flops, k.vec_flops, k.bytes, peak, self.vector, self.hbm)


B200 = Gpu("B200", bf16=2.25e15, fp8=4.5e15, vector=80e12, hbm=8.0e12)
A100 = Gpu("A100 SXM", bf16=312e12, fp8=0.0, vector=19.5e12, hbm=2.039e12)
MX_BLOCK = 32  # OCP MX: one uint8 E8M0 scale per 32 elements along K
DECODE_OPS = 6  # FP8 -> bf16 by bit moves per weight element: shift, mask, add, select, sign, convert


def mx_linear(m: int, n: int, k: int) -> Seqs:
    """(4) One linear, bf16 x in, bf16 out, on a B200: bf16, FP8 per-tensor (static quantize + GEMM), MXFP8 (dynamic
    MX quantize writing M x K/32 uint8 scales in one pass + tl.dot_scaled: the tensor core applies the scales, the
    epilogue only adds). Scales of MX counted as bytes."""
    a_scales, w_scales = m * math.ceil(k / MX_BLOCK), n * math.ceil(k / MX_BLOCK)  # uint8
    return {
        "bf16": [B200.on(gemm("bf16 gemm", m, n, k, in_bytes=BF16, epi_flops=0))],
        "FP8 per-tensor": [B200.on(elementwise("quantize (static per-tensor)", m * k, BF16, FP8, 1)),
                           B200.on(gemm("fp8 gemm", m, n, k))],
        "MXFP8 (dot_scaled)": [B200.on(elementwise("mx quantize (dynamic, 1 pass)", m * k, BF16, FP8, QUANT_FLOPS,
                                                   a_scales)),
                               B200.on(gemm("mxfp8 gemm", m, n, k, epi_flops=0, extra_bytes=a_scales + w_scales))],
    }


def mx_on_hopper(m: int, n: int, k: int) -> Seqs:
    """(4b) The same linear on the H100 model: FP8 per-tensor vs MXFP8 through the block GEMM (sm_89/90 path): every
    32-wide K step's partial product scaled on CUDA cores (BLOCK_SCALE_FLOPS per output per K block)."""
    kb = math.ceil(k / MX_BLOCK)
    a_scales, w_scales = m * kb, n * kb
    return {
        "FP8 per-tensor": [elementwise("quantize (static per-tensor)", m * k, BF16, FP8, 1), gemm("fp8 gemm", m, n, k)],
        "MXFP8 (block path)": [elementwise("mx quantize (dynamic, 1 pass)", m * k, BF16, FP8, QUANT_FLOPS, a_scales),
                               gemm("block fp8 gemm, 1x32", m, n, k, epi_flops=BLOCK_SCALE_FLOPS * kb,
                                    extra_bytes=a_scales + w_scales)],
    }


def weight_only_fused(m: int, n: int, k: int) -> Kernel:
    """The weight-only kernel: W read as one byte per element, decoded in the K loop once per BLOCK_M-row tile of the
    output (the wrapper's tiles), bf16 MMA, the per-channel scale in the epilogue."""
    decode = DECODE_OPS * n * k * math.ceil(m / triton_weight_only.pick_config(m).BLOCK_M)
    return A100.on(Kernel("weight-only gemm (decode in K loop)", 2.0 * m * n * k, decode + SCALE_FLOPS * m * n,
                          m * k * BF16 + n * k * FP8 + m * n * BF16, BF16_FLOPS))


def weight_only_decode_once(m: int, n: int, k: int) -> list[Kernel]:
    """The prefill path: W decoded once to bf16 with its scale (FP8 in, bf16 out, fp32 scales), then cuBLAS."""
    return [A100.on(elementwise("decode W once (fp8 -> bf16, scaled)", n * k, FP8, BF16, DECODE_OPS + 1, 4.0 * n)),
            A100.on(gemm("bf16 gemm (cuBLAS)", m, n, k, in_bytes=BF16, epi_flops=0))]


def weight_only(m: int, n: int, k: int) -> Seqs:
    """(5) One linear, bf16 x in, bf16 out, on an A100: bf16 weights; FP8 weights through the torch path the
    dispatcher took before (an upcast kernel writing W in bf16, then the bf16 GEMM reading it); FP8 weights through
    the fused weight-only kernel; and what the wrapper dispatches: the fused kernel up to DECODE_ONCE_ABOVE_M rows,
    above it the decode-once pass + cuBLAS."""
    fused = [weight_only_fused(m, n, k)]
    return {
        "bf16": [A100.on(gemm("bf16 gemm", m, n, k, in_bytes=BF16, epi_flops=0))],
        "upcast + bf16": [A100.on(elementwise("fp8 -> bf16 upcast of W", n * k, FP8, BF16, 1)),
                          A100.on(gemm("bf16 gemm", m, n, k, in_bytes=BF16, epi_flops=0))],
        "W8A16 fused": fused,
        "W8A16 dispatched": (fused if triton_weight_only.pick_path(m) == "fused"
                             else weight_only_decode_once(m, n, k)),
    }


def weight_only_crossover_m(hiddens: tuple[int, ...] = (4096, 8192), overhead_s: float = 3e-6,
                            limit: int = 16384) -> int:
    """The smallest M from which decoding once + cuBLAS is estimated faster than the fused kernel for every Llama-3
    linear shape (N = K = hidden, the FFN's up and down projections) and every larger M up to ``limit``."""
    shapes = [(n, k) for h in hiddens for n, k in ((h, h), (ffn(h), h), (h, ffn(h)))]
    def once_wins(m: int) -> bool:
        return all(seq_time_s(weight_only_decode_once(m, n, k), overhead_s)
                   < seq_time_s([weight_only_fused(m, n, k)], overhead_s) for n, k in shapes)
    m = limit
    while m > 1 and once_wins(m - 1):
        m -= 1
    return m


def ffn(hidden: int) -> int:
    return hidden * 7 // 2  # Llama-3: 4096 -> 14336, 8192 -> 28672


def seq_time_s(kernels: list[Kernel], overhead_s: float) -> float:
    return sum(k.time_s(overhead_s) for k in kernels)


def print_table(title: str, family: Callable[[int, int, int], Seqs], hiddens: list[int], overhead_s: float,
                ratio: str = "fused speedup vs") -> None:
    """One row per (hidden, M): launches, GFLOP, MB, est. us per sequence, then the last variant's speedup vs each
    other one (> 1: the last is faster)."""
    names = list(family(1, hiddens[0], ffn(hiddens[0])))
    others = names[:-1]
    print(f"\n{title} -- {LABEL}")
    groups = " | ".join(f"{n:^35}" for n in names)
    print(f"{'':13} | {groups} | {ratio}")
    cols = " | ".join(f"{'launch':>6} {'GFLOP':>9} {'MB':>8} {'est us':>8}" for _ in names)
    print(f"{'hidden':>6} {'M':>6} | {cols} | " + " ".join(f"{n:>11}" for n in others))
    for h in hiddens:
        for m in TOKENS:
            seqs = family(m, h, ffn(h))
            times = {n: seq_time_s(ks, overhead_s) for n, ks in seqs.items()}
            cells = " | ".join(
                f"{len(ks):>6} {sum(k.flops for k in ks) / 1e9:>9.4g} {sum(k.bytes for k in ks) / 1e6:>8.4g}"
                f" {times[n] * 1e6:>8.1f}"
                for n, ks in seqs.items()
            )
            speedups = " ".join(f"{times[n] / times[names[-1]]:>10.2f}x" for n in others)
            print(f"{h:>6} {m:>6} | {cells} | {speedups}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--launch-overhead-us", type=float, default=3.0, help="fixed cost added to every launch")
    p.add_argument("--hidden", type=int, nargs="+", default=[4096, 8192], help="model widths (FFN = 3.5x)")
    args = p.parse_args(argv)
    hs, ov = args.hidden, args.launch_overhead_us * 1e-6
    peaks = f"bf16 {BF16_FLOPS / 1e12:g} / FP8 {FP8_FLOPS / 1e12:g} / CUDA-core {VECTOR_FLOPS / 1e12:g} TFLOP/s"
    hbm = f"HBM {HBM_BYTES_PER_S / 1e12:g} TB/s, {args.launch_overhead_us:g} us/launch"
    print(f"H100 SXM roofline, {LABEL}: {peaks}, {hbm}")

    print_table("1a. Quantize x[M, hidden] bf16 -> FP8", lambda m, h, f: quantize(m, h), hs, ov)
    print_table("1b. RMSNorm + quantize x[M, hidden]", lambda m, h, f: norm_quant(m, h), hs, ov)
    fc1 = dict(bias=True, act=True, residual=False, fp8_out=True)  # non-gated fc1 feeding an FP8 fc2
    proj = dict(bias=True, act=False, residual=True, fp8_out=False)  # o_proj / fc2 adding into the residual
    print_table(
        "1c. FP8 GEMM N=FFN K=hidden, scale+bias+act, FP8 out", lambda m, h, f: gemm_epilogue(m, f, h, **fc1), hs, ov
    )
    print_table(
        "1c. FP8 GEMM N=K=hidden, scale+bias+residual, bf16 out", lambda m, h, f: gemm_epilogue(m, h, h, **proj), hs, ov
    )
    print_table("1d. Llama MLP (SwiGLU)", mlp, hs, ov)
    print_table("1e. Causal GQA attention, seq len = M, 8 KV heads of 128", lambda m, h, f: attention(m, h), hs, ov)
    print_table("1f. FP8 linear N=K=hidden: block scales (128x128 W, 1x128 x) vs per-tensor",
                lambda m, h, f: block_scaled(m, h, h), hs, ov, ratio="block speedup vs")

    print(f"\n2. Launches per MLP and per transformer block (hidden {hs[0]}, M=1; counts do not depend on shape)")
    for what, seqs in (("MLP", mlp(1, hs[0], ffn(hs[0]))), ("block", block(1, hs[0], ffn(hs[0])))):
        for name, ks in seqs.items():
            print(f"  {what:5} {name:11} {len(ks):>2}: " + ", ".join(k.name for k in ks))
    print_table("2. Transformer block (norm, qkv, attention, o_proj, MLP)", block, hs, ov)
    print_table(f"3. Mixtral-8x7B MoE experts after routing ({MOE_EXPERTS} experts, top-{MOE_TOP_K}, I = 14336; "
                "decode M <= 16, prefill M = 4096)", moe_block, [4096], ov)
    print_table("4. B200: linear N=K=hidden, MXFP8 (tl.dot_scaled) vs FP8 per-tensor vs bf16",
                lambda m, h, f: mx_linear(m, h, h), hs, ov, ratio="MXFP8 speedup vs")
    print_table("4b. H100: linear N=K=hidden, MXFP8 through the block GEMM (sm_90 path) vs FP8 per-tensor",
                lambda m, h, f: mx_on_hopper(m, h, h), hs, ov, ratio="MXFP8 speedup vs")
    print_table(f"5. A100: linear N=K=hidden, weight-only FP8 as dispatched (fused kernel up to M = "
                f"{triton_weight_only.DECODE_ONCE_ABOVE_M}, then decode once + cuBLAS; the model's crossover: M = "
                f"{weight_only_crossover_m()}) vs the fused kernel alone vs upcast + bf16 GEMM vs bf16",
                lambda m, h, f: weight_only(m, h, h), hs, ov, ratio="W8A16 dispatched speedup vs")
    print_sm90_gemm_table(hs, ov)


if __name__ == "__main__":
    main()
