"""The precompiled plan of a converted module: its recorded ops in call order, each with its subgraph
and step resolved, so the runtime's per-op work is an index and two identity-speed comparisons.

A plan holds structure only (records, subgraphs), never tensors: weights and scales are read at call
time, so ``.to()`` / ``.half()`` / ``load_state_dict`` after convert need no invalidation. It is built
the first time a converted forward asks for it and kept on the state (``state.plan``, a plain attribute, not a
submodule or buffer; dropped on deepcopy / pickle); it is rebuilt when the model's subgraph table is a
different object. Records and subgraphs are written only by prepare(), so a plan built after convert stays
right. Building is idempotent, so threads that race to build it store equal plans.

A plan only says what to expect: ``ConvertRun._run_op`` (convert_run.py), the one place the convert run
executes an op, takes the step at the cursor when the arriving op is that step's (kind, fqn), and otherwise
the general matching (``Run.match_position``: a skipped branch, warnings, ``UnseenOpError``).
"""

from __future__ import annotations

from dataclasses import dataclass

from dbr_quant.ops.patterns import Subgraph
from dbr_quant.ops.state import AutoQuantizationState, SeenOp


@dataclass(frozen=True, slots=True)
class PlanStep:
    """One recorded op: what must arrive (kind, fqn) and how it runs (its subgraph, its step there)."""

    kind: str
    fqn: str
    op: SeenOp
    subgraph: Subgraph | None  # None for an op that runs on its own
    step: int  # its position in the subgraph
    last: bool  # whether it completes the subgraph (the fused kernel runs then)


@dataclass(frozen=True, slots=True)
class Plan:
    subgraphs: dict[int, Subgraph]  # the record's subgraph table this plan was built from
    steps: tuple[PlanStep, ...]


def plan_of(st: AutoQuantizationState, subgraphs: dict[int, Subgraph]) -> Plan:
    """Build the plan of ``st``'s recorded ops against the model's subgraph table and cache it on ``st`` (the
    convert run reads the cache, and calls this when it is missing or was built for another table)."""
    steps = []
    for op in st.seen_ops:
        sg = subgraphs.get(op.group[0]) if op.group is not None else None
        if sg is None or op.group is None:
            steps.append(PlanStep(op.kind, op.fqn, op, None, 0, False))
        else:
            step = op.group[1]
            steps.append(PlanStep(op.kind, op.fqn, op, sg, step, step == len(sg.kinds) - 1))
    plan = Plan(subgraphs, tuple(steps))
    st.plan = plan
    return plan
