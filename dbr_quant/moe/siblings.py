"""Experts kept as a ``ModuleList`` / ``ModuleDict`` of MLPs, each called only when the router picks it.

``prepare()``'s example input (one short batch) reaches only some of them (Switch / NLLB-MoE / Mixtral-v1
style, or user code), and an expert the trace never saw has no record: it would stay high precision.
But experts are structurally identical siblings, so what the trace learned from one applies to all:
after the trace, :func:`adopt_untraced_experts` gives every unreached sibling a copy of a reached one's
record (op kinds, fusions, quantization decisions, its own fqns and observers). Calibration then fills
their scales from the tokens routed to them; an expert that got none takes, per activation, the largest
scale among its siblings (:class:`SiblingScales`, reported per op). Each expert is an owner of its own
record, so a later forward routing tokens elsewhere matches nothing by call order and warns about nothing.

Experts that are bare ``nn.Linear`` modules (no MLP module around them) are recorded in their parent's
call order and are not covered: they stay as traced (unreached ones high precision, reported).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch
from torch import nn

from dbr_quant.moe.experts import has_data, observer_of, widest_scale
from dbr_quant.observers import AmaxObserver
from dbr_quant.ops.mappings import is_container
from dbr_quant.ops.state import AutoQuantizationState, SeenOp, observer_key
from dbr_quant.ops.tags import TAG, tag_of
from dbr_quant.qconfig import QConfig


class TracedRecords(Protocol):
    """The trace run's records by module (``runtime.tracer.TraceRun.states``)."""

    states: dict[nn.Module, AutoQuantizationState]


class ModelRecord(Protocol):
    """The prepared model's record (``runtime.runs.ModelRecord``): the settings and the fused subgraphs."""

    @property
    def qconfig(self) -> QConfig: ...

    @property
    def subgraphs(self) -> dict[int, Any]: ...  # id → runtime.runs.Subgraph, a dataclass with an ``id``


class ExpertGroup:
    """The records of one container's sibling experts, each with its module's path inside its expert ("" for the
    expert itself; shared by their :class:`SiblingScales`; not a module)."""

    def __init__(self, fqn: str) -> None:
        self.fqn = fqn
        self.members: list[tuple[str, AutoQuantizationState]] = []

    def join(self, st: AutoQuantizationState, rel: str, traced: bool = True) -> AutoQuantizationState:
        """``st`` becomes a member: its uncalibrated activations fall back on its siblings'."""
        st.scale_fallback = SiblingScales(self, rel, traced)
        self.members.append((rel, st))
        return st


@dataclasses.dataclass(eq=False)
class SiblingScales:
    """The scale rule of a sibling expert's record (``AutoQuantizationState.scale_fallback``, ops/state.py): an
    activation that no calibration token reached in this expert takes the largest scale among its siblings' (reported
    per op)."""

    group: ExpertGroup
    rel: str  # the module's path inside its expert ("" for the expert itself)
    traced: bool = True  # False: a copy of a reached sibling's record (its shapes are the sibling's)
    note = " (and in every sibling expert)"  # an uncalibrated activation was looked for there too

    def _observers(self, key: str) -> list[AmaxObserver]:
        return [observer_of(st, key) for rel, st in self.group.members if rel == self.rel and key in st.observers]

    def calibrated(self, st: AutoQuantizationState, op: SeenOp, slot: str) -> bool:
        return any(o.calibrated for o in self._observers(observer_key(op.index, slot)))

    def scale(self, st: AutoQuantizationState, op: SeenOp, slot: str) -> torch.Tensor | None:
        key = observer_key(op.index, slot)
        if has_data(observer_of(st, key)):
            return None
        # the widest range measured on the siblings clips least on inputs nobody measured
        siblings = self._observers(key)
        donors = [o for o in siblings if has_data(o)] or [o for o in siblings if o.calibrated]
        op.reason = (f"no calibration token reached this expert: its '{slot}' scale is the max over "
                     f"the {len(donors)} calibrated sibling experts of {self.group.fqn}")
        return widest_scale(donors)


def _structure(m: nn.Module) -> tuple:
    return (type(m), tuple((n, type(c)) for n, c in m.named_modules()),
            tuple((n, tuple(p.shape), p.dtype) for n, p in m.named_parameters()))


def _signature(states: dict[str, AutoQuantizationState]) -> tuple:
    """What a member's records say, independent of its name (to check reached siblings agree)."""
    return tuple((rel, tuple((op.kind, op.quantize, op.fusion, op.group[1] if op.group else None, op.slots)
                             for op in st.seen_ops)) for rel, st in sorted(states.items()))


def _path_types(model: nn.Module, fqn: str) -> tuple[type, ...]:
    types, mod = [type(model)], model
    for part in fqn.split(".") if fqn else ():
        mod = mod.get_submodule(part)
        types.append(type(mod))
    return tuple(types)


def adopt_untraced_experts(model: nn.Module, run: TracedRecords, record: ModelRecord) -> None:
    """After the trace: sibling experts the example did not reach get a copy of a reached sibling's record;
    the reached ones' records join the group too (so their scales can fall back on siblings)."""
    states_by_fqn = {st.fqn: (mod, st) for mod, st in run.states.items()}
    weight_owners = {op.weight_owner for st in run.states.values() for op in st.seen_ops if op.weight_owner}
    groups_in = _subgraph_states(run)
    for cfqn, container in model.named_modules():
        children = list(container.named_children())
        if not is_container(container) or len(children) < 2 or not all(c._modules for _, c in children):
            continue  # bare linear experts are recorded in their parent's call order: not covered
        if len({_structure(c) for _, c in children}) != 1:
            continue
        prefix = f"{cfqn}." if cfqn else ""
        members = {name: _member_states(states_by_fqn, prefix + name) for name, _ in children}
        reached = [n for n, sts in members.items() if sts]
        unreached = [n for n in members if not members[n]
                     and not any(o == prefix + n or o.startswith(prefix + n + ".") for o in weight_owners)]
        if not reached or not unreached or len({_signature(members[n]) for n in reached}) != 1:
            continue
        group = ExpertGroup(cfqn)
        for name in reached:
            for rel, st in members[name].items():
                group.join(st, rel)
        template, tname = members[reached[0]], prefix + reached[0]
        for name in unreached:
            _clone_member(model, run, record, group, template, tname, prefix + name, groups_in)
        _order_group(run, group, [prefix + name for name, _ in children])


def _order_group(run: TracedRecords, group: ExpertGroup, member_fqns: list[str]) -> None:
    """Put a group's records together in expert order where its first record was (the report's order)."""
    rank = {fqn: i for i, fqn in enumerate(member_fqns)}

    def key(st: AutoQuantizationState, rel: str) -> tuple[int, str]:
        top = st.fqn[:len(st.fqn) - len(rel) - 1] if rel else st.fqn
        return rank[top], rel

    ours = {id(st): rel for rel, st in group.members}
    items = list(run.states.items())
    members = sorted(((mod, st) for mod, st in items if id(st) in ours),
                     key=lambda item: key(item[1], ours[id(item[1])]))
    run.states.clear()
    for mod, st in items:
        if id(st) not in ours:
            run.states[mod] = st
        elif members:
            run.states.update(members)
            members = []


def _member_states(states_by_fqn: dict, fqn: str) -> dict[str, AutoQuantizationState]:
    """The states of a member expert and of the modules inside it, by path relative to the member."""
    out = {}
    for sfqn, (_, st) in states_by_fqn.items():
        if sfqn == fqn or sfqn.startswith(fqn + "."):
            out[sfqn[len(fqn) + 1:]] = st
    return out


def _subgraph_states(run: TracedRecords) -> dict[int, set[int]]:
    """Subgraph id → ids of the states holding its ops (a subgraph reaching outside an expert is not copied)."""
    out: dict[int, set[int]] = {}
    for st in run.states.values():
        for op in st.seen_ops:
            if op.group is not None:
                out.setdefault(op.group[0], set()).add(id(st))
    return out


def _rename(fqn: str, old: str, new: str) -> str:
    if fqn == old:
        return new
    return new + fqn[len(old):] if fqn.startswith(old + ".") else fqn


def _clone_member(model: nn.Module, run: TracedRecords, record: ModelRecord, group: ExpertGroup,
                  template: dict[str, AutoQuantizationState], tfqn: str, fqn: str,
                  groups_in: dict[int, set[int]]) -> None:
    """Records for the unreached expert ``fqn`` made from the reached expert ``tfqn``'s."""
    member_ids = {id(st) for st in template.values()}
    new_ids: dict[int, int] = {}
    for rel, tst in template.items():
        sfqn = f"{fqn}.{rel}" if rel else fqn
        st = group.join(AutoQuantizationState(sfqn), rel, traced=False)
        ops = []
        for op in tst.seen_ops:
            new_fqn = _rename(op.fqn, tfqn, fqn)
            owner = None if op.weight_owner is None else _rename(op.weight_owner, tfqn, fqn)
            qc = record.qconfig.for_op(new_fqn, _path_types(model, owner or sfqn))
            changed: dict[str, Any] = {}
            if qc != op.qconfig:
                changed = {"qconfig": qc, "group": None, "fusion": None}  # an override: no fusion, own settings
                if qc.skip and op.quantize:
                    changed.update(quantize=False, reason="skipped by a QConfig override", slots=())
            group_id = op.group
            if op.group is not None and "group" not in changed:
                if groups_in.get(op.group[0], set()) <= member_ids:
                    if op.group[0] not in new_ids:
                        sg = record.subgraphs[op.group[0]]
                        new_ids[op.group[0]] = gid = max(record.subgraphs, default=-1) + 1
                        record.subgraphs[gid] = dataclasses.replace(sg, id=gid)
                    group_id = (new_ids[op.group[0]], op.group[1])
                else:
                    changed.update(group=None, fusion=None)  # the subgraph reaches outside the expert
            changed.setdefault("group", group_id)
            ops.append(dataclasses.replace(op, fqn=new_fqn, weight_owner=owner, **changed))
        for op in ops:
            st.add_op(op, _make_observer)
        run.states[model.get_submodule(sfqn)] = st
    # norm modules recognised by value in the reached expert: the same verdict for the sibling's
    for name, mod in model.get_submodule(tfqn).named_modules():
        tag = tag_of(mod)
        if tag is not None and tag.norm is not None:
            target = model.get_submodule(f"{fqn}.{name}" if name else fqn)
            target.__dict__[TAG].norm = tag.norm


def _make_observer(op: SeenOp, slot: str) -> nn.Module:  # expert linears: one scale per tensor for every slot
    cfg = op.qconfig.activation
    return cfg.observer.create(cfg.format, None)

