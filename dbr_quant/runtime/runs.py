"""What happens to each intercepted call, per phase: trace, calibrate, convert, high precision.

A *run* lives for one call of the root model. ``runtime.interception.intercepting(run)`` routes this thread's
torch functions and module calls to ``run.function_call`` / ``run.module_call``. Runs read and write
``AutoQuantizationState`` objects; the arithmetic of quantized ops is in ``ops.basic`` / ``ops.fusions``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.nn.modules import module as _module_globals
from torch.utils._pytree import tree_flatten

from dbr_quant import kernels
from dbr_quant.integrations import accelerate as offload
from dbr_quant.moe.call import ExpertsInspector, call_with_hooks, experts_forward
from dbr_quant.ops.basic import PER_TOKEN_SLOTS, stored_fp8_weight
from dbr_quant.ops.call import Call, Env, linear_hp_weight, not_float_activation
from dbr_quant.ops.mappings import (
    FUNC_KINDS,
    INDEXED,
    LINEAR,
    MATMUL,
    SDPA,
    call_kind,
    is_linear_module,
    is_transposed_linear,
)
from dbr_quant.ops.patterns import Subgraph
from dbr_quant.ops.state import AutoQuantizationState, SeenOp
from dbr_quant.ops.tags import TAG, experts_of, fqn_of, tag_of
from dbr_quant.qconfig import QConfig
from dbr_quant.quantize.weights import displaced_fp8_weight
from dbr_quant.runtime.hessians import HessianCollector
from dbr_quant.runtime.interception import has_hooks, has_pre_hooks, original_call, routing_functions, suspended


class Inspector(ExpertsInspector, Protocol):
    """A ``dbr_quant.inspect`` session (inspect/inspector.py) as its runs see it: it executes each recorded
    quantized op (FP8, fake quantization or high precision, per layer) and logs statistics."""

    def execute(self, call: Call, env: Env) -> Any: ...


@dataclass
class ModelRecord:
    """Everything dbr_quant keeps about one prepared model (held on the root as ``_dbr_record``)."""

    qconfig: QConfig
    phase: str = "tracing"  # tracing → prepared → converted
    states: list[AutoQuantizationState] = field(default_factory=list)
    hidden_states: list[tuple[nn.Module, AutoQuantizationState]] = field(default_factory=list)
    subgraphs: dict[int, Subgraph] = field(default_factory=dict)
    example: tuple[tuple, dict] | None = None  # prepare()'s example inputs: the default for the rewriter
    inspector: Inspector | None = None  # set by dbr_quant.inspect while a session runs: forwards are InspectRuns
    trace_run: Run | None = field(default=None, repr=False, compare=False)  # prepare()'s TraceRun while it traces
    calibration_lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)
    observes_functions: bool = True  # whether calibration must see torch function calls (set by prepare)
    hessians: HessianCollector | None = None  # when some op asks for GPTQ rounding (set by prepare)
    param_uses: dict = field(default_factory=dict)  # parameter fqn → the trace's calls that read it (precision.py)

    def __getstate__(self) -> dict:  # deepcopy / pickle: a lock cannot be copied; the copy gets its own
        state = dict(self.__dict__)
        state.pop("calibration_lock", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.calibration_lock = threading.RLock()


def _refuse_displaced_fp8_weight(module: nn.Module) -> None:
    """A converted linear whose FP8 weight was moved out of ``weight`` after convert (prune, parametrize) reaches
    here as a linear the trace never saw; running it as one would compute silently in high precision on
    dequantized values, so it is refused, saying what to do."""
    if not (isinstance(module, nn.Linear) or is_transposed_linear(module)):
        return
    name = displaced_fp8_weight(module)
    if name is not None:
        raise RuntimeError(
            f"dbr_quant: the converted linear '{fqn_of(module) or type(module).__name__}' computes its weight "
            f"from its FP8 weight (now '{name}': torch.nn.utils.prune or parametrize moved it out of `weight` "
            "after convert), which its FP8 GEMM cannot run. Prune / parametrize the fp32 model before prepare(), "
            "or undo it (parametrize.remove_parametrizations(module, 'weight', leave_parametrized=False) puts the "
            "FP8 weight back).")


def state_of(module: nn.Module) -> AutoQuantizationState | None:
    st = module.__dict__.get("_auto_quant_state")
    if st is not None:
        return st
    sub = module._modules.get("_auto_quant_state")
    return sub if isinstance(sub, AutoQuantizationState) else None


class Run:
    """Shared bookkeeping: the module stack and where an op's record lives."""

    def __init__(self, root: nn.Module, record: ModelRecord) -> None:
        self.root = root
        self.record = record
        self.stack: list[nn.Module] = [root]
        # states of the modules on the stack that own records (root first): the innermost is where an op
        # now running is recorded — kept beside the stack so finding it is O(1) per op
        self.owners: list[AutoQuantizationState | None] = [state_of(root)]
        self.cursors: dict[int, int] = {}  # id(state) → position of its next op in this forward
        self.hooked: list[tuple[nn.Module, Any]] = []  # linear modules with hooks now running: (module, body)
        self.routes_functions = True  # whether torch functions reach this run (set by interception.intercepting)

    def next_op(self, st: AutoQuantizationState | None, kind: str, fqn: str, warn: bool = True) -> SeenOp | None:
        """The record of the op now running in ``st``'s module, or None when the trace never saw it here
        (one warning, for kinds this config quantizes; ``warn`` False for the others)."""
        if st is None:
            return None
        j = self.match_position(st, kind, fqn, warn)
        return st.seen_ops[j] if j >= 0 else None

    def match_position(self, st: AutoQuantizationState, kind: str, fqn: str, warn: bool = True) -> int:
        """:meth:`next_op`'s position in ``st.seen_ops`` (the cursor moves past it), or -1 (warned about)."""
        key = id(st)
        i = self.cursors.get(key, 0)
        j = st.match(kind, fqn, i)
        if j >= 0:
            self.cursors[key] = j + 1
        elif warn:
            if kind == LINEAR:
                _refuse_displaced_fp8_weight(self.stack[-1])
            st.unseen(kind, fqn, i, self.record.qconfig.strict)
        return j

    def call_hooked(self, module: nn.Module, body, args: tuple, kwargs: dict) -> Any:
        """Call a linear module that has hooks through the stock ``__call__`` (so its hooks run and see
        real tensors) with ``body(x)`` computing its output: the module's own forward calls ``F.linear``
        (``torch.addmm`` for Conv1D), which :meth:`hooked_body` intercepts. Nothing on the module is
        patched, so other threads calling it at the same time are not affected."""
        self.hooked.append((module, body))
        try:
            return self.call_module(module, args, kwargs)
        finally:
            self.hooked.pop()

    def hooked_body(self, func, args: tuple, kwargs: dict) -> Any:
        """The output of a hooked linear's body, when this call is its forward's ``F.linear``/``addmm``;
        else NotImplemented."""
        module, body = self.hooked[-1]
        if self.stack[-1] is not module or not any(a is module._parameters.get("weight") for a in args):
            return NotImplemented
        x = args[0] if func is torch.nn.functional.linear else args[1]
        with suspended():
            return body(x)

    def owner(self) -> nn.Module:
        """The innermost module on the stack that owns records (a non-leaf module of the model, or root)."""
        for m in reversed(self.stack):
            tag = tag_of(m)
            if tag is not None and tag.owner:
                return m
        return self.root

    def owner_state(self) -> AutoQuantizationState | None:
        """The state of the innermost module on the stack that owns records (a non-leaf module, or root)."""
        return self.owners[-1]

    def op_fqn(self, kind: str, module: nn.Module | None = None) -> str:
        if module is not None:
            fqn = fqn_of(module)
            if fqn is not None:
                return fqn
        for m in reversed(self.stack):
            base = fqn_of(m)
            if base is not None:
                return f"{base}.{kind}" if base else kind
        return kind

    def warns(self, kind: str) -> bool:
        """Whether an unseen op of this kind deserves a warning: only kinds the config quantizes."""
        return kind == LINEAR or (kind in (MATMUL, SDPA) and self.record.qconfig.quantize_attention)

    def input_scale(self, call: Call, slot: str, x: torch.Tensor | None) -> torch.Tensor:
        """An activation's scale (the executors' env): the frozen one after convert, the observer's current
        one on a prepared model (inspection), or computed from ``x`` when dynamic."""
        op, st = call.op, call.state
        assert op is not None and st is not None, "executors run recorded ops"
        if x is not None and not x.is_floating_point():
            raise not_float_activation(op, slot, x)
        if op.qconfig.dynamic:
            cfg = op.qconfig.activation
            per_token = cfg.granularity == "token" and slot in PER_TOKEN_SLOTS
            assert x is not None, f"dbr_quant: {op.fqn}: a dynamic scale is computed from its tensor"
            return kernels.dynamic_scale(x, cfg.format, per_token=per_token)
        s = st.frozen_scale(op, slot) if st.converted else st.observed_scale(op, slot)
        # both on the CPU: two flags, no device objects to build and compare (this runs once or twice per op)
        return s if x is None or (s.is_cpu and x.is_cpu) or s.device == x.device else s.to(x.device)

    def call_module(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        self.stack.append(module)
        d = module.__dict__
        tag = d.get(TAG)
        owns = tag is not None and tag.owner
        if owns:
            self.owners.append(state_of(module))
        try:
            forward = self._direct_forward(module, d)
            if forward is not None:
                return forward(*args, **kwargs)
            return original_call(module, *args, **kwargs)
        finally:
            self.stack.pop()
            if owns:
                self.owners.pop()

    def experts_call(self, module: nn.Module, args: tuple, kwargs: dict, phase: str,
                     inspector: ExpertsInspector | None = None) -> Any:
        """A marked MoE experts module's call, as one op (moe/call.py): its body in ``phase`` with the module's
        hooks around it, or the module as written."""
        with suspended():
            body = experts_forward(module, args, kwargs, phase, inspector)
            if body is None:
                return original_call(module, *args, **kwargs)
            return call_with_hooks(module, body, args, kwargs) if has_hooks(module) else body(args, kwargs)

    def _direct_forward(self, module: nn.Module, d: dict) -> Any:
        """The forward that ``Module._call_impl`` would call, when calling it directly is all ``_call_impl``
        would do (no hooks anywhere, no TorchScript tracing), else None. For a module of this model that
        carries our entry forward (api.py), the body that forward runs inside a run of this model."""
        if module._forward_hooks or module._forward_pre_hooks or module._backward_hooks \
                or module._backward_pre_hooks or _any_global_hooks() or torch._C._get_tracing_state():
            return None
        forward = d.get("forward")
        if forward is None:
            return type(module).forward.__get__(module)
        tag = d.get(TAG)
        if tag is None or forward is not tag.entry_forward or forward.args[0] is not self.root:
            return None  # another wrapper (accelerate's, added after prepare), or the entry of another model
        return tag.inner_forward or type(module).forward.__get__(module)

    def begin(self) -> None:
        pass

    def finish(self, out: Any) -> Any:
        return out


class CalibrateRun(Run):
    """Runs the model in high precision and feeds each quantized op's inputs to its observers."""

    def _observe(self, kind: str, call_args: tuple, kwargs: dict, module: nn.Module | None) -> None:
        st = self.owner_state()
        if st is None:
            return
        op = self.next_op(st, kind, self.op_fqn(kind, module), self.warns(kind))
        if op is not None and module is not None and self.record.hessians is not None:
            self.record.hessians.observe(self, op, call_args, kwargs)  # GPTQ rounding (runtime/hessians.py)
        if op is None or not op.quantize or op.qconfig.dynamic:
            return
        values = observed_inputs(kind, call_args, kwargs)
        for slot in op.slots:
            st.observe(op, slot, values[slot])

    def function_call(self, func, args, kwargs):
        if self.hooked and func in HOOKED_BODY_FUNCS:  # a hooked linear's own F.linear / addmm: its input now
            module = self.hooked[-1][0]                 # is what its pre-hooks made of it
            if self.stack[-1] is module and any(a is module._parameters.get("weight") for a in args):
                with suspended():
                    self._observe(LINEAR, (args[0] if func is torch.nn.functional.linear else args[1],), {}, module)
                    return func(*args, **kwargs)
        if not self.routes_functions:  # functions routed here only for a hooked linear's body
            return func(*args, **kwargs)
        kind = FUNC_KINDS.get(func)
        if kind == MATMUL:  # x @ W of a parameter W is a linear (mappings.call_kind)
            kind = call_kind(func, args, kwargs)
        if kind in INDEXED:
            self._observe(kind, args, kwargs, None)
        return func(*args, **kwargs)

    def module_call(self, module, args, kwargs):
        if is_linear_module(module):
            if has_pre_hooks(module):  # observe what convert will quantize: the input after the pre-hooks
                with routing_functions(self):
                    return self.call_hooked(module, None, args, kwargs)
            with suspended():
                self._observe(LINEAR, args, kwargs, module)
                return original_call(module, *args, **kwargs)
        if experts_of(module) is not None:  # MoE experts module, called as one op: moe/
            return self.experts_call(module, args, kwargs, "calibrate")
        return self.call_module(module, args, kwargs)


def observed_inputs(kind: str, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
    """The activation tensors of an op by slot name (input; a, b; q, k, v)."""
    if kind == LINEAR:
        return {"input": args[0] if args else kwargs["input"]}
    if kind == "matmul":
        return {"a": args[0], "b": args[1] if len(args) > 1 else kwargs["other"]}
    if kind == "sdpa":
        names = ("query", "key", "value")
        vals = dict(zip(names, args))
        vals.update({k: v for k, v in kwargs.items() if k in names})
        return {"q": vals["query"], "k": vals["key"], "v": vals["value"]}
    return {}


def _any_global_hooks() -> bool:
    """Hooks registered for every module, forward or backward."""
    g = _module_globals
    return bool(g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks
                or g._global_backward_pre_hooks)



class InspectRun(Run):
    """A prepared (calibrated) or converted model inside a ``dbr_quant.inspect`` session.

    Every recorded quantized op runs on its own (no subgraphs, so each layer is observable) through
    ``inspector.execute(call, env)``, which decides per layer between FP8, fake quantization and high
    precision and logs statistics. On a prepared model the activation scales are the observers' current
    ones and weights are quantized on the fly — what convert would store.
    """

    def __init__(self, root: nn.Module, record: ModelRecord, inspector: Inspector) -> None:
        super().__init__(root, record)
        self.inspector = inspector

    def _op(self, kind: str, module: nn.Module | None = None):
        st = self.owner_state()
        return st, self.next_op(st, kind, self.op_fqn(kind, module), self.warns(kind))

    def function_call(self, func, args, kwargs):
        if self.hooked and func in HOOKED_BODY_FUNCS:
            out = self.hooked_body(func, args, kwargs)
            if out is not NotImplemented:
                return out
        kind = FUNC_KINDS.get(func)
        if kind == MATMUL:  # x @ W of a parameter W is a linear (mappings.call_kind)
            kind = call_kind(func, args, kwargs)
        if kind in INDEXED:
            st, op = self._op(kind)
            if op is not None and op.quantize:
                return self.inspector.execute(Call(kind, func, args, kwargs, op, st), self)
        return func(*args, **kwargs)

    def module_call(self, module, args, kwargs):
        if experts_of(module) is not None:  # MoE experts module, called as one op: moe/
            return self.experts_call(module, args, kwargs, "convert" if self.record.phase == "converted" else "hp",
                                     self.inspector)
        if not is_linear_module(module):
            return self.call_module(module, args, kwargs)
        with suspended():
            st, op = self._op(LINEAR, module)
            if op is not None and op.quantize:
                body = lambda x: self.inspector.execute(Call(LINEAR, module, (x,), {}, op, st), self)  # noqa: E731
            elif stored_fp8_weight(module) is not None:
                body = lambda x: Call(LINEAR, module, (x,), {}).run_original()  # noqa: E731
            else:
                return original_call(module, *args, **kwargs)
            if not has_hooks(module) and not offload.has_device_hook(module):  # accelerate loads weights in forward
                return body(*args, **kwargs)
        return self.call_hooked(module, body, args, kwargs)


class HighPrecisionRun(Run):
    """``dbr_quant.disabled()`` on a converted model: every op as written, FP8 weights dequantized."""

    def function_call(self, func, args, kwargs):
        if self.hooked and func in HOOKED_BODY_FUNCS:
            out = self.hooked_body(func, args, kwargs)
            if out is not NotImplemented:
                return out
        return func(*args, **kwargs)

    def module_call(self, module, args, kwargs):
        if is_linear_module(module) and stored_fp8_weight(module) is not None:
            body = lambda x: torch.nn.functional.linear(x, *linear_hp_weight(module))  # noqa: E731
            if not has_hooks(module) and not offload.has_device_hook(module):  # accelerate loads weights in forward
                with suspended():
                    return body(*args, *kwargs.values())  # a linear's one input, given by name too (`input=x`)
            return self.call_hooked(module, body, args, kwargs)
        return self.call_module(module, args, kwargs)


# what a linear module's own forward calls to compute its output (nn.Linear; Hugging Face Conv1D)
HOOKED_BODY_FUNCS = frozenset({torch.nn.functional.linear, torch.addmm})


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]
