"""The pattern language of fusions: the trace's dataflow (``Event``, ``TraceGraph``), chain patterns over it
(``Step``), the ``Fusion`` base class with its reference semantics, the registry (``register_fusion``) and a
matched instance (``Subgraph``). The built-in fusions and the matching over a trace are in fusions.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from dbr_quant.ops.basic import run_basic
from dbr_quant.ops.call import Call, Env, OpRecord
from dbr_quant.ops.mappings import LINEAR, MATMUL, PASSTHROUGH
from dbr_quant.ops.straight_through import run_straight_through, substitute, wants_gradient


@dataclass
class Event:
    """One call seen during the trace (any torch function, or an nn.Linear module call)."""

    index: int
    kind: str | None
    func: Any
    arg_ids: tuple[int | None, ...]  # trace ids of the positional tensor args (None for non-tensors)
    kwarg_ids: tuple[int, ...]
    output: int | None
    op: OpRecord | None = None
    detail: dict = field(default_factory=dict)
    written: int | None = None  # the tensor an in-place op (``add_``, ``+=``, ``x[i] = v``, ``out=``) writes into

    def quantized(self, kind: str) -> bool:
        return self.kind == kind and self.op is not None and self.op.quantize


@dataclass
class TraceGraph:
    """Dataflow of one traced forward: who consumes each tensor, and which tensors escape."""

    events: list[Event]
    consumers: dict[int, list[int]]
    escaped: set[int]  # returned to the caller, or seen by a module that has hooks
    taken: set[int] = field(default_factory=set)  # events already in a subgraph
    storage: Sequence[int | None] = ()  # trace id → its storage (views share one; None: unknown, may alias any)

    def near(self, start: Event, kind: str, producers: dict[int, int], through: Callable[[Event], bool],
             steps: int = 8) -> bool:
        """Whether an event of ``kind`` reads ``start``'s output or wrote one of its operands, within ``steps``
        events of dataflow that each pass ``through`` (e.g. q·kᵀ → scale → mask → softmax; softmax → cast →
        dropout → p·v)."""
        ahead = [start.output] if start.output is not None else []
        behind = [i for i in (*start.arg_ids, *start.kwarg_ids) if i is not None]
        seen: set[int] = {start.index}
        for _ in range(steps):
            nxt: list[Event] = [self.events[e] for t in ahead for e in self.consumers.get(t, ())]
            prev: list[Event] = [self.events[producers[t]] for t in behind if t in producers]
            if any(ev.kind == kind for ev in (*nxt, *prev)):
                return True
            nxt = [ev for ev in nxt if ev.index not in seen and through(ev)]
            prev = [ev for ev in prev if ev.index not in seen and through(ev)]
            seen.update(ev.index for ev in (*nxt, *prev))
            ahead = [ev.output for ev in nxt if ev.output is not None]
            behind = [i for ev in prev for i in (*ev.arg_ids, *ev.kwarg_ids) if i is not None]
        return False

    def sole_consumer(self, tid: int | None) -> Event | None:
        """The one event that reads ``tid``, if it is free: a consumer taken by an earlier subgraph ends a
        pattern there (an optional tail step is then skipped) instead of failing the whole match."""
        if tid is None or tid in self.escaped:
            return None
        users = self.consumers.get(tid, ())
        return self.events[users[0]] if len(users) == 1 and users[0] not in self.taken else None


@dataclass(frozen=True)
class Step:
    """One op of a chain pattern: its kind, whether it may be absent, and an extra condition."""

    kind: str
    optional: bool = False
    accepts: Callable[[Event, Event | None], bool] = lambda ev, prev: True  # prev: None for the head


class Fusion:
    """Base class: a chain pattern (override ``match`` for non-chains) and a fused ``run``."""

    name: str = ""
    steps: tuple[Step, ...] = ()
    head_readers: int = 1  # how many ops of the subgraph read the head's output (a norm feeding gate and up: 2)

    def match(self, graph: TraceGraph, head: Event) -> list[Event] | None:
        if not _accepts(self.steps[0], head, None):
            return None
        matched, cur, i = [head], head, 1
        while i < len(self.steps):
            nxt = graph.sole_consumer(cur.output)
            while nxt is not None and nxt.kind == PASSTHROUGH and nxt.detail.get("passthrough"):
                matched.append(nxt)
                cur, nxt = nxt, graph.sole_consumer(nxt.output)
            step = self.steps[i]
            if nxt is not None and _accepts(step, nxt, cur):
                matched.append(nxt)
                cur, i = nxt, i + 1
            elif step.optional:
                i += 1
            else:
                return None
        while matched[-1].kind == PASSTHROUGH:
            matched.pop()
        return matched if len(matched) > 1 else None

    def run(self, calls: Sequence[Call], env: Env) -> torch.Tensor:
        """The fused implementation; the default is the reference itself."""
        return self.reference(calls, env)

    @staticmethod
    def reference(calls: Sequence[Call], env: Env) -> torch.Tensor:
        """Run the ops one by one (each quantized op on its own), feeding outputs forward."""
        values: dict[int, torch.Tensor] = {}
        out = None
        for call in calls:
            args = tuple(values.get(id(a), a) for a in call.args)
            kwargs = {k: values.get(id(v), v) for k, v in call.kwargs.items()}
            out = run_basic(Call(call.kind, call.func, args, kwargs, call.op, call.state), env)
            values[id(call.placeholder)] = out
        assert out is not None, "a subgraph has ops"
        return out


    def high_precision(self, calls: Sequence[Call], sub: dict[int, torch.Tensor]) -> torch.Tensor:
        """The ops as the user wrote them, FP8 weights dequantized, with the tensors ``sub`` maps (by id)
        replaced: the reference whose gradient the FP8 subgraph carries when one is wanted (straight_through.py)."""
        values: dict[int, torch.Tensor] = dict(sub)
        out = None
        for call in calls:
            args = tuple(substitute(a, values) for a in call.args)
            kwargs = {k: substitute(v, values) for k, v in call.kwargs.items()}
            out = Call(call.kind, call.func, args, kwargs).run_original()
            values[id(call.placeholder)] = out
        assert out is not None, "a subgraph has ops"
        return out

    def run_with_gradient(self, calls: Sequence[Call], env: Env) -> torch.Tensor:
        """:meth:`run`, with straight-through gradients when the caller wants them (grad mode on and some
        tensor the subgraph reads requires grad)."""
        tensors = wants_gradient(calls)
        if tensors is None:
            return self.run(calls, env)
        return run_straight_through(lambda: self.run(calls, env), lambda sub: self.high_precision(calls, sub),
                                    tensors, lambda: self.describe(calls))

    def describe(self, calls: Sequence[Call]) -> str:
        """The subgraph for messages: the fusion's name and its ops' module paths."""
        return f"the fused {self.name} subgraph (" + ", ".join(c.op.fqn for c in calls if c.op is not None) + ")"


def _accepts(step: Step, ev: Event, prev: Event | None) -> bool:
    if ev.kind != step.kind:
        return False
    if ev.kind in (LINEAR, MATMUL) and (ev.op is None or not ev.op.quantize):
        return False
    if prev is not None and not threads(ev, prev.output):
        return False
    return step.accepts(ev, prev)


def threads(ev: Event, tid: int | None) -> bool:
    """``ev`` reads ``tid`` (the previous op's output) in exactly one of its tensor arguments: in ``y + y``
    or ``y * y`` it is also the other operand, which a fused kernel reads from outside the subgraph."""
    return tid is not None and (*ev.arg_ids, *ev.kwarg_ids).count(tid) == 1


FUSIONS: list[Fusion] = []


def register_fusion(cls: type[Fusion]) -> type[Fusion]:
    """Class decorator: add a fusion to the registry (longest patterns are tried first)."""
    FUSIONS.append(cls())
    FUSIONS.sort(key=lambda f: -len(f.steps))
    return cls


@dataclass
class Subgraph:
    """A matched fusion instance and the kinds of its ops in call order. (Hooks added after convert on a
    module that receives a placeholder need no record here: the module materializes the subgraph. A module that
    *returns* an intermediate is in ``returned_by``: a forward hook there runs the subgraph op by op.)"""

    id: int
    fusion: Fusion
    kinds: tuple[str, ...]
    returned_by: tuple[nn.Module, ...] = ()  # modules whose call started the subgraph and returned an intermediate
