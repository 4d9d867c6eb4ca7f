"""The ahead-of-time tool compiles the kernels for Hopper and Ada without a GPU, and fails when it should."""

import pytest

from dbr_quant.kernels import aot


@pytest.mark.slow
@pytest.mark.parametrize("arch", [90, 89])
def test_aot_tool_passes_on_the_covering_subset(arch, capsys):
    assert aot.main(["--arch", str(arch)]) == 0
    out = capsys.readouterr().out
    assert "0 failed" in out and "_fp8_linear_kernel" in out and "_attn_fwd" in out and "layer_norm_quantize" in out


@pytest.mark.slow
@pytest.mark.parametrize("arch", [90, 89])
def test_every_attention_configuration_compiles_without_spills(arch, capsys):
    assert aot.main(["--arch", str(arch), "--all", "--only", "attn"]) == 0


def test_fp8_mma_detection_and_failure_rules():
    hopper = "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {...};"
    ada = "mma.sync.aligned.m16n8k32.row.col.f32.e5m2.e5m2.f32 {...};"
    assert aot.fp8_mma_count(hopper, 90) == 1 and aot.fp8_mma_count(ada, 89) == 1
    assert aot.fp8_mma_count(hopper.replace("e4m3", "bf16"), 90) == 0
    assert aot.fp8_mma_count(ada, 90) == 0  # Hopper code must use warpgroup MMA
    ok = aot.Result("_fp8_linear_kernel", "cfg", registers=100, spill_bytes=0, shared_bytes=0, fp8_mma=2)
    assert ok.ok
    assert not aot.Result("_fp8_linear_kernel", "cfg", 100, 0, 0, fp8_mma=0).ok  # a GEMM without FP8 MMA
    assert aot.Result("quantize", "cfg", 40, 0, 0, fp8_mma=0).ok  # elementwise kernels have none to find
    assert not aot.Result("quantize", "cfg", 40, 8, 0, 0).ok  # spills fail
    assert not aot.Result("quantize", "cfg", error="CompilationError").ok


def test_covering_subset_meets_every_option_of_every_kernel():
    every = aot.all_configs()
    subset = aot.covering_subset(every)
    tokens = lambda entries: {(e[0], t) for _, e in entries for t in e[1].replace("|", " ").split()}  # noqa: E731
    assert tokens(subset) == tokens(every) and len(subset) < len(every) / 10
