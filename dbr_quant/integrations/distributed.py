"""Data-parallel calibration: merge every observer's state (and the GPTQ Hessians, ``sync_hessians``) across a
``torch.distributed`` process group.

Each rank calibrates its own batches. ``sync_observers`` (which ``convert`` calls when torch.distributed is
initialized) leaves every rank with the observers one process would hold after calibrating the union of all
ranks' batches; how each observer kind merges, and which merges are exact, is in ``observers/amax.py``.

The protocol is the same sequence of collectives on every rank, and every decision is taken on gathered
data, so a problem on one rank is the same error on every rank — never a hang:

1. ``all_gather_object`` of a summary per rank: a local problem (not a prepared model), a hash of the
   observer layout (ops, kinds, observer settings), each observer's update and channel counts, a digest
   of the state, whether it was synced before.
2. Only if the layouts differ: ``all_gather_object`` of the layouts, to name the first difference.
3. ``all_gather`` of all observer state packed into one float64 vector (counts are exact in float64);
   every rank merges the same vectors in the same order, so the scales are bitwise identical everywhere.
"""

from __future__ import annotations

import hashlib
from typing import Any

import torch
from torch import nn

from dbr_quant.observers import AmaxObserver
from dbr_quant.ops.state import observer_key
from dbr_quant.runtime.hessians import HessianCollector

__all__ = ["sync_observers", "sync_hessians", "SyncError"]

_SETTINGS = ("momentum", "history_len", "algo", "margin", "percentile", "num_candidates", "min_ratio")
_SHOWN = 8  # problems listed per error message


class SyncError(RuntimeError):
    """The ranks' observers cannot be merged: a rank prepared a different model, saw no batch for an op, or
    calibrated again after a sync. Raised on every rank of the group."""


def _distributed(group: Any) -> bool:
    dist = torch.distributed
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _observers(prepared: nn.Module) -> tuple[str, list[tuple[str, AmaxObserver]]]:
    """(local problem or "", [(op description, observer)]) in the record's order."""
    record = prepared.__dict__.get("_dbr_record") if isinstance(prepared, nn.Module) else None
    if record is None:
        return f"got a {type(prepared).__name__}, not a model returned by dbr_quant.prepare()", []
    if record.phase != "prepared":
        return f"the model is {record.phase}; observers are merged before convert()", []
    out = []
    for st in record.states:
        slots = {observer_key(op.index, slot): (op, slot) for op in st.seen_ops for slot in op.slots}
        for key, obs in st.observers.items():
            op, slot = slots.get(key, (None, key))
            out.append((f"{op.fqn} ({op.kind} input '{slot}')" if op else f"{st.fqn or '<root>'}.{key}", obs))
    return "", out


def _describe(name: str, obs: AmaxObserver) -> str:
    settings = "".join(f", {k}={getattr(obs, k)!r}" for k in _SETTINGS if hasattr(obs, k))
    return f"{name}: {type(obs).__name__}({obs.fmt.value}, axis={obs.axis}{settings})"


def _state(obs: AmaxObserver) -> list[tuple[str, torch.Tensor]]:
    """An observer's buffers in registration order (an observer registers no None buffer)."""
    return [(name, buf) for name, buf in obs._buffers.items() if buf is not None]


def _flat(observers: list[tuple[str, AmaxObserver]]) -> torch.Tensor:
    parts = [buf.detach().reshape(-1).to("cpu", torch.float64) for _, obs in observers for _, buf in _state(obs)]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float64)


def _summary(problem: str, observers: list[tuple[str, AmaxObserver]]) -> dict[str, Any]:
    layout = "\n".join(_describe(name, obs) for name, obs in observers)
    return {
        "problem": problem,
        "layout": hashlib.sha256(layout.encode()).hexdigest(),
        "count": len(observers),
        "updates": [int(obs.num_updates.item()) for _, obs in observers],
        "channels": [obs.num_channels for _, obs in observers],
        "digest": hashlib.sha256(_flat(observers).numpy().tobytes()).hexdigest(),
        "synced": any(obs.synced for _, obs in observers),
    }


def _gather_object(obj: Any, group: Any) -> list[Any]:
    out: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def _layout_error(layouts: list[list[str]]) -> SyncError:
    lines = []
    for rank, layout in enumerate(layouts[1:], start=1):
        if layout == layouts[0]:
            continue
        i = next((i for i, (a, b) in enumerate(zip(layouts[0], layout)) if a != b), min(len(layouts[0]), len(layout)))
        ours = layouts[0][i] if i < len(layouts[0]) else "<no more observers>"
        theirs = layout[i] if i < len(layout) else "<no more observers>"
        lines.append(f"rank {rank} has {len(layout)} observers, rank 0 {len(layouts[0])}; first difference at "
                     f"observer {i}: rank 0 '{ours}', rank {rank} '{theirs}'")
    return SyncError("dbr_quant.sync_observers(): the ranks calibrated different models:\n  " + "\n  ".join(lines)
                     + "\nEvery rank must prepare the same model with the same QConfig and example inputs.")


def _missing_error(names: list[str], summaries: list[dict[str, Any]], missing: list[int]) -> SyncError:
    lines = [f"{names[i]}: no batch on rank(s) {[r for r, s in enumerate(summaries) if s['updates'][i] == 0]}"
             for i in missing[:_SHOWN]]
    more = f"\n  … and {len(missing) - _SHOWN} more" if len(missing) > _SHOWN else ""
    return SyncError(
        f"dbr_quant.sync_observers(): {len(missing)} observed activation(s) saw no calibration batch on some "
        "ranks:\n  " + "\n  ".join(lines) + more + "\nGive every rank batches that reach every op (a rank with no "
        "batches at all shows up on every op), or call dbr_quant.sync_observers(prepared, allow_missing=True) "
        "before convert() to merge each op from the ranks that saw it.")


def sync_observers(prepared: nn.Module, group: Any = None, *, allow_missing: bool = False) -> nn.Module:
    """Merge the observers of a prepared model across the ranks of ``group`` (default: the default group).

    Every rank must call it (``convert`` does, when torch.distributed is initialized). Afterwards every rank
    holds what one process calibrating the union of all ranks' batches would hold; scales are identical on
    all ranks. Without torch.distributed, or with one rank, it does nothing. Ranks whose observer states are
    already identical (synced before, or loaded from one checkpoint) are left as they are.

    Raises ``SyncError`` on every rank when a rank prepared a different model (a different observer layout),
    when an op was observed on some ranks but not on others (unless ``allow_missing=True``: then it merges
    from the ranks that saw it), or when a rank calibrated again after a sync (the merge would count the
    synced batches once per rank).
    """
    if not _distributed(group):
        return prepared
    problem, observers = _observers(prepared)
    summaries = _gather_object(_summary(problem, observers), group)
    problems = [f"rank {r}: {s['problem']}" for r, s in enumerate(summaries) if s["problem"]]
    if problems:
        raise SyncError("dbr_quant.sync_observers(): " + "; ".join(problems))
    if any(s["layout"] != summaries[0]["layout"] for s in summaries):
        raise _layout_error(_gather_object([_describe(n, o) for n, o in observers], group))
    if all(s["digest"] == summaries[0]["digest"] for s in summaries):
        return prepared  # already identical everywhere: merging copies of one state would count it again
    if any(s["synced"] for s in summaries):
        raise SyncError("dbr_quant.sync_observers(): some rank calibrated again after its observers were synced; "
                        "merging now would count the synced batches once per rank. Calibrate every batch before "
                        "the first sync (or prepare the model again).")
    names = [name for name, _ in observers]
    missing = [i for i in range(len(observers))
               if 0 < sum(s["updates"][i] == 0 for s in summaries) < len(summaries)]
    if missing and not allow_missing:
        raise _missing_error(names, summaries, missing)
    for i, (name, obs) in enumerate(observers):
        if obs.per_channel:
            sizes = {s["channels"][i] for s in summaries} - {0}
            if len(sizes) > 1:
                raise SyncError(f"dbr_quant.sync_observers(): {name} has {sorted(sizes)} channels on different "
                                "ranks; every rank must prepare the same model")
            if sizes and obs.num_channels == 0:
                obs._resize_channels(sizes.pop())  # no batch here: an empty state of the right size
    flat = _flat(observers)
    backend = torch.distributed.get_backend(group)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    gathered = [torch.empty_like(flat, device=device) for _ in summaries]
    torch.distributed.all_gather(gathered, flat.to(device), group=group)
    gathered = [g.cpu() for g in gathered]
    offset = 0
    for _, obs in observers:
        states: list[dict[str, torch.Tensor]] = [{} for _ in gathered]
        for buf_name, buf in _state(obs):
            for state, g in zip(states, gathered, strict=True):
                state[buf_name] = g[offset: offset + buf.numel()].reshape(buf.shape)
            offset += buf.numel()
        obs.merge(states)
        obs.synced = True
    return prepared


def sync_hessians(prepared: torch.nn.Module, group: Any = None) -> None:
    """Data-parallel calibration: sum every GPTQ accumulator's folds (and token counts) across the ranks of
    ``group``, so each rank rounds with the Hessians of all ranks' batches and stores the same weights.
    ``convert`` calls it after ``sync_observers``; a no-op without torch.distributed, with one rank, without
    GPTQ linears, or when already summed. Raises ``SyncError`` on every rank when the ranks collected for
    different linears, or some rank calibrated again after a sum (its batches would count once per rank)."""
    record = prepared.__dict__.get("_dbr_record") if isinstance(prepared, torch.nn.Module) else None
    collector = getattr(record, "hessians", None)
    if not isinstance(collector, HessianCollector) or not _distributed(group):
        return
    layout = sorted((fqn, acc.in_features, acc.folds) for fqn, acc in collector.accumulators.items())
    states = _gather_object({"layout": layout, "synced": collector.synced_at is not None,
                             "again": collector.synced_at not in (None, collector.forwards)}, group)
    if any(s["again"] for s in states) or len({s["synced"] for s in states}) > 1:
        raise SyncError("dbr_quant.convert(): a rank calibrated again after the GPTQ Hessians were summed across "
                        "ranks; summing again would count the earlier batches once per rank. Prepare again.")
    if all(s["synced"] for s in states):
        return
    for rank, s in enumerate(states):
        if s["layout"] != layout:
            mine, theirs = {e[0] for e in layout}, {e[0] for e in s["layout"]}
            raise SyncError(f"dbr_quant.convert(): GPTQ Hessians differ between ranks: rank {rank} collected for "
                            f"{sorted(theirs - mine)[:5]} but not {sorted(mine - theirs)[:5]} (or other shapes); "
                            "every rank must calibrate batches that reach the same linears")
    for fqn, _, _ in layout:
        acc = collector.accumulators[fqn]
        torch.distributed.all_reduce(acc.sums, group=group)
        tokens = acc.tokens.to(acc.sums.device)
        torch.distributed.all_reduce(tokens, group=group)
        acc.tokens.copy_(tokens.cpu())
    collector.synced_at = collector.forwards
