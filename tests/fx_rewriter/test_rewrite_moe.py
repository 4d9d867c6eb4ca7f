"""rewrite() on mixture-of-experts models: transformers 5 experts modules with 3-D weights become one
``dbr_quant::fp8_moe_experts`` node each (routing inside the op: no data-dependent shapes in the graph);
``ModuleList`` experts called from the model's own loop rewrite when that loop does not branch on token counts.

Models: the small Mixtral / Qwen2-MoE / ModuleList toys of tests/test_moe.py. The rewritten graph runs the
same kernels as the converted eager model, so outputs must be bit-for-bit equal (``torch.equal``).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_moe import EXPERTS_N, LAYERS, ToyMoE, batches, logits, pipeline  # tests/ is on sys.path (conftest)
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

import dbr_quant as dq
from dbr_quant.fx_rewriter import RewriteError, rewrite

REWRITE_EXAMPLE = (2, 5)  # batch 2: prepare()'s batch-1 example would fix the batch size in the graph
SHAPES = [(3, 7), (1, 4), (2, 1)]


@pytest.fixture(scope="module")
def mixtral_graph():
    """A converted Mixtral and its rewritten graph, shared by the export and compile tests."""
    _, _, converted = pipeline("mixtral", "grouped_mm")
    return converted, rewrite(converted, example_kwargs=batches(1, REWRITE_EXAMPLE, 9)[0])


def _moe_nodes(gm: torch.fx.GraphModule) -> list[torch.fx.Node]:
    return [n for n in gm.graph.nodes if n.target is torch.ops.dbr_quant.fp8_moe_experts.default]


def _unbacked(gm: torch.fx.GraphModule) -> list[str]:
    """Nodes whose value has a size only the data decides (nonzero, a loop over the experts hit, …)."""
    return [n.name for n in gm.graph.nodes if "val" in n.meta and free_unbacked_symbols(n.meta["val"])]


def _assert_equal_on_shapes(gm, converted, shapes=SHAPES, seed=5):
    for shape in shapes:
        b = batches(1, shape, seed)[0]
        with torch.no_grad():
            want, got = logits(converted(**b)), logits(gm(**b))
        assert torch.equal(want, got), f"rewritten output differs at shape {shape}"


# the experts implementations take one path (the experts call is intercepted whole); Mixtral: the export test
@pytest.mark.parametrize("name,impl,dynamic", [("qwen2_moe", "batched_mm", False), ("qwen2_moe", "eager", True)])
def test_experts_modules_are_one_graph_op_with_outputs_equal_to_eager(name, impl, dynamic):
    qc = dq.QConfig(dynamic=True, activation=dq.TensorQConfig(granularity="token")) if dynamic else None
    _, _, converted = pipeline(name, impl, qconfig=qc)
    gm = rewrite(converted, example_kwargs=batches(1, REWRITE_EXAMPLE, 9)[0])
    nodes = _moe_nodes(gm)
    assert len(nodes) == LAYERS
    for n in nodes:  # the experts' FP8 weights and scales, static scales only when calibrated
        w13_q, w2_q = n.args[3].meta["val"], n.args[5].meta["val"]
        assert w13_q.dtype == w2_q.dtype == torch.float8_e4m3fn and w13_q.shape[0] == EXPERTS_N
        assert (n.args[7] is None) == dynamic and (n.args[8] is None) == dynamic
    assert _unbacked(gm) == []
    _assert_equal_on_shapes(gm, converted)


def test_exported_and_saved_graph_equals_eager(mixtral_graph, tmp_path):
    converted, gm = mixtral_graph
    b = batches(1, (3, 6), 4)[0]
    auto = torch.export.Dim.AUTO
    ep = torch.export.export(gm, (), dict(b), dynamic_shapes={"input_ids": {0: auto, 1: auto}})
    assert len(_moe_nodes(gm)) == LAYERS and _unbacked(gm) == []
    assert [str(n.target) for n in ep.graph.nodes].count("dbr_quant.fp8_moe_experts.default") == LAYERS
    torch.export.save(ep, tmp_path / "mixtral.pt2")
    loaded = torch.export.load(tmp_path / "mixtral.pt2").module()
    _assert_equal_on_shapes(loaded, converted, shapes=[(3, 6), (2, 11)])


def test_dynamo_captures_the_graph_whole(mixtral_graph):
    """``torch.compile(fullgraph=True)`` traces the rewritten graph in one piece (fp8_moe_experts through its
    fake implementation); the aot_eager backend runs the captured graph without inductor's C++ compile."""
    converted, gm = mixtral_graph
    torch._dynamo.reset()
    with torch.no_grad():
        compiled = torch.compile(gm, fullgraph=True, backend="aot_eager")
        _assert_equal_on_shapes(compiled, converted, shapes=[(3, 7)])
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiled_fullgraph_matches_eager(mixtral_graph, close_to_reference):
    """Inductor keeps fp8_moe_experts opaque (the eager kernels inside); the rest is compiled. Measured here:
    logits bit-equal to eager (the CPU GEMM path is the same); the test allows FP8 rounding flips (cos > 0.999)."""
    converted, gm = mixtral_graph
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True), torch.no_grad():
        compiled = torch.compile(gm, fullgraph=True)
        b = batches(1, (3, 7), 5)[0]
        want, got = logits(converted(**b)), logits(compiled(**b))
    torch._dynamo.reset()
    assert torch.isfinite(got).all()
    close_to_reference(got, want, min_cos=0.999, max_rel=0.03)


def test_fp8_moe_experts_op_equals_the_eager_compute_and_has_no_gradient():
    """The op on its own (random FP8 experts, an expert that gets no token): eager's function, bit for bit;
    a backward through it is a clear error (inference only)."""
    from dbr_quant.formats import FP8Format
    from dbr_quant.moe.compute import fp8_experts_compute

    gen = torch.Generator().manual_seed(3)
    e, h, i, t = 3, 16, 8, 5
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * 4).to(torch.float8_e4m3fn)
    w2 = (torch.randn(e, h, i, generator=gen) * 4).to(torch.float8_e4m3fn)
    s13, s2 = torch.rand(e, 2 * i, generator=gen) / 50, torch.rand(e, h, generator=gen) / 50
    xs, hs = torch.tensor(0.02), torch.rand(e, generator=gen) / 20
    ids = torch.tensor([[0, 1], [1, 0], [0, 1], [1, 0], [0, 1]])  # expert 2: no token
    w = torch.rand(t, 2, generator=gen)
    x = torch.randn(t, h, generator=gen, requires_grad=True)
    for scales, per_token in (((xs, hs), False), ((None, None), True)):
        want = fp8_experts_compute(x.detach(), ids, w, w13, s13, w2, s2, *scales, None, None, activation="swiglu",
                                   fmt=FP8Format.E4M3, per_token=per_token, out_dtype=torch.float32)
        got = torch.ops.dbr_quant.fp8_moe_experts(x, ids, w, w13, s13, w2, s2, *scales, None, None, "swiglu",
                                                  FP8Format.E4M3.value, per_token, torch.float32)
        assert torch.equal(got.detach(), want) and want.abs().sum() > 0
    with pytest.raises(RuntimeError, match="fp8_moe_experts has no gradient"):
        got.sum().backward()


class BranchFreeMoE(ToyMoE):
    """The gated toy's loop without ``if tok.numel() == 0: continue``: experts run on zero rows too."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        w, sel = torch.topk(F.softmax(self.router(x), dim=-1, dtype=torch.float), self.k, dim=-1)
        w = (w / w.sum(-1, keepdim=True)).to(x.dtype)
        out = torch.zeros_like(x)
        mask = F.one_hot(sel, self.e).permute(2, 1, 0)
        for j in range(self.e):
            slot, tok = torch.where(mask[j])
            out.index_add_(0, tok, self.expert(j)(x[tok]) * w[tok, slot, None])
        return out.reshape(shape)


def test_module_list_experts_rewrite_when_the_loop_does_not_branch_on_token_counts(monkeypatch):
    monkeypatch.setattr(ToyMoE, "forward", BranchFreeMoE.forward)
    _, _, converted = pipeline("gated")
    gm = rewrite(converted, example_kwargs=batches(1, REWRITE_EXAMPLE, 9)[0])
    ops = [str(n.target) for n in gm.graph.nodes if "dbr_quant" in str(n.target)]
    assert ops.count("dbr_quant.fp8_mlp.default") == LAYERS * EXPERTS_N  # every expert, unreached ones too
    _assert_equal_on_shapes(gm, converted, shapes=[(3, 7), (1, 1)])  # 1 token: 6 of 8 experts get zero rows


def test_module_list_experts_whose_loop_branches_on_token_counts_name_the_line():
    _, _, converted = pipeline("gated")
    with pytest.raises(RewriteError, match=r"test_moe\.py:\d+ in forward.*tok\.numel\(\) == 0"):
        rewrite(converted, example_kwargs=batches(1, REWRITE_EXAMPLE, 9)[0])
