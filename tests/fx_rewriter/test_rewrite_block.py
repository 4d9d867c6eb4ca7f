"""Block-scaled FP8 (``QConfig.fp8_block``) through ``torch.export`` and ``torch.compile``: the rewritten graph
of tests/test_block_granularity.py's model (norm → group-quantize → block GEMMs, ragged 48×32 blocks) exports
with its dbr_quant ops and runs equal to the converted eager model; dynamo captures it whole."""

from __future__ import annotations

import pytest
import torch
from test_block_granularity import _convert, _model, _x  # tests/ is on sys.path (conftest)

import dbr_quant as dq
from dbr_quant.fx_rewriter import rewrite


@pytest.fixture(scope="module")
def block_graph():
    c = _convert(_model(), dq.QConfig.fp8_block((48, 32)))
    return c, rewrite(c)


def _dbr_ops(gm: torch.fx.GraphModule) -> list[str]:
    return [n.target.name() for n in gm.graph.nodes
            if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)
            and n.target.namespace == "dbr_quant"]


def test_exported_block_program_equals_eager_on_another_batch_size(block_graph, tmp_path):
    c, gm = block_graph
    batch = torch.export.Dim("batch", min=1, max=64)
    ep = torch.export.export(gm, (_x(2, 5),), dynamic_shapes=({0: batch},))
    ops = _dbr_ops(ep.graph_module)
    assert ops.count("dbr_quant::fp8_block_linear") == 5 and "dbr_quant::layer_norm_group_quantize" in ops
    torch.export.save(ep, tmp_path / "block.pt2")
    loaded = torch.export.load(tmp_path / "block.pt2").module()
    with torch.no_grad():
        for x in (_x(2, 5), _x(3, 5, seed=7)):
            assert torch.equal(loaded(x), c(x))


def test_dynamo_captures_the_block_graph_whole(block_graph):
    c, gm = block_graph
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(gm)(_x(2, 5))
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(gm, fullgraph=True, backend="aot_eager")  # the ops' fake impls, no inductor codegen
    with torch.no_grad():
        x = _x(3, 5, seed=3)
        assert torch.equal(compiled(x), c(x))
