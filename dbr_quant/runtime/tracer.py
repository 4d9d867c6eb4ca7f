"""The trace run of ``prepare``: one forward that records ops into states and finds subgraphs.

Every torch function and nn.Linear call is logged with the (trace-local) ids of the tensors it reads
and writes, so that after the forward the dataflow is known: which tensor each op consumes, which
tensors escape (returned, or seen by a module hook). Fusions are matched on that dataflow.
"""

from __future__ import annotations

import dataclasses
import gc
import numbers
import sys
import types
from collections import defaultdict
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_flatten

from dbr_quant.integrations.accelerate import onloaded
from dbr_quant.moe.trace import trace_experts
from dbr_quant.ops.fusions import find_subgraphs
from dbr_quant.ops.heads import head_axis
from dbr_quant.ops.mappings import (
    ACT,
    ADD,
    DIV,
    INDEXED,
    LINEAR,
    MATMUL,
    MUL,
    NORM,
    PASSTHROUGH,
    SDPA,
    SOFTMAX,
    activation_name,
    call_kind,
    is_device_move,
    is_linear_module,
    is_passthrough,
    linear_weight,
    rms_norm_module_eps,
)
from dbr_quant.ops.patterns import Event, Subgraph, TraceGraph
from dbr_quant.ops.state import AutoQuantizationState, SeenOp, TensorInfo
from dbr_quant.ops.tags import TAG, ModuleTag, experts_of, fqn_of, tag_of
from dbr_quant.runtime.interception import has_hooks, original_call, suspended
from dbr_quant.runtime.param_weights import ParamUses, param_ref, weight_operand
from dbr_quant.runtime.precision import ParamReads, skip_reason, tie_reason, tied_names
from dbr_quant.runtime.runs import ModelRecord, Run, observed_inputs, tensor_leaves

SLOTS = {LINEAR: ("input",), MATMUL: ("a", "b"), SDPA: ("q", "k", "v")}


class TraceRun(Run):
    """Runs the model once in high precision, recording every op."""

    def __init__(self, root: nn.Module, record: ModelRecord) -> None:
        super().__init__(root, record)
        self.events: list[Event] = []
        self.tids: dict[int, int] = {}
        self.keep: list[torch.Tensor] = []  # holds every traced tensor so ids are never reused
        self.escaped: set[int] = set()
        # tensor id → (index of the first event inside the call, module) for each module call that returned it:
        # a fused intermediate a module returns is read by that module's forward hooks (convert_run.py)
        self.returned: defaultdict[int, list[tuple[int, nn.Module]]] = defaultdict(list)
        self.states: dict[nn.Module, AutoQuantizationState] = {}
        self.current: Any = None  # the torch function running now, named in errors
        self.failed_stack: list[nn.Module] | None = None
        # Provenance, so that a matmul is only quantized between two *activations*: float data flowing
        # from the inputs, or looked up from an embedding by data ids. Parameters, buffers, factory
        # outputs (arange) and floats cast from integers (positions) are not: e.g. rotary tables.
        self.param_ids = {id(t) for t in (*root.parameters(), *root.buffers())}
        self.activations: set[int] = set()
        self.data_ints: set[int] = set()
        self.producers: dict[int, int] = {}  # tensor id → index of the event that wrote it (moe/trace.py walks it)
        self.param_uses = ParamUses(root)  # parameters read by functional linears, and what else reads them
        self.param_reads = ParamReads(root)  # which calls read each parameter: the report's reasons (precision.py)
        self.tied = tied_names(root)

    # ------------------------------------------------------------------ ids
    def tid(self, t: torch.Tensor, new: bool = False, activation: bool = False, data_int: bool = False) -> int:
        key = id(t)
        if new or key not in self.tids:
            self.tids[key] = i = len(self.keep)
            self.keep.append(t)
            # first seen as an input: model data (accelerate loads offloaded weights as new Parameters)
            if not new and key not in self.param_ids and not isinstance(t, nn.Parameter):
                activation, data_int = t.is_floating_point(), not t.is_floating_point()
            if not new:
                self.param_uses.seen(i, t)
            if activation and t.is_floating_point():
                self.activations.add(i)
            elif data_int and not t.is_floating_point():
                self.data_ints.add(i)
        return self.tids[key]

    def info(self, t: Any) -> TensorInfo | None:
        return self.tensor_info(t) if isinstance(t, torch.Tensor) else None

    def tensor_info(self, t: torch.Tensor) -> TensorInfo:
        return TensorInfo(self.tid(t), t.dtype, tuple(t.shape))

    # ------------------------------------------------------------------ recording
    def _state(self) -> AutoQuantizationState:
        owner = self.owner()
        st = self.states.get(owner)
        if st is None:
            st = self.states[owner] = AutoQuantizationState(fqn_of(owner) or "")
        return st

    def _record(self, kind: str | None, func: Any, args: tuple, kwargs: dict, out: Any,
                module: nn.Module | None = None) -> None:
        arg_ids = tuple(self.tid(a) if isinstance(a, torch.Tensor) else None for a in args)
        nested = [t for a in args if not isinstance(a, torch.Tensor) for t in tensor_leaves(a)] + tensor_leaves(kwargs)
        kwarg_ids = tuple(self.tid(t) for t in nested)
        inputs = [i for i in (*arg_ids, *kwarg_ids) if i is not None]
        outs = tensor_leaves(out)
        if not inputs and not outs:
            return
        inplace = _mutates(func, kwargs)
        from_data = any(i in self.activations or i in self.data_ints for i in inputs)
        activation = any(i in self.activations for i in inputs) or (
            func is F.embedding and bool(arg_ids) and arg_ids[0] in self.data_ints)
        out_ids = [self.tid(t, new=not inplace, activation=activation, data_int=from_data) for t in outs]
        output = out_ids[0] if isinstance(out, torch.Tensor) else None
        ev = Event(len(self.events), kind, func, arg_ids, kwarg_ids, output, detail=_detail(kind, func, args,
                                                                                            kwargs))
        self.producers.update((i, ev.index) for i in out_ids)
        if inplace:
            ev.kind = None  # an in-place op mutates its input: never part of a subgraph
            ev.written = output if output is not None else arg_ids[0] if arg_ids else None  # `x[i] = v`: None out
        if kind in INDEXED:
            operands = observed_inputs(kind, args, kwargs).values() if kind in (MATMUL, SDPA) else ()
            ev.op = self._seen_op(kind, func, args, kwargs, out, module,
                                  constant_operand=any(self.tid(t) not in self.activations for t in operands))
        self.param_uses.record(func, inputs, list(zip(out_ids, outs)), ev.op)
        self.param_reads.see(func, [a for a in args if isinstance(a, torch.Tensor)] + nested, inputs, out_ids, ev.op)
        self.events.append(ev)

    def _seen_op(self, kind, func, args, kwargs, out, module, constant_operand: bool) -> SeenOp:
        st = self._state()
        fqn = self.op_fqn(kind, module)
        types = tuple(type(m) for m in self.stack) + ((type(module),) if module is not None else ())
        ref = param_ref(func, weight_operand(func, args, kwargs), self.param_uses.names) \
            if kind == LINEAR and module is None else None
        # overrides match a parameter linear by its parameter ("self_attn.in_proj_weight", "self_attn.out_proj"), as
        # the report names it, or by the op's own name ("self_attn.linear", as inspect's auto_fallback names it)
        names = (fqn,) if ref is None else (ref.name.removesuffix(".weight"), fqn)
        qconfig = self.record.qconfig
        qc = qconfig.for_op(next((n for n in names if any(ov.matches(n, types) for ov in qconfig.overrides)), fqn),
                            types)
        quantize, reason = _decide(kind, args, kwargs, qc, module, self.record.qconfig.quantize_attention)
        tied = self.tied.get(f"{fqn}.weight") if module is not None else None
        if qc.skip and kind != NORM:
            reason = skip_reason(self.record.qconfig.override_for(fqn, types))
        elif quantize and tied and not qc.untie:  # the weight is another module's too (lm_head ↔ embedding)
            quantize, reason = False, tie_reason(tied)
        if kind == NORM:
            reason = "norm (a fusion partner, not quantized itself)"
        elif kind in (MATMUL, SDPA) and constant_operand and not qc.skip:  # the true reason, attention on or off
            quantize, reason = False, ("an operand is not an activation (computed from parameters, buffers, "
                                       "factories or integer positions, e.g. rotary tables)")
        inputs = tuple(self.info(a) for a in (args if module is None else (args[0], linear_weight(module))))
        op = SeenOp(
            index=len(st.seen_ops), kind=kind, fqn=fqn,
            target=type(module).__name__ if module is not None else getattr(func, "__name__", str(func)),
            inputs=inputs, outputs=tuple(self.tensor_info(t) for t in tensor_leaves(out)),
            qconfig=qc, quantize=quantize, reason=reason, slots=SLOTS.get(kind, ()) if quantize else (),
            weight_owner=fqn if module is not None and fqn_of(module) is not None else None,
            weight_param=ref,
        )

        # attention_scales="head": an observer per head along the head axis of attention operands (ops/heads.py)
        per_head = self.record.qconfig.attention_scales == "head" and kind in (MATMUL, SDPA)
        operands = observed_inputs(kind, args, kwargs) if per_head else {}

        def make_observer(op: SeenOp, slot: str) -> nn.Module:
            cfg = op.qconfig.activation
            x = operands.get(slot)
            return cfg.observer.create(cfg.format, None if x is None else head_axis(kind, x))

        st.add_op(op, make_observer)
        return op

    # ------------------------------------------------------------------ interception
    def function_call(self, func, args, kwargs):
        self.current = func
        out = func(*args, **kwargs)
        if func is torch.Tensor.to and out is args[0] and is_device_move(args, kwargs):
            return out  # moved nothing (e.g. accelerate's hook on a module boundary): the same tensor, no op
        self._record(call_kind(func, args, kwargs), func, args, kwargs, out)
        return out

    def module_call(self, module, args, kwargs):
        if is_linear_module(module):
            with suspended():  # the bookkeeping's own torch calls must not be recorded
                out = self._call_unrecorded(module, args, kwargs)
                x = args[0] if args else kwargs.get("input")
                self._record(LINEAR, module, (x,), {}, out, module)
                if has_hooks(module):
                    self._escape((x, out))
            return out
        if experts_of(module) is not None:  # MoE experts module, called as one op: moe/
            with suspended():
                out = self._call_unrecorded(module, args, kwargs)
                self._record(None, module, args, kwargs, out)  # an opaque op: its inputs have a consumer
                if has_hooks(module):
                    self._escape((args, kwargs, out))
                trace_experts(self, module, args, kwargs)  # its record; its router stays high precision
            return out
        if rms_norm_module_eps(module) is not None and not has_hooks(module) and len(args) == 1 and not kwargs:
            return self._norm_module_call(module, args[0])
        hooked = has_hooks(module)
        if hooked:
            with suspended():
                self._escape((args, kwargs))
        start = len(self.events)
        out = self.call_module(module, args, kwargs)
        with suspended():
            if hooked:
                self._escape(out)
            elif len(self.events) > start:  # ops ran inside: remember what the call returned
                for t in _reachable_tensors(out):
                    if (i := self.tids.get(id(t))) is not None:
                        self.returned[i].append((start, module))
        return out

    def _call_unrecorded(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """The module as written, nothing inside recorded (the run is suspended), named in errors inside."""
        self.stack.append(module)
        try:
            return original_call(module, *args, **kwargs)
        except BaseException:
            self.failed_stack = self.failed_stack or list(self.stack)
            raise
        finally:
            self.stack.pop()

    def _norm_module_call(self, module: nn.Module, x: Any) -> Any:
        """An RMSNorm module written as elementwise ops: one NORM op if it computes F.rms_norm (so it can
        head a fused norm → linear subgraph), else an opaque call. The verdict is kept on the module."""
        with suspended():
            self.stack.append(module)
            try:
                out = original_call(module, x)
            finally:
                self.stack.pop()
            ok = isinstance(x, torch.Tensor) and isinstance(out, torch.Tensor) and out.shape == x.shape
            if ok:
                with onloaded(module):  # accelerate-offloaded: the weight is on meta outside the forward
                    weight = module._parameters["weight"]  # rms_norm_module_eps: an RMSNorm's one parameter
                    assert weight is not None
                    ref = F.rms_norm(x.float(), x.shape[-1:], weight.float(), rms_norm_module_eps(module))
                ok = torch.allclose(out.float(), ref.to(out.device), rtol=1e-4, atol=1e-5)
            tag = tag_of(module)
            if tag is None:  # a module outside the model's tree (e.g. in a plain list): it keeps the verdict too
                tag = module.__dict__[TAG] = ModuleTag(None, owner=False)
            tag.norm = ok
            self._record(NORM if ok else None, module, (x,), {}, out, module if ok else None)
        return out

    def call_module(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        try:
            return super().call_module(module, args, kwargs)
        except BaseException:
            if self.failed_stack is None:  # the innermost frame sees it first: keep its view
                self.failed_stack = [*self.stack, module]
            raise

    def _escape(self, obj: Any) -> None:
        for t in _reachable_tensors(obj):
            self.escaped.add(self.tid(t))

    def finish(self, out: Any) -> Any:
        with suspended():
            self._escape(out)
        return out

    # ------------------------------------------------------------------ after the forward
    def build(self) -> None:
        """Attach states, match subgraphs and tag their ops (called once the forward returned)."""
        self.param_uses.finish([op for st in self.states.values() for op in st.seen_ops])
        if self.record.qconfig.quantize_attention:
            self._softmax_attention_only(self._graph())
        if self.record.qconfig.fuse:
            found = find_subgraphs(self._graph())
            held = self._held_elsewhere([ev.output for _, events in found for ev in events[:-1]])
            if held:  # an intermediate the model kept: it escapes, match again
                self.escaped |= held
                found = find_subgraphs(self._graph())
            for gid, (fusion, events) in enumerate(found):
                kinds = tuple(ev.kind for ev in events if ev.kind is not None)  # a fusion matches kinds
                self.record.subgraphs[gid] = Subgraph(gid, fusion, kinds, self._returned_by(events))
                for step, ev in enumerate(events):
                    if isinstance(ev.op, SeenOp):  # the records this run made
                        ev.op.group = (gid, step)
                        ev.op.fusion = fusion.name
        self.keep.clear()
        self.tids.clear()
        self.record.param_uses = self.param_reads.by_param

    def _softmax_attention_only(self, graph: TraceGraph) -> None:
        """``quantize_attention`` quantizes softmax attention: a matmul between two activations that no softmax
        reads or feeds stays high precision. Linear attention's chunked products (Qwen3-Next's gated delta
        rule) are such matmuls, and its recurrent decode step computes them elementwise: in FP8 they would
        make cached decoding disagree with the full forward the model was calibrated on."""
        owner = {id(op): st for st in self.states.values() for op in st.seen_ops}
        for ev in self.events:
            if ev.quantized(MATMUL) and not graph.near(ev, SOFTMAX, self.producers, _within_attention):
                owner[id(ev.op)].keep_high_precision(cast(SeenOp, ev.op), NOT_SOFTMAX_ATTENTION)

    def _graph(self) -> TraceGraph:
        consumers: dict[int, list[int]] = defaultdict(list)
        for ev in self.events:
            for i in {*ev.arg_ids, *ev.kwarg_ids}:
                if i is not None:
                    consumers[i].append(ev.index)
        return TraceGraph(self.events, dict(consumers), self.escaped, storage=[_storage(t) for t in self.keep])

    def _returned_by(self, events: list[Event]) -> tuple[nn.Module, ...]:
        """The modules whose call started the subgraph (its first op ran inside) and returned one of its
        intermediates, which the caller then dropped: Hugging Face's attention modules return the softmax output
        that the decoder layer ignores, unless ``output_attentions=True`` installed a forward hook that collects
        it. A hook there at convert time must read real values, so the subgraph then runs op by op."""
        head = events[0].index
        found = {id(m): m for ev in events[:-1] if ev.output is not None
                 for start, m in self.returned.get(ev.output, ()) if start <= head}
        return tuple(found.values())

    def _held_elsewhere(self, tids: list[int | None]) -> set[int]:
        """The fused intermediates among ``tids`` that something still holds after the forward returned — a
        module attribute (``self.saved = h``), a list the caller passed in, a global: the caller reads them
        like returned ones (fused, they would be empty placeholders). A reference count above what the trace
        itself holds picks the suspects (a view holds its base too); one heap scan finds who holds them."""
        cands = list({id(self.keep[i]): self.keep[i] for i in tids if i is not None}.values())
        # references from self.keep (an in-place op's output is its input: several)
        ours: defaultdict[int, int] = defaultdict(int)
        for t in self.keep:
            ours[id(t)] += 1
        alone = [torch.empty(0)]
        base = sys.getrefcount(alone[0])  # a tensor held by one list, measured the same way as the candidates
        suspects = [cands[j] for j in range(len(cands)) if sys.getrefcount(cands[j]) - base - ours[id(cands[j])] > 0]
        if not suspects:
            return set()
        index: dict[int, list[int]] = {id(t): [] for t in suspects}
        for i, t in enumerate(self.keep):
            if id(t) in index:
                index[id(t)].append(i)
        held: set[int] = set()
        for holder in gc.get_referrers(*suspects):
            if holder is self.keep or holder is cands or holder is suspects or isinstance(holder, types.FrameType):
                continue
            for obj in gc.get_referents(holder):
                held.update(index.get(id(obj), ()))
        return held


NOT_SOFTMAX_ATTENTION = ("a matmul between two activations outside softmax attention (no softmax reads its output "
                         "or feeds an operand), e.g. linear attention's chunked products: quantize_attention "
                         "quantizes q·kᵀ → softmax → ·v")


def _within_attention(ev: Event) -> bool:
    """Dataflow that can lie between attention's matmuls and its softmax: not another GEMM, norm or module."""
    return ev.kind not in (LINEAR, MATMUL, SDPA, NORM) and not isinstance(ev.func, nn.Module)


def _storage(t: torch.Tensor) -> int | None:
    """Where a tensor's data lives (views of one tensor share it), so that fusion matching sees an in-place
    write through any alias; None where it cannot be told (a tensor subclass without storage)."""
    try:
        return t.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError, TypeError):
        return None


def _mutates(func: Any, kwargs: dict) -> bool:
    """In-place ops (``relu_``, ``+=``, ``x[i] = v``) and ``out=`` calls write into an existing tensor.

    A no-op ``x.to(x.dtype)`` also returns its input object, but writes nothing: identity is no test.
    """
    name = getattr(func, "__name__", "")
    return "out" in kwargs or (name.endswith("_") and not name.startswith("__")) or name == "__setitem__" or (
        name.startswith("__i") and name.endswith("__") and name[3:-2] in _INPLACE_DUNDERS)


_INPLACE_DUNDERS = {"add", "sub", "mul", "truediv", "floordiv", "mod", "pow", "and", "or", "xor", "lshift",
                    "rshift", "matmul"}


def _decide(kind: str, args: tuple, kwargs: dict, qc, module: nn.Module | None, attention: bool
            ) -> tuple[bool, str]:
    """Whether a recorded op runs in FP8, and if not, why."""
    if kind == NORM:
        return False, ""
    if qc.skip:
        return False, "skipped by a QConfig override"
    if kind in (MATMUL, SDPA) and not attention:
        return False, "attention stays in high precision (QConfig(quantize_attention=True) to quantize)"
    values = observed_inputs(kind, args, kwargs)
    if module is not None:
        values["weight"] = linear_weight(module)
    for name, t in values.items():
        if not isinstance(t, torch.Tensor) or not t.is_floating_point():
            return False, f"'{name}' is not a floating-point tensor"
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2, torch.float64):
            return False, f"'{name}' has dtype {t.dtype}"
    if kind == SDPA:
        dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
        if dropout:
            return False, "attention dropout is active (dropout_p > 0)"
    return True, ""


def _detail(kind: str | None, func: Any, args: tuple, kwargs: dict) -> dict:
    """What fusion conditions need to know about a call beyond its kind and tensor ids."""
    if kind == ACT:
        return {"activation": activation_name(func, args, kwargs)}
    if kind == PASSTHROUGH:
        return {"passthrough": is_passthrough(func, args, kwargs)}
    if kind == ADD:
        a, b = (args + (None, None))[:2]
        same = isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
        return {"same_shape": same and a.dtype == b.dtype, "kwargs": tuple(kwargs)}
    if kind in (MUL, DIV):
        other = args[1] if len(args) > 1 else kwargs.get("other")
        return {"scalar_other": isinstance(other, numbers.Number) and not kwargs}
    if kind == SOFTMAX:
        dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
        x = args[0]
        return {"softmax_last_dim": dim is not None and dim in (-1, x.dim() - 1)}
    return {}


def _reachable_tensors(obj: Any) -> list[torch.Tensor]:
    """Every tensor the caller can reach in ``obj``: pytree leaves, and the fields of dataclasses and other
    plain objects among them — pytree does not flatten an unregistered dataclass, and an intermediate
    returned inside one must still count as escaping, or a fusion swallows it (the caller gets a placeholder)."""
    found, seen, todo = [], set(), [obj]
    while todo:
        for leaf in tree_flatten(todo.pop())[0]:
            if isinstance(leaf, torch.Tensor):
                found.append(leaf)
            elif id(leaf) in seen or isinstance(leaf, (nn.Module, type, types.ModuleType, types.FunctionType)):
                continue
            elif dataclasses.is_dataclass(leaf):
                seen.add(id(leaf))
                todo.append([getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)])
            elif isinstance(getattr(leaf, "__dict__", None), dict):
                seen.add(id(leaf))
                todo.append(dict(vars(leaf)))
    return found
