"""What happens to each intercepted call, per phase: trace, calibrate, convert, high precision.

A *run* lives for one call of the root model. ``auto_trace.intercepting(run)`` routes this thread's
torch functions and module calls to ``run.function_call`` / ``run.module_call``. Runs read and write
``AutoQuantizationState`` objects; the arithmetic of quantized ops is in ``basic_ops`` / ``fusions``.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.nn.modules import module as _module_globals
from torch.utils._pytree import tree_flatten, tree_map

from . import kernels, moe, offload
from .auto_trace import current_run, has_hooks, has_pre_hooks, original_call, routing_functions, suspended
from .basic_ops import PER_TOKEN_SLOTS, Call, linear_hp_weight, run_basic, stored_fp8_weight
from .fusions import Fusion
from .mappings import (
    ACT,
    FUNC_KINDS,
    INDEXED,
    LINEAR,
    MATMUL,
    NORM,
    PASSTHROUGH,
    SDPA,
    is_device_move,
    is_linear_module,
    is_passthrough,
)
from .plan import plan_of
from .quantization_state import AutoQuantizationState, SeenOp, observer_key


@dataclass
class Subgraph:
    """A matched fusion instance and the kinds of its ops in call order. (Hooks added after convert need
    no record here: a hooked module that receives a placeholder materializes the subgraph.)"""

    id: int
    fusion: Fusion
    kinds: tuple[str, ...]


@dataclass
class ModelRecord:
    """Everything dbr_quant keeps about one prepared model (held on the root as ``_dbr_record``)."""

    qconfig: Any
    phase: str = "tracing"  # tracing → prepared → converted
    states: list[AutoQuantizationState] = field(default_factory=list)
    hidden_states: list[tuple[nn.Module, AutoQuantizationState]] = field(default_factory=list)
    subgraphs: dict[int, Subgraph] = field(default_factory=dict)
    example: tuple[tuple, dict] | None = None  # prepare()'s example inputs: the default for the rewriter
    inspector: Any = None  # set by dbr_quant.inspect while a session runs: then forwards are InspectRuns
    calibration_lock: Any = field(default_factory=threading.RLock, repr=False, compare=False)
    observes_functions: bool = True  # whether calibration must see torch function calls (set by prepare)
    hessians: Any = None  # rounding.collect.HessianCollector when some op asks for GPTQ rounding (set by prepare)

    def __getstate__(self) -> dict:  # deepcopy / pickle: a lock cannot be copied; the copy gets its own
        state = dict(self.__dict__)
        state.pop("calibration_lock", None)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.calibration_lock = threading.RLock()


def state_of(module: nn.Module) -> AutoQuantizationState | None:
    st = module.__dict__.get("_auto_quant_state")
    return st if st is not None else module._modules.get("_auto_quant_state")


def fqn_of(module: nn.Module) -> str | None:
    return module.__dict__.get("_dbr_fqn")


class Run:
    """Shared bookkeeping: the module stack and where an op's record lives."""

    def __init__(self, root: nn.Module, record: ModelRecord) -> None:
        self.root = root
        self.record = record
        self.stack: list[nn.Module] = [root]
        # states of the modules on the stack that own records (root first): the innermost is where an op
        # now running is recorded — kept beside the stack so finding it is O(1) per op
        self.owners: list[AutoQuantizationState | None] = [state_of(root)]
        self.suspended = False
        self.cursors: dict[int, int] = {}  # id(state) → position of its next op in this forward
        self.hooked: list[tuple[nn.Module, Any]] = []  # linear modules with hooks now running: (module, body)
        self.routes_functions = True  # whether torch functions reach this run (set by auto_trace.intercepting)

    def next_op(self, st: AutoQuantizationState | None, kind: str, fqn: str, warn: bool = True) -> SeenOp | None:
        """The record of the op now running in ``st``'s module, or None when the trace never saw it here
        (one warning, for kinds this config quantizes; ``warn`` False for the others)."""
        if st is None:
            return None
        key = id(st)
        i = self.cursors.get(key, 0)
        j = st.match(kind, fqn, i)
        if j >= 0:
            self.cursors[key] = j + 1
            return st.seen_ops[j]
        if warn:
            st.unseen(kind, fqn, i, self.record.qconfig.strict)
        return None

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
        with suspended(self):
            return body(x)

    def owner(self) -> nn.Module:
        """The innermost module on the stack that owns records (a non-leaf module of the model, or root)."""
        for m in reversed(self.stack):
            if m.__dict__.get("_dbr_owner"):
                return m
        return self.root

    def owner_state(self) -> AutoQuantizationState | None:
        """The state of the innermost module on the stack that owns records (a non-leaf module, or root)."""
        return self.owners[-1]

    def op_fqn(self, kind: str, module: nn.Module | None = None) -> str:
        if module is not None and fqn_of(module) is not None:
            return fqn_of(module)
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
        op = call.op
        if op.qconfig.dynamic:
            cfg = op.qconfig.activation
            per_token = cfg.granularity == "token" and slot in PER_TOKEN_SLOTS
            return kernels.dynamic_scale(x, cfg.format, per_token=per_token)
        st = call.state
        if st.converted:  # st.frozen_scale(op, slot), inlined: this runs for every quantized activation
            name = st._scale_names.get((op.index, slot))
            s = st._buffers[name] if name is not None else st.frozen_scale(op, slot)
        else:
            s = st.observers[observer_key(op.index, slot)].scale()
        return s if x is None or s.device == x.device else s.to(x.device)

    def call_module(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        self.stack.append(module)
        d = module.__dict__
        owns = d.get("_dbr_owner", False)
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
        root = getattr(forward, "_dbr_root", None)
        if root is None or root.__dict__.get("_dbr_record") is not self.record:
            return None
        return d.get("_dbr_inner_forward") or type(module).forward.__get__(module)

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
            self.record.hessians.observe(self, op, call_args, kwargs)  # GPTQ rounding (rounding/collect.py)
        if op is None or not op.quantize or op.qconfig.dynamic:
            return
        values = observed_inputs(kind, call_args, kwargs)
        for slot in op.slots:
            st.observe(op, slot, values[slot])

    def function_call(self, func, args, kwargs):
        if self.hooked and func in HOOKED_BODY_FUNCS:  # a hooked linear's own F.linear / addmm: its input now
            module = self.hooked[-1][0]                 # is what its pre-hooks made of it
            if self.stack[-1] is module and any(a is module._parameters.get("weight") for a in args):
                with suspended(self):
                    self._observe(LINEAR, (args[0] if func is torch.nn.functional.linear else args[1],), {}, module)
                    return func(*args, **kwargs)
        if not self.routes_functions:  # functions routed here only for a hooked linear's body
            return func(*args, **kwargs)
        kind = FUNC_KINDS.get(func)
        if kind in INDEXED:
            self._observe(kind, args, kwargs, None)
        return func(*args, **kwargs)

    def module_call(self, module, args, kwargs):
        if is_linear_module(module):
            if has_pre_hooks(module):  # observe what convert will quantize: the input after the pre-hooks
                with routing_functions(self):
                    return self.call_hooked(module, None, args, kwargs)
            with suspended(self):
                self._observe(LINEAR, args, kwargs, module)
                return original_call(module, *args, **kwargs)
        if module.__dict__.get("_dbr_experts") is not None:  # MoE experts module, called as one op: moe.py
            return moe.experts_call(self, module, args, kwargs, "calibrate")
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


@dataclass(slots=True)
class _Pending:
    subgraph: Subgraph
    calls: list[Call] = field(default_factory=list)


class ConvertRun(Run):
    """Executes quantized ops in FP8 and recorded subgraphs through their fusions.

    A subgraph runs when its last op arrives: until then each of its ops returns a placeholder (an
    empty meta tensor) that only the next op of the same subgraph consumes — the trace proved it. If
    anything else touches a placeholder (control flow changed, a hook appeared, it is returned), the
    subgraph is *materialized*: its ops so far run one by one, and the real values replace the
    placeholders.
    """

    def begin(self) -> None:
        super().begin()
        self.pending: dict[int, _Pending] = {}
        self.placeholders: dict[int, _Pending] = {}
        self.resolved: dict[int, torch.Tensor] = {}
        self.done: list[_Pending] = []
        self.n_placeholders = placeholder_base(current_run() is None)  # next index into this thread's pool
        self.onloaded: dict[int, nn.Module] = {}  # accelerate-offloaded modules whose weights we loaded
        self.pool = _placeholder_pool()  # this thread's placeholder tensors (grown by _placeholder_tensor)
        self.subgraphs = self.record.subgraphs

    # ------------------------------------------------------------------ placeholders
    def _scan(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, _Pending | None]:
        """Swap resolved placeholders for values; return the pending subgraph an argument belongs to."""
        hit = None

        def fix(a):
            nonlocal hit
            if isinstance(a, torch.Tensor):
                key = id(a)
                if key in self.resolved:
                    return self.resolved[key]
                p = self.placeholders.get(key)
                if p is not None:
                    if hit is not None and hit is not p:
                        self.materialize(hit)
                    hit = p
            elif isinstance(a, (list, tuple)) and a and any(isinstance(x, torch.Tensor) for x in a):
                return type(a)(fix(x) for x in a) if not hasattr(a, "_fields") else a
            return a

        args = tuple(fix(a) for a in args)
        kwargs = {k: fix(v) for k, v in kwargs.items()} if kwargs else kwargs
        if hit is not None and hit.subgraph.id not in self.pending:  # materialized while scanning
            args = tuple(self.resolved.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in args)
            hit = None
        return args, kwargs, hit

    def _resolve_all(self, args: tuple, kwargs: dict, hit: _Pending | None) -> tuple[tuple, dict]:
        if hit is not None:
            self.materialize(hit)
            args, kwargs, _ = self._scan(args, kwargs)
        return args, kwargs

    def materialize(self, p: _Pending) -> None:
        """Run a pending subgraph's ops one by one and record the real value of each placeholder."""
        self.pending.pop(p.subgraph.id, None)
        for call in p.calls:
            self.placeholders.pop(id(call.placeholder), None)
            args = tuple(self.resolved.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in call.args)
            out = run_basic(Call(call.kind, call.func, args, call.kwargs, call.op, call.state), self)
            self.resolved[id(call.placeholder)] = out
        self.done.append(p)

    def _placeholder(self, p: _Pending, call: Call) -> torch.Tensor:
        n = self.n_placeholders
        pool = self.pool
        ph = pool[n] if n < len(pool) else _placeholder_tensor(n)
        self.n_placeholders = n + 1
        call.placeholder = ph
        p.calls.append(call)
        self.placeholders[id(ph)] = p
        return ph

    def _step(self, p: _Pending, call: Call) -> torch.Tensor:
        """Add ``call`` to its subgraph: run the fusion if it completes it, else return a placeholder."""
        if len(p.calls) + 1 == len(p.subgraph.kinds):
            p.calls.append(call)
            self.pending.pop(p.subgraph.id, None)
            for c in p.calls[:-1]:
                self.placeholders.pop(id(c.placeholder), None)
            self.done.append(p)
            try:
                return p.subgraph.fusion.run(p.calls, self)
            except TypeError as e:  # inside `a + b` Python would turn a TypeError into a bare NotImplemented
                ops = ", ".join(c.op.fqn for c in p.calls if c.op is not None)
                raise RuntimeError(f"dbr_quant: the fused {p.subgraph.fusion.name} subgraph ({ops}) failed: "
                                   f"{type(e).__name__}: {e}") from e
        return self._placeholder(p, call)

    # ------------------------------------------------------------------ interception
    def _execute(self, call: Call, hit: _Pending | None) -> Any:
        op = call.op
        sg = self.record.subgraphs.get(op.group[0]) if op.group is not None else None
        if sg is not None:
            step = op.group[1]
            p = self.pending.get(sg.id)
            if step == 0:
                if p is not None:
                    self.materialize(p)
                if hit is not None:
                    call.args, call.kwargs = self._resolve_all(call.args, call.kwargs, hit)
                p = _Pending(sg)
                self.pending[sg.id] = p
                return self._step(p, call)
            if p is not None and len(p.calls) == step and (hit is None or hit is p):
                return self._step(p, call)
            if p is not None:
                self.materialize(p)
        call.args, call.kwargs = self._resolve_all(call.args, call.kwargs, hit)
        return run_basic(call, self)

    def function_call(self, func, args, kwargs):
        if self.hooked and func in HOOKED_BODY_FUNCS:
            out = self.hooked_body(func, args, kwargs)
            if out is not NotImplemented:
                return out
        if func is torch.Tensor.to and id(args[0]) in self.placeholders and self._moves_nothing(args, kwargs):
            return args[0]
        hit = None
        if self.placeholders or self.resolved:
            args, kwargs, hit = self._scan(args, kwargs)
        kind = FUNC_KINDS.get(func)
        if kind in INDEXED:
            st = self.owner_state()
            op = self.next_op(st, kind, self.op_fqn(kind), self.warns(kind))
            if op is not None:
                return self._execute(Call(kind, func, args, kwargs, op, st), hit)
        elif hit is not None:
            kinds = hit.subgraph.kinds
            expected = len(hit.calls) < len(kinds) and kinds[len(hit.calls)] == kind
            if expected and (kind != PASSTHROUGH or is_passthrough(func, args, kwargs)):  # e.g. train-mode dropout
                return self._step(hit, Call(kind, func, args, kwargs))
        if hit is not None:
            args, kwargs = self._resolve_all(args, kwargs, hit)
        return func(*args, **kwargs)

    def _moves_nothing(self, args: tuple, kwargs: dict) -> bool:
        """A placeholder moved to the device its subgraph computes on (accelerate's hooks do it at module
        boundaries; the trace saw such moves move nothing and did not record them): it stays a placeholder."""
        if not is_device_move(args, kwargs):
            return False
        first = self.placeholders[id(args[0])].calls[0].args[0]
        target = args[1] if len(args) > 1 else kwargs["device"]
        return isinstance(first, torch.Tensor) and first.device == torch.device(target)

    def module_call(self, module, args, kwargs):
        d = module.__dict__
        role = _ROLES.get(type(module))
        if role is None:
            role = _role(type(module))
        if (role is _LINEAR or role is _ACT) and "_hf_hook" not in d and len(args) == 1 and not kwargs \
                and not module._forward_hooks and not module._forward_pre_hooks:
            # the precompiled plan's fast paths (plan.py): a plain nn.Linear or activation module whose step
            # is the expected one; NotImplemented when anything is unusual (then the general path below)
            out = self._linear_fast(module, d, args[0]) if role is _LINEAR else self._act_fast(module, args[0])
            if out is not NotImplemented:
                return out
        if role is _PLAIN and "_hf_hook" not in d and d.get("_dbr_experts") is None \
                and not d.get("_dbr_norm") and not ((self.placeholders or self.resolved) and has_hooks(module)):
            return self.call_module(module, args, kwargs)  # the common case, decided by a few dict lookups
        if "_hf_hook" in d and (is_linear_module(module) or d.get("_dbr_norm")) and not has_hooks(module):
            # accelerate (offload.py) loads weights in the forward wrapper that the FP8 path bypasses: load
            # them here and keep them until no pending fused subgraph can still read them
            args, kwargs = offload.onload(module, args, kwargs)
            self.onloaded[id(module)] = module
            try:
                return self._module_call(module, args, kwargs)
            finally:
                if not self.pending:
                    self._offload()
        return self._module_call(module, args, kwargs)

    def _linear_fast(self, module: nn.Module, d: dict, x: Any) -> Any:
        """A plain ``nn.Linear`` (one positional input, no hooks) whose record is the next one in its owner's
        plan: no generic scan, matching or subgraph lookup, and no suspension while it only joins a pending
        subgraph (nothing below calls torch then). NotImplemented, with nothing consumed, when the op is not
        the expected one (the general path then matches, warns or raises as before)."""
        st = self.owners[-1]
        if st is None:
            return NotImplemented
        plan = st.__dict__.get("_dbr_plan")
        if plan is None or plan.subgraphs is not self.subgraphs:
            plan = plan_of(st, self.subgraphs)
        key = id(st)
        i = self.cursors.get(key, 0)
        steps = plan.steps
        if i >= len(steps):
            return NotImplemented
        step = steps[i]
        if step.kind != LINEAR or step.fqn != d.get("_dbr_fqn"):  # == on the same str object is an identity check
            return NotImplemented
        hit = None
        if self.placeholders or self.resolved:
            k = id(x)
            resolved = self.resolved.get(k)
            if resolved is not None:
                x = resolved
            else:
                hit = self.placeholders.get(k)
        self.cursors[key] = i + 1
        call = Call(LINEAR, module, (x,), {}, step.op, st)
        sg = step.subgraph
        if sg is not None:
            p = self.pending.get(sg.id)
            if step.step == 0:
                if p is None and hit is None and not step.last:
                    p = self.pending[sg.id] = _Pending(sg)
                    return self._placeholder(p, call)
            elif p is not None and len(p.calls) == step.step and (hit is None or hit is p):
                if not step.last:
                    return self._placeholder(p, call)
                before, self.suspended = self.suspended, True  # `suspended(self)`, inlined
                guard = _DisableTorchFunction()
                guard.__enter__()
                try:
                    return self._step(p, call)
                finally:
                    guard.__exit__(None, None, None)
                    self.suspended = before
        with suspended(self):
            return self._execute(call, hit)

    def _act_fast(self, module: nn.Module, x: Any) -> Any:
        """An activation module (one input, no hooks): its functional call on real input, or the next step of
        the pending subgraph ``x`` is a placeholder of; NotImplemented otherwise (the general path)."""
        p = self.placeholders.get(id(x))
        if p is None:
            if self.resolved or _module_globals._global_forward_hooks or _module_globals._global_forward_pre_hooks:
                return NotImplemented
            with _DisableTorchFunction():  # a functional activation calls no module: `suspended` not needed
                return _ACTIVATION_BODIES[type(module)](module, x)
        kinds = p.subgraph.kinds
        n = len(p.calls)
        if n >= len(kinds) or kinds[n] != ACT or _global_hooks():
            return NotImplemented
        func, kw = ACTIVATION_MODULES[type(module)](module)
        call = Call(ACT, func, (x,), kw)
        if n + 1 < len(kinds):
            return self._placeholder(p, call)
        with suspended(self):
            return self._step(p, call)

    def _offload(self) -> None:
        while self.onloaded:
            offload.offload(self.onloaded.popitem()[1])

    def _module_call(self, module, args, kwargs):
        if is_linear_module(module):
            if has_hooks(module):
                return self._hooked_linear_call(module, args, kwargs)
            with suspended(self):  # our own torch calls below are not the model's
                return self._linear_call(module, args, kwargs)
        if module.__dict__.get("_dbr_experts") is not None:  # MoE experts module, called as one op: moe.py
            return moe.experts_call(self, module, args, kwargs, "convert")
        act = ACTIVATION_MODULES.get(type(module))
        if act is not None and len(args) == 1 and not kwargs and not has_hooks(module) and not _global_hooks():
            # an activation module's forward is one F.relu / F.gelu / F.silu: take the step it would take
            # (join a pending subgraph, or just compute) without the module call and the torch-function trip
            func, kw = act(module)
            p = self.placeholders.get(id(args[0]))
            if p is None and not self.resolved:
                with suspended(self):
                    return func(args[0], **kw)
            kinds = p.subgraph.kinds if p is not None else ()
            if p is not None and len(p.calls) < len(kinds) and kinds[len(p.calls)] == ACT:
                with suspended(self):
                    return self._step(p, Call(ACT, func, args, kw))
        if module.__dict__.get("_dbr_norm") and not has_hooks(module) and len(args) == 1 and not kwargs:
            with suspended(self):
                return self._norm_module_call(module, args)
        if (self.placeholders or self.resolved) and has_hooks(module):
            with suspended(self):
                args, kwargs, hit = self._scan(args, kwargs)
                args, kwargs = self._resolve_all(args, kwargs, hit)
        return self.call_module(module, args, kwargs)

    def _norm_module_call(self, module: nn.Module, args: tuple) -> Any:
        """A recognised RMSNorm module: a NORM op, possibly the head of a fused subgraph."""
        hit = None
        if self.placeholders or self.resolved:
            args, _, hit = self._scan(args, {})
        op = self.next_op(st := self.owner_state(), NORM, self.op_fqn(NORM, module), False)
        if op is None:
            args, _ = self._resolve_all(args, {}, hit)
            return Call(NORM, module, args, {}).run_original()
        return self._execute(Call(NORM, module, args, {}, op, st), hit)

    def _hooked_linear_call(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Hooks must see real tensors: no fusion, the stock __call__ runs them around our FP8 op."""
        with suspended(self):
            if self.placeholders or self.resolved:
                args, kwargs = self._resolve_all(*self._scan(args, kwargs))
            op = self.next_op(st := self.owner_state(), LINEAR, self.op_fqn(LINEAR, module))
        return self.call_hooked(module, lambda x: run_basic(Call(LINEAR, module, (x,), {}, op, st), self),
                                args, kwargs)

    def _linear_call(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        hit = None
        if self.placeholders or self.resolved:
            args, kwargs, hit = self._scan(args, kwargs)
        op = self.next_op(st := self.owner_state(), LINEAR, self.op_fqn(LINEAR, module))
        if op is None:
            args, kwargs = self._resolve_all(args, kwargs, hit)
            return Call(LINEAR, module, args, kwargs).run_original()
        return self._execute(Call(LINEAR, module, args, kwargs, op, st), hit)

    def finish(self, out: Any) -> Any:
        for p in list(self.pending.values()):
            self.materialize(p)
        self._offload()
        if self.resolved:
            out = tree_map(lambda t: self.resolved.get(id(t), t) if isinstance(t, torch.Tensor) else t, out)
        return out


_container_classes: dict[type, bool] = {}
_PLAIN, _LINEAR, _ACT, _OTHER = "plain", "linear", "act", "other"
_ROLES: dict[type, str] = {}


def _role(cls: type) -> str:
    """What the convert run does with a module of class ``cls`` (cached per class): runs its forward
    (plain), executes it as a linear op through the plan's fast path (a stock ``nn.Linear``), takes an
    activation step, or decides per call (other linear modules: Hugging Face Conv1D)."""
    if not _plain_container(cls):
        role = _ACT if cls in ACTIVATION_MODULES else (
            _LINEAR if issubclass(cls, nn.Linear) and cls.forward is nn.Linear.forward else _OTHER)
    else:
        role = _PLAIN
    _ROLES[cls] = role
    return role


def _plain_container(cls: type) -> bool:
    """Whether the convert run does nothing with a module of class ``cls`` itself (it only runs its forward):
    not a linear module, not an activation module. Cached per class (per instance, the run still checks
    the norm/experts marks and hooks)."""
    plain = _container_classes.get(cls)
    if plain is None:
        linear = issubclass(cls, nn.Linear) or (cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers."))
        plain = _container_classes[cls] = not linear and cls not in ACTIVATION_MODULES
    return plain


_pool = threading.local()
_DisableTorchFunction = torch._C.DisableTorchFunction


def _placeholder_tensor(i: int) -> torch.Tensor:
    """The i-th placeholder of this thread's pool: an empty meta tensor marked as a placeholder. Runs of
    one thread nest (a prepared model called inside another's forward), so each run takes indices above
    those of the runs it is nested in (``placeholder_base``): identities stay unique among live runs."""
    tensors = _placeholder_pool()
    if len(tensors) <= i:
        with _DisableTorchFunction():  # not a call of the model's
            while len(tensors) <= i:
                ph = torch.empty(0, device="meta")
                ph._dbr_placeholder = True
                tensors.append(ph)
    return tensors[i]


def _placeholder_pool() -> list[torch.Tensor]:
    tensors = getattr(_pool, "tensors", None)
    if tensors is None:
        tensors = _pool.tensors = []
    return tensors


def placeholder_base(outermost: bool) -> int:
    """Where a new run's placeholders start in this thread's pool: 0 for an outermost run, else above
    everything handed out so far."""
    return 0 if outermost else len(getattr(_pool, "tensors", ()))


def _any_global_hooks() -> bool:
    """Hooks registered for every module, forward or backward."""
    g = _module_globals
    return bool(g._global_forward_hooks or g._global_forward_pre_hooks or g._global_backward_hooks
                or g._global_backward_pre_hooks)


def _global_hooks() -> bool:
    """Hooks registered for every module (``nn.modules.module.register_module_forward_hook``)."""
    return bool(_module_globals._global_forward_hooks or _module_globals._global_forward_pre_hooks)


# activation modules whose forward is one functional call: (module) → (function, kwargs)
ACTIVATION_MODULES = {
    nn.ReLU: lambda m: (torch.nn.functional.relu, {"inplace": m.inplace}),
    nn.GELU: lambda m: (torch.nn.functional.gelu, {"approximate": m.approximate}),
    nn.SiLU: lambda m: (torch.nn.functional.silu, {"inplace": m.inplace}),
}
# the same calls, made directly: (module, x) → output (the activation fast path's standalone case)
_ACTIVATION_BODIES = {
    nn.ReLU: lambda m, x: torch.nn.functional.relu(x, m.inplace),
    nn.GELU: lambda m, x: torch.nn.functional.gelu(x, approximate=m.approximate),
    nn.SiLU: lambda m, x: torch.nn.functional.silu(x, m.inplace),
}


class InspectRun(Run):
    """A prepared (calibrated) or converted model inside a ``dbr_quant.inspect`` session.

    Every recorded quantized op runs on its own (no subgraphs, so each layer is observable) through
    ``inspector.execute(call, env)``, which decides per layer between FP8, fake quantization and high
    precision and logs statistics. On a prepared model the activation scales are the observers' current
    ones and weights are quantized on the fly — what convert would store.
    """

    def __init__(self, root: nn.Module, record: ModelRecord, inspector: Any) -> None:
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
        if kind in INDEXED:
            st, op = self._op(kind)
            if op is not None and op.quantize:
                return self.inspector.execute(Call(kind, func, args, kwargs, op, st), self)
        return func(*args, **kwargs)

    def module_call(self, module, args, kwargs):
        if module.__dict__.get("_dbr_experts") is not None:  # MoE experts module, called as one op: moe.py
            return moe.experts_call(self, module, args, kwargs,
                                    "convert" if self.record.phase == "converted" else "hp")
        if not is_linear_module(module):
            return self.call_module(module, args, kwargs)
        with suspended(self):
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
                with suspended(self):
                    return body(*args, **kwargs)
            return self.call_hooked(module, body, args, kwargs)
        return self.call_module(module, args, kwargs)


# what a linear module's own forward calls to compute its output (nn.Linear; Hugging Face Conv1D)
HOOKED_BODY_FUNCS = frozenset({torch.nn.functional.linear, torch.addmm})


def tensor_leaves(obj: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(obj)[0] if isinstance(x, torch.Tensor)]
