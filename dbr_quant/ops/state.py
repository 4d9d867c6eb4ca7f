"""AutoQuantizationState: what one module's forward was seen to do, and the quantization state for it.

One state is attached as ``_auto_quant_state`` to every module whose forward runs recorded ops. It keeps
the ops in call order (``seen_ops``), an observer per quantized activation (``observers``), and after
convert the activation scales as buffers. It does not know how ops are intercepted (runtime.interception) nor
how they are computed (fusions / kernels).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast

import torch
from torch import nn

from dbr_quant.observers.base import AmaxObserver
from dbr_quant.ops.call import OpRecord, not_float_activation
from dbr_quant.ops.heads import HEAD_AXIS, observable
from dbr_quant.qconfig import OpQConfig

if TYPE_CHECKING:  # plan.py builds on this module
    from dbr_quant.runtime.plan import Plan


class UnseenOpError(RuntimeError):
    """A forward ran a recorded op the trace never saw, with ``QConfig(strict=True)``."""


class UncalibratedError(RuntimeError):
    """convert() was called before calibration ran the observers it needs."""


@dataclass(frozen=True)
class TensorInfo:
    """A tensor as seen during the trace: a trace-local id, its dtype and shape."""

    id: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def __repr__(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"t{self.id}:{dtype}{list(self.shape)}"


@dataclass
class SeenOp:
    """One recorded op: its position in the module's forward, what it is, and how it will run."""

    index: int
    kind: str
    fqn: str
    target: str
    inputs: tuple[TensorInfo | None, ...]
    outputs: tuple[TensorInfo, ...]
    qconfig: OpQConfig
    quantize: bool
    reason: str = ""  # why it stays in high precision, when quantize is False
    slots: tuple[str, ...] = ()  # activation inputs that get an observer / scale
    group: tuple[int, int] | None = None  # (subgraph id, step) when part of a fused subgraph
    fusion: str | None = None
    weight_owner: str | None = None  # fqn of the nn.Linear holding a static weight
    weight_param: Any = None  # param_weights.ParamRef: the parameter a functional linear reads as its weight

    def describe(self) -> str:
        ins = ", ".join(repr(t) if t is not None else "-" for t in self.inputs)
        outs = ", ".join(repr(t) for t in self.outputs)
        mode = "fp8" if self.quantize else f"high precision ({self.reason})"
        fused = f" fusion={self.fusion}#{self.group[0]}.{self.group[1]}" if self.group else ""
        return f"({self.index}) {self.kind} {self.fqn} [{self.target}] in=({ins}) out=({outs}) {mode}{fused}"


def observer_key(index: int, slot: str) -> str:
    return f"{index}_{slot}"


class ScaleFallback(Protocol):
    """Where a record's activation takes its scale when its own observer saw no data: a rule a record may carry
    (``AutoQuantizationState.scale_fallback``; moe/siblings.py: the largest among its sibling experts')."""

    @property
    def note(self) -> str: ...  # added to an uncalibrated activation's message: where else it was looked for

    def calibrated(self, st: AutoQuantizationState, op: SeenOp, slot: str) -> bool:
        """Whether the activation has a scale to freeze though ``st``'s own observer may have none."""
        ...

    def scale(self, st: AutoQuantizationState, op: SeenOp, slot: str) -> torch.Tensor | None:
        """The scale to freeze instead of the own observer's, or None: the own observer's (it saw data)."""
        ...


class AutoQuantizationState(nn.Module):
    """Per-module record of quantizeable ops (call order), their observers and converted scales."""

    def __init__(self, fqn: str) -> None:
        super().__init__()
        self.fqn = fqn
        self.seen_ops: list[SeenOp] = []
        self.observers = nn.ModuleDict()
        self.converted = False
        self._warned: set[tuple] = set()
        self._scale_names: dict[tuple[int, str], str] = {}
        self.plan: Plan | None = None  # the convert run's precompiled plan (runtime/plan.py), built on first use
        self.scale_fallback: ScaleFallback | None = None  # where uncalibrated activations take scales (if anywhere)

    # ----------------------------------------------------------------- recording (trace)
    def add_op(self, op: SeenOp, make_observer: Callable[[SeenOp, str], nn.Module]) -> SeenOp:
        self.seen_ops.append(op)
        if op.quantize and not op.qconfig.dynamic:
            for slot in op.slots:
                self.observers[observer_key(op.index, slot)] = make_observer(op, slot)
        return op

    def keep_high_precision(self, op: SeenOp, reason: str) -> None:
        """Undo ``add_op``'s FP8 decision for ``op`` (a verdict the whole trace's dataflow gives later)."""
        for slot in op.slots:
            if observer_key(op.index, slot) in self.observers:  # dynamic scales have none
                del self.observers[observer_key(op.index, slot)]
        op.quantize, op.reason, op.slots = False, reason, ()

    # ----------------------------------------------------------------- matching (later runs)
    def match(self, kind: str, fqn: str, start: int) -> int:
        """Index of the record for an op of ``kind``/``fqn`` at position ``start`` of a forward, or -1.

        Records are matched in call order; when an earlier record was skipped (a branch not taken this
        time), the next record with the same kind and fqn matches. The position belongs to the run (one
        per root forward), never to this shared state, so concurrent forwards do not disturb each other.
        """
        ops = self.seen_ops
        if start < len(ops) and ops[start].kind == kind and ops[start].fqn == fqn:
            return start
        for j in range(start + 1, len(ops)):
            if ops[j].kind == kind and ops[j].fqn == fqn:
                return j
        return -1

    def unseen(self, kind: str, fqn: str, position: int, strict: bool) -> None:
        """An op the trace never saw at this point: one warning per (op, position), or an error when strict."""
        msg = (
            f"dbr_quant: module '{self.fqn or '<root>'}' ran op '{kind}' ({fqn}) that the trace in prepare() "
            f"never saw at this point (control flow changed). It runs in high precision. Re-run prepare() "
            f"with example inputs that take this path to quantize it."
        )
        if strict:
            raise UnseenOpError(msg + " (QConfig(strict=True) turns this warning into this error.)")
        key = (kind, fqn, position)
        if key not in self._warned:
            self._warned.add(key)
            warnings.warn(msg, stacklevel=5)

    # ----------------------------------------------------------------- calibration / convert
    def observe(self, op: SeenOp, slot: str, x: torch.Tensor) -> None:
        if not x.is_floating_point():  # the observer's own TypeError could not say which op it belongs to
            raise not_float_activation(op, slot, x, calibrating=True)
        observer = cast(AmaxObserver, self.observers[observer_key(op.index, slot)])
        heads = observer.num_channels if observer.axis == HEAD_AXIS else None
        observer(observable(x, heads) if heads else x)  # per head: kv heads repeated or not (ops/heads.py)

    def uncalibrated(self) -> list[str]:
        fallback = self.scale_fallback
        return [
            f"{self.fqn or '<root>'}: op {op.index} {op.kind} {op.fqn} input '{slot}'"
            + ("" if fallback is None else fallback.note)
            for op in self.seen_ops
            if op.quantize and not op.qconfig.dynamic
            for slot in op.slots
            if not self.observers[observer_key(op.index, slot)].calibrated
            and (fallback is None or not fallback.calibrated(self, op, slot))
        ]

    def suspicious_calibration(self) -> list[str]:
        """Activations whose calibration data look wrong, one line each: NaN/inf values (observers skip them and
        count them in ``nonfinite``: an fp16 overflow upstream, a bad batch) or no nonzero value (no range: the scale
        falls back to 1, ``formats.safe_scale``). Both would otherwise pass silently."""
        ops_by_index = {str(op.index): op for op in self.seen_ops}
        lines = []
        for key, observer in self.observers.items():
            if not isinstance(observer, AmaxObserver) or not observer.calibrated:
                continue
            index, _, slot = key.partition("_")
            op = ops_by_index.get(index)
            where = f"{self.fqn or '<root>'}: {op.kind if op else 'op'} {op.fqn if op else index} '{slot}'"
            if int(observer.nonfinite) > 0:
                lines.append(f"{where}: {int(observer.nonfinite)} NaN/inf value(s) seen and ignored")
            if bool((observer.amax == 0).all()):
                lines.append(f"{where}: no nonzero value seen (zeros or empty batches only): scale 1.0")
        return lines

    def freeze_scales(self) -> None:
        """Turn every observer into a fixed scale buffer (kept beside the observer's amax); an activation whose
        observer saw no data takes the ``scale_fallback``'s scale where the record has one."""
        for op in self.seen_ops:
            if not op.quantize or op.qconfig.dynamic:
                continue
            for slot in op.slots:
                scale = None if self.scale_fallback is None else self.scale_fallback.scale(self, op, slot)
                if scale is None:
                    scale = self.observed_scale(op, slot).detach().clone()
                self.register_buffer(f"scale_{observer_key(op.index, slot)}", scale)
        self.converted = True

    def scale(self, op: SeenOp, slot: str) -> torch.Tensor:
        return getattr(self, f"scale_{observer_key(op.index, slot)}")

    def frozen_scale(self, op: OpRecord, slot: str) -> torch.Tensor:
        """``scale`` without building the name per call (the runtime's hot path: a name lookup, a buffer lookup)."""
        try:
            return self._buffers[self._scale_names[(op.index, slot)]]  # type: ignore[return-value]  # never None
        except KeyError:  # the first read of this scale (a buffer that freeze_scales registered): name it once
            name = self._scale_names[(op.index, slot)] = f"scale_{observer_key(op.index, slot)}"
            return self._buffers[name]  # type: ignore[return-value]

    def observed_scale(self, op: OpRecord, slot: str) -> torch.Tensor:
        """The scale an activation's observer gives now (before convert freezes it)."""
        return cast(AmaxObserver, self.observers[observer_key(op.index, slot)]).scale()

    def __getstate__(self) -> dict:
        """deepcopy / pickle: without the runtime's caches (the plan is rebuilt against the copy's record)."""
        state = super().__getstate__()
        state["plan"] = None
        return state

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # scale buffers exist only after convert(); a freshly converted skeleton has them, but make
        # loading robust to a skeleton whose scales were computed from different data.
        for name, value in state_dict.items():
            if name.startswith(prefix + "scale_") and "." not in name[len(prefix):]:
                local = name[len(prefix):]
                if local not in self._buffers:
                    self.register_buffer(local, torch.empty_like(value))
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _apply(self, fn, recurse=True):
        """``model.to(dtype)`` / ``.half()`` move scales and observer state to the new device but keep their
        dtype: an fp32 scale rounded to fp16 would change every FP8 value it produces (or overflow)."""
        def keep_dtype(t: torch.Tensor) -> torch.Tensor:
            moved = fn(t)
            return moved if moved.dtype == t.dtype else t.to(device=moved.device)

        return super()._apply(keep_dtype, recurse)

    # ----------------------------------------------------------------- display
    def extra_repr(self) -> str:
        head = f"fqn={self.fqn or '<root>'!r}, converted={self.converted}"
        return "\n".join([head, "(seen_ops):"] + ["  " + op.describe() for op in self.seen_ops])
