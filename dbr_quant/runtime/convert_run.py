"""The convert run: what a converted model's forward does with each intercepted call (FP8 kernels, recorded
subgraphs through their fusions, the precompiled plan's fast paths, placeholders). Split from ``runs.py``,
which holds the base ``Run`` and the other phases.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules import module as _hook_globals  # torch's global forward hooks (module_call)
from torch.utils._pytree import tree_map

from dbr_quant.integrations import accelerate as offload
from dbr_quant.integrations.accelerate import has_opaque_hook
from dbr_quant.kernels import graph_ops
from dbr_quant.kernels.autocast import AUTOCAST_KERNELS
from dbr_quant.kernels.dispatch import capture_with
from dbr_quant.ops.basic import autocast_on, run_basic, run_basic_autocast
from dbr_quant.ops.call import Call
from dbr_quant.ops.mappings import (
    ACT,
    FUNC_KINDS,
    INDEXED,
    LINEAR,
    MATMUL,
    NORM,
    PASSTHROUGH,
    call_kind,
    is_device_move,
    is_linear_module,
    is_passthrough,
)
from dbr_quant.ops.patterns import Subgraph
from dbr_quant.ops.tags import TAG, fqn_of, mark_placeholder, tag_of
from dbr_quant.runtime.interception import current_run, has_hooks, suspended
from dbr_quant.runtime.plan import plan_of
from dbr_quant.runtime.runs import HOOKED_BODY_FUNCS, Run

_NO_CONTEXT = contextlib.nullcontext()  # reusable, and entering it does nothing (no per-fusion object)


class _Pending:
    """A subgraph whose ops have arrived so far (made per subgraph run: a plain ``__init__``, cheaper than a
    dataclass's default factory)."""

    __slots__ = ("subgraph", "calls")

    def __init__(self, subgraph: Subgraph) -> None:
        self.subgraph = subgraph
        self.calls: list[Call] = []


class ConvertRun(Run):
    """Executes quantized ops in FP8 and recorded subgraphs through their fusions.

    A subgraph runs when its last op arrives: until then each of its ops returns a placeholder (an
    empty meta tensor) that only the next op of the same subgraph consumes — the trace proved it. If
    anything else touches a placeholder (control flow changed, a hook appeared, it is returned), the
    subgraph is *materialized*: its ops so far run one by one, and the real values replace the
    placeholders.
    """

    def begin(self) -> None:
        if torch._C._is_tracing():  # torch.jit.trace would bake a C / Triton kernel's results in as constants
            raise RuntimeError(
                f"dbr_quant: torch.jit.trace cannot record the converted {type(self.root).__name__}'s FP8 kernels. "
                "Capture a graph with dbr_quant.fx_rewriter.rewrite(model, example_inputs) (then torch.export or "
                "torch.compile it), or run the model eagerly.")
        super().begin()
        self.pending: dict[int, _Pending] = {}
        self.placeholders: dict[int, _Pending] = {}
        self.resolved: dict[int, torch.Tensor] = {}
        self.n_placeholders = placeholder_base(current_run() is None)  # next index into this thread's pool
        self.onloaded: dict[int, nn.Module] = {}  # accelerate-offloaded modules whose weights we loaded
        self.pool = _placeholder_pool()  # this thread's placeholder tensors (grown by _placeholder_tensor)
        self.subgraphs = self.record.subgraphs
        # The context of the run's own torch work (kernels, ops run as written, materializing), made per use:
        # interception suspended when it comes from a module call; nothing from a torch function (function_call
        # swaps it), whose handler runs with this run's mode already off and must leave torch-function modes below
        # it (torch.export's) on. A class, not a method: entering it costs no Python frame.
        self.torch_work: Callable[[], AbstractContextManager[None]] = suspended
        # under torch.autocast every FP8 kernel runs with autocast off and its result takes the dtype autocast
        # gives the op it replaces (kernels/autocast.py: the rule the rewritten graph's ops follow too)
        self.autocast = autocast_on()
        self.execute = run_basic_autocast if self.autocast else run_basic
        # a fused subgraph's kernels follow that rule one by one, as the graph's ops do (while a graph is captured
        # its ops carry the rule themselves)
        self.autocast_kernels = self.autocast and graph_ops() is None

    # ------------------------------------------------------------------ placeholders
    def _scan(self, args: tuple, kwargs: dict) -> tuple[tuple, dict, _Pending | None]:
        """Swap resolved placeholders for values; return the pending subgraph an argument belongs to. (A recorded
        op's one input, the common case, is looked up in ``_run_op`` itself.)"""
        hit: _Pending | None = None
        seen: list[int] = []  # the placeholders read, to catch one read twice

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
                    seen.append(key)
            elif isinstance(a, (list, tuple)) and a and any(isinstance(x, torch.Tensor) for x in a):
                return type(a)(fix(x) for x in a) if not hasattr(a, "_fields") else a
            return a

        args = tuple(fix(a) for a in args)
        kwargs = {k: fix(v) for k, v in kwargs.items()} if kwargs else kwargs
        if hit is not None and len(seen) > 1 and (len(set(seen)) < len(seen) or _read_before(hit, seen)):
            # `y + y` or `fc2(relu(h)) + h` where the trace saw `y + r`: a fused run would take a placeholder
            # for the residual; the ops so far run one by one instead and this call sees values
            self.materialize(hit)
            return self._scan(args, kwargs)
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
        with self.torch_work():
            for call in p.calls:
                self.placeholders.pop(id(call.placeholder), None)
                args = tuple(self.resolved.get(id(a), a) if isinstance(a, torch.Tensor) else a for a in call.args)
                out = self.execute(Call(call.kind, call.func, args, call.kwargs, call.op, call.state), self)
                self.resolved[id(call.placeholder)] = out

    def _step(self, p: _Pending, call: Call, last: bool) -> torch.Tensor:
        """Add ``call`` to its subgraph: run the fusion if it completes it (``last``: the caller knows, from the
        plan or the subgraph's kinds), else return a placeholder (the next free tensor of this thread's pool;
        no torch call, so nothing to suspend)."""
        if not last:
            n = self.n_placeholders
            pool = self.pool
            ph = pool[n] if n < len(pool) else _placeholder_tensor(n)
            self.n_placeholders = n + 1
            call.placeholder = ph
            p.calls.append(call)
            self.placeholders[id(ph)] = p
            return ph
        p.calls.append(call)
        self.pending.pop(p.subgraph.id, None)
        for c in p.calls[:-1]:
            self.placeholders.pop(id(c.placeholder), None)
        fusion = p.subgraph.fusion
        with self.torch_work(), capture_with(AUTOCAST_KERNELS) if self.autocast_kernels else _NO_CONTEXT:
            try:
                return fusion.run_with_gradient(p.calls, self) if _is_grad_enabled() else fusion.run(p.calls, self)
            except TypeError as e:  # inside `a + b` Python would turn a TypeError into a bare NotImplemented
                raise RuntimeError(f"dbr_quant: {fusion.describe(p.calls)} failed: {type(e).__name__}: {e}") from e

    # ------------------------------------------------------------------ the plan
    def _run_op(self, kind: str, func: Any, args: tuple, kwargs: dict, fqn: str | None, warn: bool = True) -> Any:
        """Run a recorded kind of op arriving in the innermost owner's module: a torch function, or a module
        (``fqn``: its own name; None names the op after the innermost named module). The owner's plan (plan.py)
        says what it is: the step at the cursor when this is the op the plan expects (two comparisons), else
        what :meth:`Run.next_op`'s matching finds (a branch not taken this time). The step joins or starts its
        subgraph, or runs on its own in FP8; a subgraph that cannot go on as traced (ops out of order, another
        subgraph's output read) is materialized first. An op the trace never saw runs as written (warned
        about, or ``UnseenOpError`` when strict). This is the one place the convert run executes an op."""
        if not args and len(kwargs) == 1:  # `linear(input=x)`: executors read an op's one input positionally
            args, kwargs = tuple(kwargs.values()), {}
        hit = None
        if self.placeholders or self.resolved:
            if len(args) == 1 and not kwargs:  # one input (a linear module's): two lookups, no walk
                key = id(args[0])  # ids of live placeholders and resolved ones only: any object may be looked up
                value = self.resolved.get(key)
                if value is not None:
                    args = (value,)
                else:
                    hit = self.placeholders.get(key)
            else:
                args, kwargs, hit = self._scan(args, kwargs)
        if fqn is None:
            fqn = self.op_fqn(kind)
        st = self.owners[-1]
        step = None
        if st is not None:
            plan = st.plan
            if plan is None or plan.subgraphs is not self.subgraphs:
                plan = plan_of(st, self.subgraphs)
            steps = plan.steps
            key = id(st)
            i = self.cursors.get(key, 0)
            if i < len(steps) and (step := steps[i]).kind == kind and step.fqn == fqn:  # == on one str: identity
                self.cursors[key] = i + 1
            else:
                j = self.match_position(st, kind, fqn, warn)
                step = steps[j] if j >= 0 else None
        if step is None:
            if hit is not None:
                args, kwargs = self._resolve_all(args, kwargs, hit)
            with self.torch_work():
                return Call(kind, func, args, kwargs).run_original()
        call = Call(kind, func, args, kwargs, step.op, st)
        sg = step.subgraph
        if sg is not None and not (sg.returned_by and _hook_reads_returned(sg)):
            p = self.pending.get(sg.id)
            if step.step == 0:
                if p is not None:
                    self.materialize(p)
                if hit is not None:
                    call.args, call.kwargs = self._resolve_all(args, kwargs, hit)
                p = self.pending[sg.id] = _Pending(sg)
                return self._step(p, call, step.last)
            if p is not None and len(p.calls) == step.step and (hit is None or hit is p):
                return self._step(p, call, step.last)
            if p is not None:
                self.materialize(p)
        if hit is not None:
            call.args, call.kwargs = self._resolve_all(args, kwargs, hit)
        with self.torch_work():
            return self.execute(call, self)

    def function_call(self, func, args, kwargs):
        if self.hooked and func in HOOKED_BODY_FUNCS:
            out = self.hooked_body(func, args, kwargs)
            if out is not NotImplemented:
                return out
        kind = FUNC_KINDS.get(func)
        if kind == MATMUL:  # x @ W of a parameter W is a linear (mappings.call_kind; placeholders are no weights)
            kind = call_kind(func, args, kwargs)
        if kind not in INDEXED and not (self.placeholders or self.resolved):
            return func(*args, **kwargs)
        before, self.torch_work = self.torch_work, contextlib.nullcontext  # torch work runs as the function would
        try:
            if kind in INDEXED:
                return self._run_op(kind, func, args, kwargs, None, self.warns(kind))
            if func is torch.Tensor.to and id(args[0]) in self.placeholders and self._moves_nothing(args, kwargs):
                return args[0]
            args, kwargs, hit = self._scan(args, kwargs)
            if hit is not None:
                kinds, n = hit.subgraph.kinds, len(hit.calls)
                expected = n < len(kinds) and kinds[n] == kind
                if expected and (kind != PASSTHROUGH or is_passthrough(func, args, kwargs)):  # train-mode dropout
                    return self._step(hit, Call(kind, func, args, kwargs), n + 1 == len(kinds))
                args, kwargs = self._resolve_all(args, kwargs, hit)
            return func(*args, **kwargs)
        finally:
            self.torch_work = before

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
        if role is _PLAIN:
            tag = d.get(TAG)
            if "_hf_hook" not in d and (tag is None or (tag.experts is None and not tag.norm)) \
                    and not ((self.placeholders or self.resolved) and has_hooks(module)):
                return self.call_module(module, args, kwargs)  # the common case, decided by a few dict lookups
        elif not (module._forward_hooks or module._forward_pre_hooks or _hook_globals._global_forward_hooks
                  or _hook_globals._global_forward_pre_hooks):
            # a stock nn.Linear or an activation module that no hook observes, its own or a global one (decided
            # per class, then by a few lookups: has_global_hooks() inlined, as torch's _call_impl reads them)
            if role is _LINEAR:
                if "_hf_hook" not in d and "weight" in module._parameters:  # see mappings.is_linear_module
                    tag = d.get(TAG)
                    return self._run_op(LINEAR, module, args, kwargs, tag.fqn if tag is not None else None)
            elif role is _ACT and len(args) == 1 and not kwargs and (
                    "_hf_hook" not in d or not has_opaque_hook(module)):  # accelerate's device hooks: transparent
                # its forward is one F.relu / F.gelu / F.silu: take the step that call would take, without
                # the module call and the torch-function trip: compute it on real input, or join the pending
                # subgraph its input is a placeholder of; else (a resolved placeholder, a subgraph that
                # expects another op) the module runs its forward
                func, name, default, plain = ACTIVATION_MODULES[type(module)]
                value = getattr(module, name)
                x = args[0]
                p = self.placeholders.get(id(x))
                if p is None:
                    if not self.resolved:
                        with suspended():
                            return plain(x) if value == default else func(x, **{name: value})
                else:
                    kinds, n = p.subgraph.kinds, len(p.calls)
                    if n < len(kinds) and kinds[n] == ACT:
                        kw = _NO_KWARGS if value == default else {name: value}  # a dict only when not the default
                        return self._step(p, Call(ACT, func, args, kw), n + 1 == len(kinds))
                return self.call_module(module, args, kwargs)
        if "_hf_hook" in d and (is_linear_module(module) or ((tag := d.get(TAG)) is not None and tag.norm)) \
                and not has_hooks(module):
            # accelerate loads weights in the forward wrapper that the FP8 path bypasses (integrations/accelerate.py):
            # load them here and keep them until no pending fused subgraph can still read them
            args, kwargs = offload.onload(module, args, kwargs)
            self.onloaded[id(module)] = module
            try:
                return self._module_call(module, args, kwargs)
            finally:
                if not self.pending:
                    self._offload()
        return self._module_call(module, args, kwargs)

    def _offload(self) -> None:
        while self.onloaded:
            offload.offload(self.onloaded.popitem()[1])

    def _module_call(self, module, args, kwargs):
        if is_linear_module(module):
            if has_hooks(module):
                return self._hooked_linear_call(module, args, kwargs)
            return self._run_op(LINEAR, module, args, kwargs, fqn_of(module))
        tag = tag_of(module)
        if tag is not None and tag.experts is not None:  # MoE experts module, called as one op: moe/
            if self.placeholders or self.resolved:  # a pending subgraph's output feeds it: finish that first
                with suspended():
                    args, kwargs = self._resolve_all(*self._scan(args, kwargs))
            return self.experts_call(module, args, kwargs, "convert")
        if tag is not None and tag.norm and not has_hooks(module) and len(args) == 1 and not kwargs:
            with suspended():
                return self._norm_module_call(module, args)
        if (self.placeholders or self.resolved) and has_hooks(module):
            with suspended():
                args, kwargs, hit = self._scan(args, kwargs)
                args, kwargs = self._resolve_all(args, kwargs, hit)
        return self.call_module(module, args, kwargs)

    def _norm_module_call(self, module: nn.Module, args: tuple) -> Any:
        """A recognised RMSNorm module: a NORM op, possibly the head of a fused subgraph."""
        return self._run_op(NORM, module, args, {}, fqn_of(module), False)

    def _hooked_linear_call(self, module: nn.Module, args: tuple, kwargs: dict) -> Any:
        """Hooks must see real tensors: no fusion, the stock __call__ runs them around our FP8 op."""
        with suspended():
            if self.placeholders or self.resolved:
                args, kwargs = self._resolve_all(*self._scan(args, kwargs))
            op = self.next_op(st := self.owner_state(), LINEAR, self.op_fqn(LINEAR, module))
        return self.call_hooked(module, lambda x: self.execute(Call(LINEAR, module, (x,), {}, op, st), self), args,
                                kwargs)

    def finish(self, out: Any) -> Any:
        for p in list(self.pending.values()):
            self.materialize(p)
        self._offload()
        if self.resolved:
            out = tree_map(lambda t: self.resolved.get(id(t), t) if isinstance(t, torch.Tensor) else t, out)
        return out


def _hook_reads_returned(sg: Subgraph) -> bool:
    """Whether a forward hook (``output_attentions=True``'s output recorder in transformers 5) will read an
    intermediate of ``sg`` that a module returns: fused, the hook would get an empty placeholder, so the
    subgraph's ops run one by one (each in FP8 as recorded)."""
    return any(has_hooks(m) for m in sg.returned_by)


def _read_before(p: _Pending, keys: list[int]) -> bool:
    """Whether an op of ``p`` already read one of these placeholders (each is read once, by the next op)."""
    return any(isinstance(a, torch.Tensor) and id(a) in keys for c in p.calls for a in c.args)


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
_is_grad_enabled = torch._C.is_grad_enabled


def _placeholder_tensor(i: int) -> torch.Tensor:
    """The i-th placeholder of this thread's pool: an empty meta tensor marked as a placeholder. Runs of
    one thread nest (a prepared model called inside another's forward), so each run takes indices above
    those of the runs it is nested in (``placeholder_base``): identities stay unique among live runs."""
    tensors = _placeholder_pool()
    if len(tensors) <= i:
        with suspended():  # not a call of the model's
            while len(tensors) <= i:
                tensors.append(mark_placeholder(torch.empty(0, device="meta")))
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


# activation modules whose forward is one functional call: (module class) → (function, the keyword argument
# it takes from the module's attribute of the same name, that argument's default: then it is not passed, the
# C function that the functional call runs then when no torch function is overridden, as inside `suspended`:
# torch/nn/functional.py's relu and silu bodies, past their has_torch_function check; F.gelu is that C function)
ACTIVATION_MODULES: dict[type[nn.Module], tuple[Callable[..., torch.Tensor], str, object,
                                                Callable[[torch.Tensor], torch.Tensor]]] = {
    nn.ReLU: (F.relu, "inplace", False, torch.relu),
    nn.GELU: (F.gelu, "approximate", "none", F.gelu),
    nn.SiLU: (F.silu, "inplace", False, torch._C._nn.silu),
}
_NO_KWARGS: dict[str, Any] = {}  # the keyword arguments of an activation module's call at its defaults (never written)
