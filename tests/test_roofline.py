"""benchmarks/roofline.py: the arithmetic checked against numbers worked out by hand, not by the module's helpers."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[1] / "benchmarks" / "roofline.py"


@pytest.fixture(scope="module")
def rl():
    # benchmarks/ is not a package, so load the script by path; dataclasses need it in sys.modules while executing.
    spec = importlib.util.spec_from_file_location("roofline", _PATH)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["roofline"] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop("roofline", None)


def total_bytes(kernels) -> float:
    return sum(k.bytes for k in kernels)


def test_fp8_gemm_flops_bytes_time(rl):
    k = rl.gemm("g", 1024, 4096, 4096)
    assert k.mma_flops == 34_359_738_368  # 2 * 1024 * 4096 * 4096
    # A 1024x4096 FP8 + W 4096x4096 FP8 + C 1024x4096 bf16 = 4 MiB + 16 MiB + 8 MiB
    assert k.bytes == 4_194_304 + 16_777_216 + 8_388_608
    # Compute-bound: 17.36 us on tensor cores + 0.125 us of scaling on CUDA cores > 8.76 us of HBM traffic.
    expected = 34_359_738_368 / 1979e12 + 2 * 1024 * 4096 / 67e12 + 3e-6
    assert k.time_s(3e-6) == pytest.approx(expected, rel=1e-12)
    assert k.time_s(3e-6) * 1e6 == pytest.approx(20.49, abs=0.01)


def test_bf16_gemm_uses_bf16_peak_and_two_byte_operands(rl):
    k = rl.gemm("g", 16, 4096, 4096, in_bytes=2, epi_flops=0)
    assert k.bytes == (16 * 4096 + 4096 * 4096) * 2 + 16 * 4096 * 2
    # Memory-bound at M=16: the 32 MiB weight dominates.
    assert k.time_s(0.0) == pytest.approx(k.bytes / 3.35e12)
    assert k.compute_s() == pytest.approx(2 * 16 * 4096 * 4096 / 989e12)


def test_time_is_max_of_compute_and_memory_plus_overhead(rl):
    memory_bound = rl.Kernel("m", mma_flops=1979e12 * 1e-3, vec_flops=0.0, bytes=3.35e12 * 2e-3)
    assert memory_bound.time_s(3e-6) == pytest.approx(2e-3 + 3e-6)
    compute_bound = rl.Kernel("c", mma_flops=1979e12 * 4e-3, vec_flops=67e12 * 1e-3, bytes=3.35e12 * 2e-3)
    assert compute_bound.time_s(5e-6) == pytest.approx(4e-3 + 1e-3 + 5e-6)
    assert rl.seq_time_s([memory_bound, compute_bound], 1e-6) == pytest.approx(2e-3 + 5e-3 + 2e-6)


def test_quantize_one_read_vs_two(rl):
    seqs = rl.quantize(128, 4096)
    assert total_bytes(seqs["fused FP8"]) == 128 * 4096 * (2 + 1)  # read bf16, write FP8
    assert total_bytes(seqs["unfused FP8"]) == 128 * 4096 * (2 + 2 + 1)  # amax reads, quantize reads + writes
    assert [len(s) for s in seqs.values()] == [2, 1]


def test_norm_quant_bytes(rl):
    seqs = rl.norm_quant(1024, 4096)
    gamma = 4096 * 2
    assert total_bytes(seqs["fused FP8"]) == 1024 * 4096 * 3 + gamma
    # norm: read bf16 + write bf16; quantize: read bf16 back + write FP8
    assert total_bytes(seqs["unfused FP8"]) == 1024 * 4096 * (4 + 3) + gamma


def test_gemm_epilogue_launches_and_bytes(rl):
    m, n, k = 1024, 4096, 4096
    seqs = rl.gemm_epilogue(m, n, k, bias=True, act=True, residual=True, fp8_out=True)
    assert len(seqs["unfused FP8"]) == 5 and len(seqs["fused FP8"]) == 1
    operands = m * k + n * k  # FP8 A and W
    assert total_bytes(seqs["fused FP8"]) == operands + n * 2 + m * n * 2 + m * n  # + bias + residual + FP8 out
    elementwise = n * 2 + m * n * (4 + 4 + 6 + 3)  # bias, act, residual (2 reads), quantize
    assert total_bytes(seqs["unfused FP8"]) == operands + m * n * 2 + elementwise
    assert seqs["fused FP8"][0].mma_flops == 2 * m * n * k


def test_mlp_launch_counts_and_hand_computed_bytes(rl):
    h, f = 4096, 14336
    seqs = rl.mlp(1, h, f)
    assert [len(seqs[n]) for n in ("bf16", "unfused FP8", "fused FP8")] == [6, 8, 3]
    # M=1, fused: norm+quant, gate|up GEMM (2f x h FP8 weight, f FP8 outputs), down GEMM (+ bf16 residual in/out)
    fused = (h * 2 + h + h * 2) + (h + 2 * f * h + f) + (f + h * f + h * 2 + h * 2)
    assert fused == 176_230_400
    assert total_bytes(seqs["fused FP8"]) == fused
    unfused = (h * 4 + h * 2) + h * 3 + 2 * (h + f * h + f * 2) + f * 6 + f * 3 + (f + h * f + h * 2) + h * 6
    assert total_bytes(seqs["unfused FP8"]) == unfused
    assert sum(k.mma_flops for k in seqs["fused FP8"]) == 6 * 1 * h * f  # 2*M*(2f)*h + 2*M*h*f


def test_attention_causal_flops_and_bytes(rl):
    s, heads, d = 1024, 32, 128
    seqs = rl.attention(s, 4096)
    assert seqs["fused FP8"][0].mma_flops == 8_598_323_200  # 4 * d * heads * s*(s+1)/2
    assert sum(k.mma_flops for k in seqs["unfused FP8"]) == 17_179_869_184  # 4 * d * heads * s*s, no skipping
    q, kv = s * heads * d, s * 8 * d
    assert total_bytes(seqs["fused FP8"]) == q + 2 * kv + q == 10_485_760
    scores = heads * s * s
    assert total_bytes(seqs["unfused FP8"]) == (q + kv + 2 * scores) + 3 * scores + (scores + kv + 2 * q) + 3 * q


def test_block_launches_and_fused_always_moves_fewer_bytes(rl):
    seqs = rl.block(1, 4096, 14336)
    assert len(seqs["unfused FP8"]) == 22 and len(seqs["fused FP8"]) == 7
    for h in (4096, 8192):
        for m in rl.TOKENS:
            f = rl.ffn(h)
            for fam in (rl.quantize(m, h), rl.norm_quant(m, h), rl.mlp(m, h, f), rl.attention(m, h), rl.block(m, h, f)):
                assert total_bytes(fam["fused FP8"]) < total_bytes(fam["unfused FP8"])
                assert rl.seq_time_s(fam["fused FP8"], 3e-6) < rl.seq_time_s(fam["unfused FP8"], 3e-6)


def test_moe_block_launches_and_hand_computed_bytes(rl):
    h, f = 4096, 14336  # Mixtral-8x7B
    decode = rl.moe_block(1, h, f)  # 2 rows on 2 experts
    assert [len(s) for s in decode.values()] == [10, 10, 4]  # 5 launches per expert in the loops; 3 kernels + memset
    quant, memset = h * (2 + 1), h * 4
    gate_up = 2 * h + 2 * (2 * f * h) + 2 * f  # 2 gathered FP8 rows, 2 experts' [2f, h] FP8 weights, 2 FP8 rows out
    down = 2 * f + 2 * (h * f) + 2 * h * 4  # 2 FP8 rows, 2 experts' [h, f] weights, 2 fp32 atomic rows
    assert total_bytes(decode["fused FP8 grouped"]) == quant + memset + gate_up + down == 352_448_512
    # the bf16 loop reads every active expert's weights in bf16: twice the FP8 weight bytes and then some
    assert total_bytes(decode["bf16 loop"]) > 2 * (2 * (2 * f * h) + 2 * (h * f))
    prefill = rl.moe_block(4096, h, f)  # 8192 rows, 1024 per expert: every expert's weights read once
    fused = prefill["fused FP8 grouped"]
    assert sum(k.mma_flops for k in fused) == 2 * 8192 * (2 * f) * h + 2 * 8192 * h * f
    assert fused[2].bytes == 8192 * h + 8 * (2 * f * h) + 8192 * f
    for m in rl.TOKENS:
        seqs = rl.moe_block(m, h, f)
        assert rl.seq_time_s(seqs["fused FP8 grouped"], 3e-6) < rl.seq_time_s(seqs["FP8 loop"], 3e-6)
def test_block_scaled_vs_per_tensor_hand_computed(rl):
    m, n, k = 1024, 4096, 4096
    seqs = rl.block_scaled(m, n, k)
    assert list(seqs) == ["per-tensor FP8", "block FP8"] and [len(s) for s in seqs.values()] == [2, 2]
    kb = 32  # K blocks of 128
    a_scales, w_scales = m * kb * 4, 32 * kb * 4  # fp32 scale grids: 128 KiB and 4 KiB
    operands, out = m * k + n * k, m * n * 2
    assert total_bytes(seqs["per-tensor FP8"]) == m * k * 3 + operands + out
    assert total_bytes(seqs["block FP8"]) == m * k * 3 + a_scales + operands + out + a_scales + w_scales
    quant, block_gemm = seqs["block FP8"]
    assert block_gemm.mma_flops == 2 * m * n * k and block_gemm.vec_flops == 3 * m * n * kb  # per K block: ·sa ·sw +
    assert quant.vec_flops == 3 * m * k and seqs["per-tensor FP8"][0].vec_flops == m * k  # amax only for block
    # compute-bound at M=1024: 17.36 us of MMA + 6.01 us of per-block scaling on CUDA cores + 3 us launch
    assert block_gemm.time_s(3e-6) * 1e6 == pytest.approx(2 * m * n * k / 1979e12 * 1e6 + 3 * m * n * kb / 67e12 * 1e6
                                                          + 3, rel=1e-12)
    assert block_gemm.time_s(3e-6) * 1e6 == pytest.approx(26.37, abs=0.01)
    # memory-bound decode: the scale grids add < 0.1% to the bytes, so the estimate is the same
    one = rl.block_scaled(1, n, k)
    assert rl.seq_time_s(one["block FP8"], 3e-6) == pytest.approx(rl.seq_time_s(one["per-tensor FP8"], 3e-6), rel=1e-3)


def test_mxfp8_on_b200_hand_computed(rl):
    m, n, k = 1024, 4096, 4096
    seqs = rl.mx_linear(m, n, k)
    assert list(seqs) == ["bf16", "FP8 per-tensor", "MXFP8 (dot_scaled)"]
    quant, gemm = seqs["MXFP8 (dot_scaled)"]
    a_scales, w_scales = m * k // 32, n * k // 32  # uint8 E8M0 codes
    assert quant.bytes == m * k * 3 + a_scales and quant.vec_flops == 3 * m * k
    assert gemm.bytes == m * k + n * k + 2 * m * n + a_scales + w_scales and gemm.vec_flops == 0  # scales in the MMA
    # compute-bound: 2·m·n·k at B200's 4.5 PFLOP/s dense FP8 = 7.64 us, + 3 us launch
    assert gemm.time_s(3e-6) * 1e6 == pytest.approx(2 * m * n * k / 4.5e15 * 1e6 + 3, rel=1e-12)
    bf16 = seqs["bf16"][0]
    assert bf16.mma_peak == 2.25e15 and bf16.bytes == (m * k + n * k) * 2 + m * n * 2
    # decode on B200: HBM bound at 8 TB/s: (k + n·k + n/32·k + ...) bytes
    one = rl.mx_linear(1, n, k)["MXFP8 (dot_scaled)"][1]
    assert one.memory_s() == pytest.approx((k + n * k + 2 * n + k // 32 + n * k // 32) / 8e12, rel=1e-12)


def test_mxfp8_on_hopper_scales_every_32_wide_step_on_cuda_cores(rl):
    m, n, k = 4096, 4096, 4096
    quant, gemm = rl.mx_on_hopper(m, n, k)["MXFP8 (block path)"]
    assert gemm.vec_flops == 3 * m * n * (k // 32)  # partial · sa · sw + acc per K block of 32
    assert gemm.compute_s() == pytest.approx(2 * m * n * k / 1979e12 + 3 * m * n * k / 32 / 67e12, rel=1e-12)


def test_weight_only_on_a100_hand_computed(rl):
    n, k = 4096, 4096
    for m, block_m in ((1, 16), (16, 16), (100, 64), (4096, 128)):
        (kernel,) = rl.weight_only(m, n, k)["W8A16 fused"]
        assert kernel.bytes == m * k * 2 + n * k + m * n * 2  # W one byte per element, read once
        assert kernel.vec_flops == 6 * n * k * -(-m // block_m) + 2 * m * n  # decode per row tile + scale
        assert kernel.mma_peak == 312e12 and kernel.hbm_bytes_per_s == 2.039e12 and kernel.vector_peak == 19.5e12
    upcast, gemm = rl.weight_only(1, n, k)["upcast + bf16"]
    assert upcast.bytes == n * k * 3 and gemm.bytes == (k + n * k) * 2 + n * 2
    # decode (M = 1) is HBM bound: the W8A16 kernel moves half of bf16's weight bytes
    t = {name: rl.seq_time_s(ks, 3e-6) for name, ks in rl.weight_only(1, n, k).items()}
    assert t["W8A16 fused"] == pytest.approx((2 * k + n * k + 2 * n) / 2.039e12 + 3e-6, rel=1e-12)
    assert t["W8A16 fused"] < t["bf16"] < t["upcast + bf16"]
    with pytest.raises(ValueError, match="no FP8 tensor cores"):
        rl.A100.on(rl.gemm("fp8 gemm", 1, n, k))


def test_weight_only_dispatch_hand_computed_and_its_threshold_is_the_crossover(rl):
    """Above DECODE_ONCE_ABOVE_M the dispatched sequence is the decode-once pass (1 byte in, 2 out and the fp32
    scales, 7 ops per weight element) + the bf16 GEMM; the threshold is the model's crossover, which is where
    ⌈M/128⌉·6/19.5e12 = 3/2.039e12 puts it (⌈M/128⌉ = 5) plus the launch overhead's shift for 4096x4096."""
    n, k = 4096, 4096
    assert rl.weight_only(640, n, k)["W8A16 dispatched"] == rl.weight_only(640, n, k)["W8A16 fused"]
    decode, gemm = rl.weight_only(641, n, k)["W8A16 dispatched"]
    assert decode.bytes == n * k * 3 + 4 * n and decode.vec_flops == 7 * n * k and decode.vector_peak == 19.5e12
    assert gemm.bytes == (641 * k + n * k) * 2 + 641 * n * 2 and gemm.mma_peak == 312e12
    crossover = rl.weight_only_crossover_m()
    assert crossover == rl.triton_weight_only.DECODE_ONCE_ABOVE_M + 1
    assert 4 * 128 < crossover <= 6 * 128
    once = lambda m: rl.seq_time_s(rl.weight_only_decode_once(m, n, k), 3e-6)  # noqa: E731
    fused = lambda m: rl.weight_only_fused(m, n, k).time_s(3e-6)  # noqa: E731
    assert fused(crossover - 1) <= once(crossover - 1) and once(crossover) < fused(crossover)  # 4096x4096 is last
    assert once(4096) < fused(4096) and fused(128) < once(128)


def test_ffn_matches_llama3(rl):
    assert rl.ffn(4096) == 14336 and rl.ffn(8192) == 28672


def test_main_prints_labelled_tables(rl, capsys):
    rl.main(["--hidden", "4096", "--launch-overhead-us", "0"])
    out = capsys.readouterr().out
    # header + 1a, 1b, 1c x2, 1d, 1e, 1f, 2, 3 (MoE), 4 (B200 MXFP8), 4b (H100 MXFP8 block path), 5 (A100 W8A16),
    # 6 (H100 sm_90 GEMM kernels)
    assert out.count("estimated from a roofline model, not measured") == 14
    assert "4. B200" in out and "4b. H100" in out and "5. A100" in out and "6. H100 sm_90 FP8 linear" in out
    assert "3. Mixtral-8x7B MoE experts after routing" in out
    assert "block speedup vs" in out
    assert "0 us/launch" in out
    assert "MLP   unfused FP8  8:" in out and "MLP   fused FP8    3:" in out
    assert "block unfused FP8 22:" in out and "block fused FP8    7:" in out


def test_sm90_gemm_model_waves_padding_and_promotion(rl):
    """Table 6 by hand: 8192x8192x4096 on the TMA tile (128x64x128): 64 x 128 = 8192 tiles in ceil(8192/132) = 63
    waves (98.5% of 63 x 132 slots busy) at 1347 TFLOP/s sustained; 2 scale + 32 promotion FLOPs per output."""
    cfg = rl.tma_gemm.TMA_CONFIGS["tma"]
    assert (cfg.BLOCK_M, cfg.BLOCK_N, cfg.BLOCK_K) == (128, 64, 128)
    k = rl.gemm_kernel_model(cfg, 1347 / 1979, 8192, 8192, 4096)
    mma_s = 2 * 8192 * 8192 * 4096 / (1347e12 * 8192 / (63 * 132))
    vec_s = (2 + 32) * 8192 * 8192 / 67e12
    assert k.time_s(0.0) == pytest.approx(mma_s + vec_s, rel=1e-12)
    assert 2 * 8192 * 8192 * 4096 / k.time_s(0.0) / 1e12 == pytest.approx(1226, abs=1)
    # M = 16 on the same tile: one 128-row tile per 64 columns, 64 of 132 SMs busy, 1/8 of each tile useful
    small = rl.gemm_kernel_model(cfg, 1.0, 16, 4096, 4096)
    assert small.mma_peak == pytest.approx(1979e12 * (16 / 128) * (64 / 132))
    # block scaling: 3 FLOPs per output per K block instead of 1 promotion
    block = rl.gemm_kernel_model(cfg, 1.0, 256, 256, 256, block_scaled=True)
    assert block.vec_flops == (2 + 3 * 2) * 256 * 256


def test_sm90_table_picks_tma_above_the_dispatch_threshold(rl, capsys):
    rl.print_sm90_gemm_table([4096], 3e-6)
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if " qkv " in line]
    assert [(int(r[0].split()[2]), r[2].strip()) for r in rows] == [
        (1, "pointer"), (16, "pointer"), (512, "TMA"), (2048, "TMA"), (8192, "TMA")]
