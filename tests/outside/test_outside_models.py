"""Outside-style models through prepare → calibrate → convert (→ rewrite → compile), each compared with fp32."""

import pytest
import torch
from outside_models import CASES, Case
from outside_pipeline import (
    Snapshot,
    assert_close_to_fp32,
    assert_fp8_weights,
    call,
    converted_case,
    eval_inputs,
    fp8_gemm_launches,
    leaves,
    rel_l2,
)
from threads import one_thread

import dbr_quant as dq
from dbr_quant.fx_rewriter import rewrite

# compiled too: one of each family (reuse, in-place, functional/attention, containers + dict output, kwargs)
COMPILED = ("consumed_twice", "inplace_relu", "where_maskfill_einsum", "nested_containers", "python_flag_kwargs",
            "gated_mlp")


@pytest.fixture(autouse=True)
def _one_thread():
    """Small models on 2 shared cores: one intra-op thread avoids OpenMP contention."""
    with one_thread():
        yield


def _fp8_nodes(gm: torch.fx.GraphModule) -> list:
    return [n for n in gm.graph.nodes if str(n.target).startswith("dbr_quant.fp8_")]


@pytest.mark.parametrize("case", [c.param() for c in CASES])
def test_converted_close_to_fp32(case: Case):
    torch.manual_seed(0)
    before = Snapshot.of(case.build().eval())  # seeded: the same weights converted_case builds
    model, converted = converted_case(case)
    before.assert_same(model)  # prepare and convert work on copies
    assert_fp8_weights(converted, case.fp8)
    inputs = eval_inputs(case)
    with torch.no_grad():
        want = call(model, inputs)
    got = call(converted, inputs)  # grad mode on, as a user calls it
    assert_close_to_fp32(got, want, f"{case.name} converted")
    assert fp8_gemm_launches(converted, inputs) >= 1
    with torch.inference_mode():
        assert_close_to_fp32(call(converted, inputs), want, f"{case.name} converted, inference_mode")
    with dq.disabled():  # the high-precision path: dequantized weights, every op as written
        assert_close_to_fp32(call(converted, inputs), want, f"{case.name} converted, dq.disabled()")
    before.assert_same(model)


@pytest.mark.slow
@pytest.mark.parametrize("case", [c.param(rewritten=True) for c in CASES])
def test_rewritten_close_to_fp32(case: Case):
    model, converted = converted_case(case)
    gm = rewrite(converted)
    assert _fp8_nodes(gm), f"{case.name}: the rewritten graph has no FP8 GEMM node\n{gm.graph}"
    inputs = eval_inputs(case)
    with torch.no_grad():
        want, got, eager = call(model, inputs), call(gm, inputs), call(converted, inputs)
    assert_close_to_fp32(got, want, f"{case.name} rewritten")
    for (path, g), (_, e) in zip(leaves(got), leaves(eager)):  # README: the graph computes what eager does
        if isinstance(e, torch.Tensor):
            assert torch.equal(g, e), f"{case.name}: rewritten {path} differs from eager converted"


@pytest.mark.slow
@pytest.mark.parametrize("case", [c.param(rewritten=True) for c in CASES if c.name in COMPILED])
def test_compiled_close_to_fp32(case: Case):
    model, converted = converted_case(case)
    gm = rewrite(converted)
    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(force_disable_caches=True), torch.no_grad():
            compiled = torch.compile(gm, fullgraph=True)
            for seed in (2, 3):
                inputs = eval_inputs(case, seed)
                want, got, eager = call(model, inputs), call(compiled, inputs), call(converted, inputs)
                assert_close_to_fp32(got, want, f"{case.name} compiled")
                for (path, g), (_, e) in zip(leaves(got), leaves(eager)):  # FP8 flips only, not a wrong scale
                    if isinstance(e, torch.Tensor) and e.is_floating_point():
                        assert rel_l2(g, e) < 0.02, f"{case.name}: compiled {path} far from eager converted"
    finally:
        torch._dynamo.reset()
