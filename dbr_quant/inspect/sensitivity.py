"""Per-layer sensitivity: the model output's SQNR and cosine vs fp32 when only one layer runs in FP8.

Best on a prepared + calibrated model: its high-precision weights are intact, so the reference
(``dbr_quant.disabled()``) is the exact fp32 model and "every other layer in high precision" is exact.
On a converted model pass ``reference=`` (the original model): the reference is then real fp32, and
layers run in high precision take their weights from it (without it, both use the dequantized FP8 weights).
A prepared model with ``weight_rounding="gptq"`` is measured with the GPTQ weights convert will store.

Error per FLOP: :func:`layer_error` is the output error a layer causes alone in FP8 (1 − cosine, or the
noise-to-signal power ratio 10^(−SQNR/10)); ``rank_layers(..., by="error_per_flop")`` divides it by the
FLOPs the layer would keep in high precision, the order ``auto_fallback(rank="error_per_flop")`` spends a
FLOP budget in.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dbr_quant.inspect.experts import experts_flops, sibling_expert_flops
from dbr_quant.inspect.features import DisableFP8, Feature
from dbr_quant.inspect.inspector import Inspector
from dbr_quant.inspect.layers import attached, named_ops, recorded_layers
from dbr_quant.inspect.stats import sqnr_db
from dbr_quant.moe.experts import EXPERTS
from dbr_quant.ops.mappings import LINEAR, MATMUL, SDPA, is_transposed_linear
from dbr_quant.ops.state import SeenOp
from dbr_quant.quantize.weights import FP8Weight, fp8_weight_of
from dbr_quant.runtime.interception import disabled

OutputFn = Callable[[nn.Module, Any], torch.Tensor]
METRICS = ("cosine", "sqnr_db")


@dataclass(frozen=True)
class Metrics:
    cosine: float  # mean cosine similarity of output rows (vectors along the last dimension)
    sqnr_db: float

    def get(self, metric: str) -> float:
        if metric not in METRICS:
            raise ValueError(f"metric must be one of {METRICS}, not {metric!r}")
        return getattr(self, metric)


@dataclass(frozen=True)
class LayerSensitivity:
    layer: str
    kind: str
    cosine: float
    sqnr_db: float
    flops: int  # of the op at the shapes recorded by prepare()


def run_batch(model: nn.Module, batch: Any) -> Any:
    """Call the model like ``dbr_quant.calibrate`` does: tensor, tuple (positional) or mapping (keywords)."""
    if isinstance(batch, Mapping):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch)
    return model(batch)


def first_tensor(model: nn.Module, batch: Any) -> torch.Tensor:
    """Default output_fn: the first tensor of the model's output (e.g. ``last_hidden_state``)."""
    out = run_batch(model, batch)
    leaves = [x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    if not leaves:
        raise TypeError("the model returned no tensor; pass output_fn=")
    return leaves[0]


def outputs(model: nn.Module, batches: Sequence[Any], output_fn: OutputFn | None = None) -> list[torch.Tensor]:
    fn = output_fn or first_tensor
    with torch.no_grad():
        return [fn(model, b).detach().float() for b in batches]


def reference_outputs(model: nn.Module, batches: Sequence[Any], output_fn: OutputFn | None = None,
                      reference: nn.Module | None = None) -> list[torch.Tensor]:
    if reference is not None:
        return outputs(reference, batches, output_fn)
    with disabled():
        return outputs(model, batches, output_fn)


def compare(ref: Sequence[torch.Tensor], out: Sequence[torch.Tensor]) -> Metrics:
    """Mean row cosine and SQNR (dB) of ``out`` against ``ref`` over all batches."""
    rows_r = torch.cat([_rows(t) for t in ref]).double()
    rows_o = torch.cat([_rows(t) for t in out]).double()
    cos = torch.nn.functional.cosine_similarity(rows_o, rows_r, dim=-1, eps=1e-30).mean().item()
    return Metrics(cos, sqnr_db(rows_r, rows_o))


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]) if t.dim() >= 2 else t.reshape(1, -1)


def op_flops(op: SeenOp) -> int:
    """Multiply-adds × 2 of a recorded GEMM at its traced shapes (0 for other kinds); an MoE expert tensor
    counts its routed rows, top_k per token (``experts.experts_flops``)."""
    if op.kind == EXPERTS:
        return experts_flops(op)

    def shape(i: int) -> tuple[int, ...]:
        info = op.inputs[i] if len(op.inputs) > i else None
        if info is None:
            raise ValueError(f"dbr_quant.inspect: the trace recorded no input {i} of {op.kind} op {op.fqn!r}, so "
                             "its FLOPs are unknown; prepare the model again with inputs that reach it")
        return tuple(info.shape)

    if op.kind == LINEAR:  # x (…, K) → y (…, N): 2·numel(x)·N
        return 2 * math.prod(shape(0)) * op.outputs[0].shape[-1]
    if op.kind == MATMUL:  # a (…, m, k) @ b → out (…, m, n): 2·numel(out)·k
        return 2 * math.prod(op.outputs[0].shape) * shape(0)[-1]
    if op.kind == SDPA:  # q (…, L, D), k (…, S, D), v (…, S, Dv): q·kᵀ and p·v
        q, k, v = shape(0), shape(1), shape(2)
        return 2 * math.prod(q[:-1]) * k[-2] * (q[-1] + v[-1])
    return 0


def layer_flops(model: nn.Module) -> dict[str, int]:
    """``op_flops`` of every recorded GEMM by layer name; ModuleList experts share their group's traced FLOPs
    evenly (``experts.sibling_expert_flops``)."""
    return sibling_expert_flops(model, {n: op_flops(op) for n, op in named_ops(model)})


def fp8_flop_fraction(model: nn.Module, high_precision: Iterable[str] = (), kinds: tuple[str, ...] = (LINEAR,)
                      ) -> float:
    """FLOPs of recorded ``kinds`` ops that run in FP8 (quantized and not in ``high_precision``, layer names)
    over the FLOPs of all recorded ops of those kinds (including ones prepare() already left in high precision).
    MoE expert tensors are linears (one per expert): with ``LINEAR`` in ``kinds`` they count too."""
    hp = set(high_precision)
    kinds = (*kinds, EXPERTS) if LINEAR in kinds and EXPERTS not in kinds else kinds
    flops = layer_flops(model)
    ops = [(n, op) for n, op in named_ops(model) if op.kind in kinds]
    total = sum(flops[n] for n, _ in ops)
    fp8 = sum(flops[n] for n, op in ops if op.quantize and n not in hp)
    return fp8 / total if total else 0.0


RANKINGS = ("error", "error_per_flop")


def layer_error(s: LayerSensitivity, metric: str = "cosine") -> float:
    """Output error the layer causes alone in FP8: 1 − cosine, or 10^(−SQNR/10) for "sqnr_db"."""
    value = Metrics(s.cosine, s.sqnr_db).get(metric)
    return 1.0 - value if metric == "cosine" else 10.0 ** (-value / 10.0)  # 10^(-inf) = 0: no error


def rank_layers(sens: Iterable[LayerSensitivity], metric: str = "cosine", by: str = "error"
                ) -> list[LayerSensitivity]:
    """Most harmful first: by the error a layer causes (``"error"``) or by that error per FLOP it would keep
    in high precision (``"error_per_flop"``; a layer of 0 FLOPs is free to keep and comes first)."""
    if by not in RANKINGS:
        raise ValueError(f"rank must be one of {RANKINGS}, not {by!r}")
    Metrics(0.0, 0.0).get(metric)

    def key(s: LayerSensitivity) -> float:
        err = layer_error(s, metric)
        if by == "error":
            return err
        return err / s.flops if s.flops > 0 else math.inf
    return sorted(sens, key=key, reverse=True)  # stable: ties keep the sensitivity order


def linear_flops(model: nn.Module) -> int:
    """FLOPs of every recorded linear op and MoE expert tensor (quantized or not) at the traced shapes
    (``layer_flops``): the budget's denominator, the same as ``fp8_flop_fraction``'s."""
    flops = layer_flops(model)
    return sum(flops[n] for n, op in named_ops(model) if op.kind in (LINEAR, EXPERTS))


class _Evaluator:
    """Runs the model with a chosen set of layers in high precision (shares one weight cache)."""

    def __init__(self, model: nn.Module, batches: Sequence[Any], output_fn: OutputFn | None,
                 reference: nn.Module | None) -> None:
        self.model, self.batches, self.output_fn = model, list(batches), output_fn
        if not self.batches:
            raise ValueError("need at least one batch")
        layers = recorded_layers(model)
        self.layers = list(layers)
        self.kinds = {n: r.info.kind for n, r in layers.items()}
        self.ref = reference_outputs(model, self.batches, output_fn, reference)
        self.inspector = Inspector({}, layers)
        if reference is not None:
            self.inspector.hp_weights = _original_weights(model, reference)
        self.evaluations = 0

    def metrics(self, high_precision: Iterable[str]) -> Metrics:
        # FP8 layers take the generic path too (a no-op feature), so their FP8 weights are cached
        off: tuple[Feature, ...] = (DisableFP8(),)
        hp, on = set(high_precision), (Feature(),)
        self.inspector.plan = {n: off if n in hp else on for n in self.layers}
        self.evaluations += 1
        with attached(self.model, self.inspector):
            return compare(self.ref, outputs(self.model, self.batches, self.output_fn))


def _original_weights(model: nn.Module, reference: nn.Module) -> dict[int, torch.Tensor]:
    """id(linear module with an FP8 weight) → the weight of the same-named module of ``reference``, [N, K]."""
    ref = dict(reference.named_modules())
    out = {}
    for name, mod in model.named_modules():
        src = ref.get(name)
        if src is None or fp8_weight_of(mod) is None:
            continue
        w = getattr(src, "weight", None)
        if isinstance(w, torch.Tensor) and not w.is_meta and type(w) is not FP8Weight:
            w = w.detach()
            out[id(mod)] = w.t() if is_transposed_linear(src) else w
    return out


def sensitivity(model: nn.Module, batches: Sequence[Any], *, output_fn: OutputFn | None = None,
                reference: nn.Module | None = None, layers: Iterable[str] | None = None,
                by: str = "sqnr_db") -> list[LayerSensitivity]:
    """For each recorded quantized layer (or ``layers``): the output's cosine / SQNR vs the reference with
    only that layer in FP8. Sorted worst first by ``by`` ("sqnr_db" or "cosine")."""
    ev = _Evaluator(model, batches, output_fn, reference)
    return _sensitivity(ev, layers, by)


def _sensitivity(ev: _Evaluator, layers: Iterable[str] | None, by: str) -> list[LayerSensitivity]:
    Metrics(0.0, 0.0).get(by)  # validate
    flops = layer_flops(ev.model)
    names = list(layers) if layers is not None else ev.layers
    unknown = [n for n in names if n not in ev.kinds]
    if unknown:
        raise ValueError(f"not recorded quantized layers: {unknown}")
    out = []
    for name in names:
        m = ev.metrics([n for n in ev.layers if n != name])
        out.append(LayerSensitivity(name, ev.kinds[name], m.cosine, m.sqnr_db, flops.get(name, 0)))
    return sorted(out, key=lambda s: getattr(s, by))


def plot_sensitivity(sens: Sequence[LayerSensitivity], metric: str = "sqnr_db", top: int | None = None, ax=None):
    """Horizontal bar chart, worst layer on top. Returns the matplotlib Axes."""
    import matplotlib.pyplot as plt

    rows = list(sens)[:top] if top else list(sens)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.22 * len(rows) + 1.2))
    values = [Metrics(s.cosine, s.sqnr_db).get(metric) for s in rows]
    ax.barh(range(len(rows)), values, color="tab:red")
    ax.set_yticks(range(len(rows)), [s.layer for s in rows], fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel({"sqnr_db": "output SQNR (dB), only this layer in FP8", "cosine": "output cosine vs fp32"}[metric])
    if metric == "sqnr_db":
        finite = [v for v in values if math.isfinite(v)]
        if finite:
            ax.set_xlim(min(finite) - 3, max(finite) + 3)
    else:
        ax.set_xlim(min(values) - (1 - min(values)) * 0.1, 1.0)
    ax.set_title("Per-layer FP8 sensitivity (worst first)")
    return ax
