"""Gate and up FP8 weights of a fused gated MLP stored as one [gate; up] buffer (``convert``, ``load_pretrained``).

The fused GEMM of the ``gated_mlp`` / ``norm_gated_mlp`` subgraphs (``fusions.py``) computes both halves in one
launch and applies activation·up in its epilogue; with the two weights adjacent in memory it reads them
without a per-call copy (``basic.py`` checks adjacency with ``adjacent_rows``).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dbr_quant.ops.mappings import LINEAR
from dbr_quant.ops.state import AutoQuantizationState, SeenOp
from dbr_quant.ops.tags import TAG
from dbr_quant.quantize.weights import attach_fp8_weight, fp8_weight_of

GATED_FUSIONS = ("gated_mlp", "norm_gated_mlp")


def _same_input_quantization(owner: dict[int, AutoQuantizationState], a: SeenOp, b: SeenOp) -> bool:
    """Both ops quantize their (shared) input identically: same config, and equal frozen scales."""
    if a.qconfig.activation != b.qconfig.activation or a.qconfig.dynamic != b.qconfig.dynamic:
        return False
    if a.qconfig.dynamic:
        return True
    return bool(torch.equal(owner[id(a)].scale(a, "input"), owner[id(b)].scale(b, "input")))


def stack_gate_up_weights(m: nn.Module, states: Sequence[AutoQuantizationState]) -> None:
    """Store each gated MLP's gate and up FP8 weights as adjacent rows of one [gate; up] buffer (each
    module's ``weight`` is a view of its rows), so the fused GEMM (both halves, activation·up in the
    epilogue) reads them without a per-call copy. ``states``: the model's, scales frozen."""
    groups: dict[int, list[SeenOp]] = {}
    owner: dict[int, AutoQuantizationState] = {}
    for st in states:
        for op in st.seen_ops:
            owner[id(op)] = st
            if op.group is not None and op.kind == LINEAR and op.fusion in GATED_FUSIONS:
                groups.setdefault(op.group[0], []).append(op)
    owners = [op.weight_owner for ops in groups.values() for op in ops]
    for ops in groups.values():
        gate_op, up_op = sorted(ops, key=lambda op: op.group[1] if op.group else 0)[:2]
        if gate_op.weight_owner is None or up_op.weight_owner is None or any(
                owners.count(o) > 1 for o in (gate_op.weight_owner, up_op.weight_owner)):
            continue  # a projection used elsewhere too keeps its own buffer
        if not _same_input_quantization(owner, gate_op, up_op):
            continue  # the fused GEMM quantizes x once: both projections must use the same scale
        gate, up = m.get_submodule(gate_op.weight_owner), m.get_submodule(up_op.weight_owner)
        gw, uw = fp8_weight_of(gate), fp8_weight_of(up)
        if gw is None or uw is None or gw.transposed or uw.transposed or gw.qdata.dtype != uw.qdata.dtype \
                or gw.qdata.shape[1] != uw.qdata.shape[1] or gw.block != uw.block:
            continue
        if gw.qdata.is_meta or uw.qdata.is_meta:  # offloaded (integrations/accelerate.py): accelerate loads each
            if gw.scale.dim() == uw.scale.dim() == 1:  # separately, the fused GEMM concatenates the pair per call
                up.__dict__[TAG].stacked_after = gate
            continue
        n_gate, n_up = gw.qdata.shape[0], uw.qdata.shape[0]
        if gw.block is not None and n_gate != n_up:
            continue  # the block GEMM splits [gate; up] into equal halves, each blocked on its own
        q = torch.cat([gw.qdata, uw.qdata])
        if gw.block is None:
            s = torch.cat([sc.expand(n) if sc.dim() == 0 else sc for sc, n in ((gw.scale, n_gate), (uw.scale, n_up))])
            s_gate = n_gate
        else:  # [gate blocks; up blocks]: each half keeps its own block rows (a ragged last one included)
            s, s_gate = torch.cat([gw.scale, uw.scale]), gw.scale.shape[0]
        attach_fp8_weight(gate, q[:n_gate], s[:s_gate], gw.dtype, block=gw.block, qconfig=gw.qconfig)
        attach_fp8_weight(up, q[n_gate:], s[s_gate:], uw.dtype, block=uw.block, qconfig=uw.qconfig)
        up.__dict__[TAG].stacked_after = gate
