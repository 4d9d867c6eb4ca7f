"""Which weights stay high precision, and why: the one place that ``report()``, prepare()'s and convert()'s
"stay high precision" warnings and the tied-weight rule take their reasons from.

A *weight* is a parameter with two or more dimensions (1-D ones — biases, norm scales — stay high precision in
every FP8 scheme and are not listed). Each weight is FP8 (after convert: stored as an ``FP8Weight``; before: what
convert will store) or stays high precision for one reason:

* a linear module's weight: the reason of its op that runs in high precision (skipped by an Override, a router,
  tied to another parameter, …), or why no op ran it (never called during prepare's trace);
* a convolution's: no FP8 convolution kernel; an embedding's: a lookup table (as serving engines keep it);
* any other parameter (``nn.MultiheadAttention.in_proj_weight``, a LoRA factor used as ``x @ A.t()``, a position
  table): the ops that read it during the trace (followed through views and casts), or that none did.

Lookup tables and tied weights stay high precision by design: they get report rows and count in the warning's
totals, but alone they do not make prepare/convert warn.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dbr_quant.moe.experts import EXPERTS
from dbr_quant.moe.trace import ROUTER_REASON
from dbr_quant.ops.mappings import LINEAR, MATMUL, SDPA, is_linear_module, is_transposed_linear
from dbr_quant.quantize.weights import FP8Weight, fp8_weight_of

# calls that hand a parameter on unchanged in value (the op reading their output is the one that uses it)
_VIEWS = frozenset({"t", "T", "mT", "transpose", "permute", "view", "reshape", "contiguous", "to", "__get__",
                    "expand", "unsqueeze", "squeeze", "float", "half", "bfloat16", "type_as", "detach", "chunk",
                    "split", "unbind", "__getitem__", "narrow"})
WEIGHT = "weight"  # the kind of a report row for a weight that no recorded quantizeable op reads
# a call reading a parameter: (function, the recorded op's fqn or None); the op's verdict is read at report time
# (prepare revises some after the trace: a MoE router's linear)
Use = tuple[str, str | None]


def _by_design(reason: str) -> bool:
    """High precision on purpose, as serving engines keep it: listed, but no warning on its own."""
    return reason.startswith("tied to ") or reason == ROUTER_REASON or ": a lookup table" in reason


def tie_reason(others: list[str]) -> str:
    return (f"tied to {', '.join(others)}: stays high precision so the tie holds (as vLLM and llm-compressor keep "
            "it); Override(pattern=..., untie=True) quantizes it anyway, as an FP8 copy beside the original")


def skip_reason(override: Any) -> str:
    return f"skipped by {override}" if override is not None else "skipped by a QConfig override"


def unreached_linear_reason(module: nn.Module, uses: list[Use], ops: dict[str, Any]) -> str:
    """Why a linear module that no recorded op ran as a module stays high precision."""
    if uses:  # e.g. nn.MultiheadAttention's fused path passes out_proj.weight to a function
        return f"not called as a module: its weight is {_uses_reason(uses, ops)}"
    if not is_linear_module(module):
        how = "overrides nn.Linear.forward" if "weight" in module._parameters else \
            "computes its weight per call (a parametrization)"
        return (f"{type(module).__name__} {how}: its torch ops run as written (an F.linear "
                "inside is recorded as a functional linear with a weight quantized per call)")
    return ("never called during prepare()'s trace (a branch not taken, an expert not routed to, an unused head); "
            "prepare with example inputs that reach it to quantize it")


def _module_reason(module: nn.Module) -> str | None:
    """Why a weight of a module type with no FP8 path stays high precision; None for other modules."""
    name = type(module).__name__
    if isinstance(module, nn.modules.conv._ConvNd):
        return f"{name}: no FP8 convolution kernel in this release"
    if isinstance(module, (nn.Embedding, nn.EmbeddingBag)):
        return f"{name}: a lookup table, stays high precision (as serving engines keep it)"
    return None


def _uses_reason(uses: list[Use], ops: dict[str, Any]) -> str:
    """Why a parameter read by these trace calls (``ops``: the record's ops by fqn) is stored in high precision."""
    if not uses:
        return "never used during prepare()'s trace (prepare with example inputs that reach it)"
    read = [(func, ops[fqn]) for func, fqn in uses if fqn in ops]
    fp8 = [op.fqn for _, op in read if op.quantize]
    if fp8:
        return (f"read by {', '.join(fp8)}, which runs in FP8 quantizing this weight on every call; it is stored in "
                "high precision (a parameter is stored in FP8 when linears are its only readers)")
    matmuls = [op.fqn for _, op in read if op.kind in (MATMUL, SDPA)]
    if matmuls:  # whatever the op's own reason says, an operand that is a parameter keeps it high precision
        return (f"read by {', '.join(matmuls)} as an operand: a matmul with a parameter operand (a linear written "
                "as x @ W.t()) runs in high precision; only linears and activation × activation matmuls run in FP8")
    high = dict.fromkeys(op.reason for _, op in read)
    if len(high) == 1 and _by_design(next(iter(high))):
        return next(iter(high))  # e.g. a router written as F.linear(x, self.weight)
    if high:
        return f"read by {'; '.join(f'{op.fqn} ({op.reason})' for _, op in read)}"
    funcs = ", ".join(dict.fromkeys(func for func, *_ in uses))
    return f"read by {funcs}: no FP8 kernel for it (only linear, matmul and attention run in FP8)"


# ----------------------------------------------------------------------------------------------- trace
def tied_names(root: nn.Module) -> dict[str, list[str]]:
    """Parameter fqn → the other fqns of the same Parameter object, for parameters held by two or more module
    objects (an embedding tied to ``lm_head``). One module reached under two names (a shared child, the same
    block used twice) is no tie: its weight has one user, quantized once."""
    names: dict[int, list[str]] = {}
    holders: dict[int, set[int]] = {}
    for mfqn, mod in root.named_modules(remove_duplicate=False):
        for pname, p in mod._parameters.items():
            if p is not None:
                names.setdefault(id(p), []).append(f"{mfqn}.{pname}" if mfqn else pname)
                holders.setdefault(id(p), set()).add(id(mod))
    return {fqn: [o for o in group if o != fqn] for key, group in names.items() if len(holders[key]) > 1
            for fqn in group}


class ParamReads:
    """During prepare's trace: which calls read each parameter (through views of it and tensors computed from
    parameters only)."""

    def __init__(self, root: nn.Module) -> None:
        self.names = {id(p): fqn for fqn, p in root.named_parameters()}
        self.derived: dict[int, str] = {}  # trace id → fqn of the parameter it views
        self.by_param: dict[str, list[Use]] = {}

    def see(self, func: Any, tensors: list[torch.Tensor], tids: list[int], out_tids: list[int], op: Any) -> None:
        for t, i in zip(tensors, tids):
            if id(t) in self.names:
                self.derived[i] = self.names[id(t)]
        read = dict.fromkeys(self.derived[i] for i in tids if i in self.derived)
        if not read:
            return
        name = getattr(func, "__name__", str(func))
        if op is None and (name in _VIEWS or all(i in self.derived for i in tids)):
            # a view, or a tensor computed from parameters only (``self.base * 2 + 1``): the op that reads it
            # (with activations) is the one that uses these parameters
            self.derived.update((o, p) for o in out_tids for p in read)
            return
        use = (name, op.fqn if op is not None else None)
        for p in read:
            if use not in self.by_param.setdefault(p, []):
                self.by_param[p].append(use)


# ----------------------------------------------------------------------------------------------- weights
@dataclass(frozen=True)
class Weight:
    fqn: str  # the parameter's (first) fqn
    module: str
    nbytes: int  # as stored now (FP8 data and scales once converted)
    numel: int
    fp8: bool
    reason: str
    by_design: bool  # a lookup table or a tied weight: listed, but no warning on its own


def _linear_ops(record: Any) -> dict[str, list]:
    ops: dict[str, list] = {}
    for st in record.states:
        for op in st.seen_ops:
            if op.kind == LINEAR and op.weight_owner is not None:
                ops.setdefault(op.weight_owner, []).append(op)
    return ops


def _param_linear_ops(record: Any) -> dict[str, list]:
    """Parameter fqn → the functional linears that read it as their weight (in_proj_weight, out_proj.weight
    read by F.multi_head_attention_forward, x @ A.t()): convert stores it in FP8 when all of them run in FP8."""
    ops: dict[str, list] = {}
    for st in record.states:
        for op in st.seen_ops:
            if op.kind == LINEAR and op.weight_param is not None:
                ops.setdefault(op.weight_param.name, []).append(op)
    return ops


def _expert_ops(record: Any) -> dict[str, Any]:
    return {op.fqn: op for st in record.states for op in st.seen_ops if op.kind == EXPERTS}


def _nbytes(p: torch.Tensor) -> int:
    return p.stored_bytes() if type(p) is FP8Weight else p.numel() * p.element_size()


def weights(model: nn.Module, record: Any) -> list[Weight]:
    """Every weight of the model (each Parameter once), FP8 or not and why not."""
    linear_ops, expert_ops, param_ops = _linear_ops(record), _expert_ops(record), _param_linear_ops(record)
    all_ops = {op.fqn: op for st in record.states for op in st.seen_ops}
    converted = record.phase == "converted"
    ties = tied_names(model)
    out = []
    for fqn, p in model.named_parameters():
        if p.dim() < 2 or fqn.endswith("_bias") and fqn.removesuffix("_bias") in expert_ops:
            continue  # a bias, also an experts module's [E, N] one (GPT-OSS's gate_up_proj_bias)
        mfqn, _, pname = fqn.rpartition(".")
        module = model.get_submodule(mfqn)
        ops = (linear_ops.get(mfqn, []) if pname == "weight" else []) or param_ops.get(fqn, [])
        expert = expert_ops.get(fqn)
        if converted:
            fp8 = type(p) is FP8Weight
        else:  # what convert stores: a linear all of whose calls run in FP8; a quantized experts module
            fp8 = bool(ops) and all(op.quantize and not (op.weight_param and op.weight_param.per_call) for op in ops) \
                or expert is not None and expert.quantize
        reason, by_design = "", False
        if not fp8:
            hp = next((op for op in ops if not op.quantize or op.weight_param and op.weight_param.per_call), None)
            uses = record.param_uses.get(fqn, [])
            if hp is not None:
                reason = hp.reason
            elif expert is not None:
                reason = expert.reason
            elif pname == "weight" and (isinstance(module, nn.Linear) or is_transposed_linear(module)):
                reason = unreached_linear_reason(module, uses, all_ops)
            elif fqn in ties and _module_reason(module) is None:
                reason = tie_reason(ties[fqn])
            else:
                reason = _module_reason(module) or _uses_reason(uses, all_ops)
            by_design = _by_design(reason)
        out.append(Weight(fqn, mfqn, _nbytes(p), p.numel(), fp8, reason, by_design))
    return out


def report_rows(model: nn.Module, record: Any, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows for the high-precision weights that ``rows`` (one per recorded op) do not already cover."""
    covered = {r["weight"] for r in rows if r.get("weight")}
    extra = []
    for w in weights(model, record):
        if w.fp8 or w.fqn in covered:
            continue
        name = w.fqn.rpartition(".")[2]
        extra.append({"fqn": w.module if name == "weight" else w.fqn, "kind": WEIGHT, "module": w.module,
                      "fp8": False, "fusion": None, "reason": w.reason, "weight": w.fqn})
    return extra


def linear_rows(model: nn.Module, record: Any) -> list[dict[str, Any]]:
    """Linear modules that no recorded op ran as a module: they stay high precision; say why."""
    owners = {op.weight_owner for st in record.states for op in st.seen_ops if op.weight_owner is not None}
    owners |= {name.removesuffix(".weight") for name in _param_linear_ops(record)}  # out_proj read by F.linear
    ops = {op.fqn: op for st in record.states for op in st.seen_ops}
    return [{"fqn": fqn, "kind": LINEAR, "module": fqn.rpartition(".")[0], "fp8": False, "fusion": None,
             "reason": unreached_linear_reason(mod, record.param_uses.get(f"{fqn}.weight", []), ops),
             "weight": f"{fqn}.weight"}
            for fqn, mod in model.named_modules()
            if (isinstance(mod, nn.Linear) or is_transposed_linear(mod)) and fqn not in owners]


# ----------------------------------------------------------------------------------------------- warnings
def warn_high_precision(model: nn.Module, record: Any, fn: str) -> None:
    """One warning naming how many weights (and bytes) stay high precision, and why — when one of them does
    for another reason than by design (lookup tables and tied weights alone say nothing)."""
    ws = weights(model, record)
    high = [w for w in ws if not w.fp8]
    if all(w.by_design for w in high):
        return
    high.sort(key=lambda w: w.by_design)
    share = sum(w.numel for w in high) / max(1, sum(w.numel for w in ws))
    shown = "; ".join(f"{w.module if w.fqn.endswith('.weight') else w.fqn}: {w.reason}" for w in high[:5])
    more = f"; … and {len(high) - 5} more" if len(high) > 5 else ""
    warnings.warn(f"dbr_quant.{fn}(): {len(high)} weight(s) stay high precision "
                  f"({sum(w.nbytes for w in high) / 2**20:.2f} MiB, {share:.0%} of the model's weight elements): "
                  f"{shown}{more}. dbr_quant.report(model) lists every one.", stacklevel=3)


def warn_untied(model: nn.Module, ties: dict[str, list[str]]) -> None:
    """After convert: linears quantized although tied (Override(untie=True)) — the tie is broken and the FP8
    copy is memory on top of the high-precision original."""
    for fqn, others in ties.items():
        mfqn, _, pname = fqn.rpartition(".")
        w = fp8_weight_of(model.get_submodule(mfqn)) if pname == "weight" else None
        if w is None:
            continue
        kept = [o for o in others if type(model.get_parameter(o)) is not FP8Weight]
        original = sum(_nbytes(model.get_parameter(o)) for o in kept[:1])
        warnings.warn(f"dbr_quant.convert(): '{mfqn}' was tied to {', '.join(others)} and is quantized anyway "
                      f"(Override untie=True): the tie is broken, and its FP8 copy adds {_nbytes(w) / 2**20:.2f} MiB "
                      f"beside the {original / 2**20:.2f} MiB high-precision {', '.join(kept) or 'original'}",
                      stacklevel=3)
