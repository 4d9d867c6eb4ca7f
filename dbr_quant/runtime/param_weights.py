"""Linears whose weight is a parameter read by a torch function rather than an ``nn.Linear`` call.

``F.linear(x, self.w)``, torch's attention (``F.multi_head_attention_forward`` reads ``in_proj_weight`` —
whole, or as row slices ``w.split([E, 2E])`` / ``w.chunk(3)`` when query and key/value differ — and
``out_proj.weight``), and an activation × parameter matmul (``x @ A.t()``, ``torch.matmul(x, self.w)``: a
linear whose weight is the parameter transposed, see ``mappings.call_kind``). The trace records which
parameter (and which of its output rows) each such linear reads as a :class:`ParamRef`; ``convert`` stores
that parameter as an ``FP8Weight`` on its module, in place of the parameter, when every use the trace saw
is as such a linear's weight. At run time the FP8 weight's views (``.t()``, row slices: ``weights._VIEWS``)
stay FP8, so the linear reads the stored bytes and scales; a per-channel row slice is exactly the
quantization of those rows. A parameter that something else reads too (an embedding lookup tied to an
output projection, arithmetic on it) stays high precision and its linears quantize it on every call.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from dbr_quant.ops.mappings import LINEAR, MATMUL_AS_LINEAR
from dbr_quant.quantize.weight_quantization import all_finite, quantize_weight
from dbr_quant.quantize.weights import FP8Weight, attach_fp8_weight

# calls that read a tensor's metadata, never its values (the trace sees ``w.shape`` as ``__get__``)
_METADATA = frozenset({"dim", "size", "stride", "__get__", "__len__", "numel", "is_floating_point", "is_contiguous",
                       "data_ptr", "element_size", "get_device", "storage_offset", "ndimension", "nelement",
                       "is_complex", "__hash__"})


@dataclass(frozen=True)
class ParamRef:
    """The parameter a functional linear reads as its weight.

    name: the parameter's fqn (``layers.0.self_attn.in_proj_weight``). transposed: the parameter is stored
    [in, out] (``torch.matmul(x, W)``): the FP8 weight holds Wᵀ and reports W's shape. rows: the linear's
    output rows of the parameter in [out, in] orientation (a slice for a split in-projection) of its ``out``
    rows. per_call: why
    the weight is quantized on every call instead of stored in FP8 ("" when it is stored)."""

    name: str
    transposed: bool
    rows: tuple[int, int]
    out: int
    per_call: str = ""

    def label(self) -> str:
        """The parameter's name (an nn.Linear's weight: the module's, as its module-call rows), with the rows
        when the linear reads a slice (report rows)."""
        name = self.name.removesuffix(".weight")
        return name if self.rows == (0, self.out) else f"{name}[{self.rows[0]}:{self.rows[1]}]"


def weight_operand(func: Any, args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The tensor a functional linear reads as its weight: ``F.linear``'s weight, a matmul's right operand."""
    if func in MATMUL_AS_LINEAR:
        return args[1] if len(args) > 1 else kwargs.get("other")
    w = args[1] if len(args) > 1 else kwargs.get("weight")
    return w if isinstance(w, torch.Tensor) else None


def param_ref(func: Any, w: torch.Tensor | None, names: dict[int, str]) -> ParamRef | None:
    """Which parameter (of ``names``: id → fqn) the linear weight operand ``w`` is, and which rows: the parameter
    itself, a row slice of it, or its transpose (``w`` of a matmul is the weight transposed). None for any
    other tensor (computed in forward, a buffer, a column slice)."""
    if w is None or w.dim() != 2:
        return None
    p = w if id(w) in names else w._base
    if p is None or id(p) not in names or p.dim() != 2 or p.is_meta or not p.is_contiguous():
        return None
    name = names[id(p)]
    if type(p) is FP8Weight or type(w) is FP8Weight:  # placed FP8 by load_pretrained: its views stay FP8 (weights.py)
        if type(p) is not FP8Weight or type(w) is not FP8Weight or p.transposed or p.qdata.dim() != 2:
            return None
        w, p = (w.qdata.mT if w.transposed else w.qdata), p.qdata  # the same layout questions, on the FP8 bytes
    if w.untyped_storage().data_ptr() != p.untyped_storage().data_ptr():
        return None
    shape, stride = tuple(w.shape), w.stride()
    if func in MATMUL_AS_LINEAR:  # x @ w = linear(x, wᵀ)
        shape, stride = shape[::-1], stride[::-1]
    offset = w.storage_offset() - p.storage_offset()
    if stride == p.stride() and shape[1] == p.shape[1] and offset % max(p.stride(0), 1) == 0:
        first = offset // max(p.stride(0), 1)
        return ParamRef(name, False, (first, first + shape[0]), p.shape[0])
    if offset == 0 and shape == (p.shape[1], p.shape[0]) and stride == (p.stride(1), p.stride(0)):
        return ParamRef(name, True, (0, shape[0]), shape[0])
    return None


class ParamUses:
    """What the trace saw read each parameter (and its views): as a recorded linear's weight, through a view,
    for metadata, or anything else — the first such other read is why the parameter stays high precision."""

    def __init__(self, root: nn.Module) -> None:
        self.names = {id(p): n for n, p in root.named_parameters()}
        self.views: dict[int, str] = {}  # trace tensor id → the parameter it is (a view of)
        self.other: dict[str, str] = {}  # parameter → a read that is not as a linear's weight

    def seen(self, tid: int, t: torch.Tensor) -> None:
        """A tensor met for the first time: note it when it is a parameter."""
        name = self.names.get(id(t))
        if name is not None:
            self.views[tid] = name

    def record(self, func: Any, input_ids: list[int], outputs: list[tuple[int, torch.Tensor]], op: Any) -> None:
        """One recorded call: classify its reads of parameters; its outputs that are views of one join it."""
        for tid in input_ids:
            name = self.views.get(tid)
            if name is None or name in self.other:
                continue
            ref = getattr(op, "weight_param", None)
            if op is not None and op.kind == LINEAR and ref is not None and ref.name == name and tid != input_ids[0]:
                continue  # the linear's weight
            views = [self.names.get(id(t._base)) for _, t in outputs]
            if outputs and all(v == name for v in views):
                self.views.update((i, name) for i, _ in outputs)
                continue
            if not outputs and getattr(func, "__name__", "") in _METADATA:
                continue
            self.other[name] = getattr(func, "__name__", str(func))

    def finish(self, ops: list) -> None:
        """Give each recorded linear's ParamRef the reason its parameter is quantized per call, if any."""
        orientations: dict[str, set[bool]] = {}
        for op in ops:
            if op.weight_param is not None:
                orientations.setdefault(op.weight_param.name, set()).add(op.weight_param.transposed)
        for op in ops:
            ref = op.weight_param
            if ref is None or not op.quantize:  # kept high precision (a router, an Override): its reason stands
                continue
            why = ""
            if ref.name in self.other:
                why = (f"the weight is quantized on every call: the trace saw '{ref.name}' also read by "
                       f"{self.other[ref.name]}(), which needs its high-precision values")
            elif len(orientations[ref.name]) > 1:
                why = f"the weight is quantized on every call: '{ref.name}' is read both as W and as Wᵀ"
            if why:
                op.weight_param = dataclasses.replace(ref, per_call=why)
                op.reason = why


def quantize_param_weights(m: nn.Module, ops: list) -> None:
    """convert(): store each parameter that functional linears read (and nothing else did) in FP8 on its
    module(s) — every module that holds the same parameter object, so a tie stays a tie."""
    by_name: dict[str, list] = {}
    for op in ops:
        if op.kind == LINEAR and op.weight_param is not None and not op.weight_param.per_call:
            by_name.setdefault(op.weight_param.name, []).append(op)
    module_linears = {op.weight_owner for op in ops if op.weight_owner is not None}
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for mod in m.modules():
        for attr, p in mod._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((mod, attr))
    for name, refs in by_name.items():
        owner_fqn, _, attr = name.rpartition(".")
        p = m.get_submodule(owner_fqn)._parameters.get(attr)
        if p is None or type(p) is FP8Weight or (attr == "weight" and owner_fqn in module_linears):
            continue  # an nn.Linear's own weight: convert quantized it as the module's (or keeps it, for a call
        if not all(op.quantize for op in refs) or len({op.qconfig.weight for op in refs}) > 1:  # in high precision)
            continue  # some read runs in high precision, or two configs: quantized per call
        cfg, transposed = refs[0].qconfig.weight, refs[0].weight_param.transposed
        w = p.detach().t() if transposed else p.detach()
        if cfg.granularity == "block" and not all(_block_aligned(op.weight_param.rows, cfg.block[0], w.shape[0])
                                                  for op in refs):
            continue  # a slice that cuts a block row: quantized per call
        if not all_finite(w):
            raise ValueError(f"convert(): the parameter '{name}' (a weight of {', '.join(op.fqn for op in refs)}) "
                             "has NaN/inf values; fix the weights or skip those ops with QConfig(overrides=...)")
        quantized = quantize_weight(w, cfg)
        for mod, held_as in holders[id(p)]:
            attach_fp8_weight(mod, quantized.qdata, quantized.scale, p.dtype, transposed=transposed,
                              block=quantized.block, name=held_as, qconfig=cfg)


def _block_aligned(rows: tuple[int, int], block_rows: int, n: int) -> bool:
    return rows[0] % block_rows == 0 and (rows[1] % block_rows == 0 or rows[1] == n)
