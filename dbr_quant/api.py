"""Public API: prepare → calibrate → convert, ``disabled()`` and ``report``."""

from __future__ import annotations

import copy
import functools
import inspect
import warnings
from collections.abc import Callable, Iterable, Mapping, Sized
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from dbr_quant.integrations import accelerate as offload
from dbr_quant.integrations.distributed import sync_hessians, sync_observers
from dbr_quant.moe import experts as moe
from dbr_quant.moe import siblings as moe_siblings
from dbr_quant.moe import weights as moe_weights
from dbr_quant.ops.gate_up import stack_gate_up_weights
from dbr_quant.ops.mappings import LINEAR, QUANTIZEABLE, is_container, is_transposed_linear, linear_weight
from dbr_quant.ops.state import AutoQuantizationState, UncalibratedError
from dbr_quant.ops.tags import TAG, ModuleTag, fqn_of
from dbr_quant.qconfig import QConfig
from dbr_quant.quantize.weight_quantization import all_finite, quantize_weight
from dbr_quant.quantize.weights import attach_fp8_weight, fp8_weight_of
from dbr_quant.runtime import hessians as collect
from dbr_quant.runtime import precision
from dbr_quant.runtime.convert_run import ConvertRun
from dbr_quant.runtime.interception import FAST_PATH_MODULES, current_run, disabled, intercepting, is_disabled
from dbr_quant.runtime.param_weights import quantize_param_weights
from dbr_quant.runtime.runs import CalibrateRun, HighPrecisionRun, InspectRun, ModelRecord, state_of
from dbr_quant.runtime.tracer import TraceRun

__all__ = ["prepare", "calibrate", "convert", "disabled", "report", "PrepareError"]


class PrepareError(RuntimeError):
    """The model's forward failed while prepare() traced it."""


def _entry_forward(root: nn.Module, m: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Installed (via functools.partial) as ``forward`` of the root module and of every submodule that has
    children: a call from outside a run of this model runs inside a run of the model's current phase —
    the root's forward, or a submodule called on its own (``generate()`` calls an encoder-decoder's
    encoder directly). Inside a run of this model a submodule's wrapper is just its own forward.

    An instance attribute rather than a hook, so that one ``try/finally`` encloses the whole forward and
    global state is restored on every exit path, KeyboardInterrupt included. A partial, not a class,
    because torch.export reads ``forward.func.__code__``.
    """
    if torch.compiler.is_dynamo_compiling() and _EAGER_ENTRY:  # torch.compile(model): the run itself stays eager
        return _EAGER_ENTRY[0](root, m, *args, **kwargs)
    record: ModelRecord = root.__dict__["_dbr_record"]
    # an instance forward that was there before prepare (accelerate's device/offload wrapper) keeps running
    forward = m.__dict__[TAG].inner_forward or type(m).forward.__get__(m)
    if m is not root:
        active = current_run()
        if record.phase == "tracing" or (active is not None and active.record is record):
            return forward(*args, **kwargs)
    if not _EAGER_ENTRY:  # a model unpickled in a new process: no entry forward was installed in this one
        _make_eager_entry()
    run: TraceRun | HighPrecisionRun | InspectRun | CalibrateRun | ConvertRun
    if record.phase == "tracing":
        assert isinstance(record.trace_run, TraceRun), "prepare() sets the trace run before its traced forward"
        run = record.trace_run
    elif is_disabled():
        if record.phase == "prepared":
            return forward(*args, **kwargs)
        run = HighPrecisionRun(root, record)
    elif record.inspector is not None:
        run = InspectRun(root, record, record.inspector)
    elif record.phase == "prepared":
        # observers are state shared by every caller: concurrent calibration forwards take turns
        run = CalibrateRun(root, record)
        with record.calibration_lock, intercepting(run, functions=record.observes_functions):
            return run.finish(forward(*args, **kwargs) if m is root else run.module_call(m, args, kwargs))
    else:
        run = ConvertRun(root, record)
    run.begin()
    with intercepting(run):
        if m is root:
            return run.finish(forward(*args, **kwargs))
        return run.finish(run.module_call(m, args, kwargs))  # m owns its records: no need of its parents


# torch.compile of a prepared / converted model as it is: Dynamo does not trace into the run (interception, C
# kernels), which runs eagerly between the compiled parts, so the outputs are the eager model's bit for bit. Under
# fullgraph=True (Hugging Face's generate() compiles a static-cache decode so, by default on GPUs) Dynamo raises
# with this reason rather than an error deep inside the runtime. Made when the first entry forward is installed
# or runs, not at import: torch.compiler.disable imports torch._dynamo, and with it triton, which a CPU user never
# needs. (A model unpickled in a new process and compiled before any eager call is traced as before this existed.)
_EAGER_ENTRY: list[Callable[..., Any]] = []
_EAGER_REASON = ("dbr_quant: a prepared / converted model runs its FP8 ops eagerly, which fullgraph=True cannot "
                 "capture: capture a graph with dbr_quant.fx_rewriter.rewrite(model, example_inputs) and compile "
                 "that, or compile with fullgraph=False (generate(): compile_config=CompileConfig(fullgraph=False), "
                 "or disable_compile=True)")


def _make_eager_entry() -> None:
    _EAGER_ENTRY.append(torch.compiler.disable(_entry_forward, reason=_EAGER_REASON))


def _install_entry_forward(root: nn.Module, m: nn.Module) -> None:
    if not _EAGER_ENTRY:
        _make_eager_entry()
    tag: ModuleTag = m.__dict__[TAG]
    if "forward" in m.__dict__:
        tag.inner_forward = m.__dict__["forward"]
    tag.entry_forward = wrapper = functools.partial(_entry_forward, root, m)  # runs.Run.call_module skips it
    # what users and HF introspect (inspect.signature reads it; typeshed's partial does not declare it)
    wrapper.__signature__ = inspect.signature(type(m).forward.__get__(m))  # type: ignore[attr-defined]
    m.__dict__["forward"] = wrapper


def _is_entry_forward(obj: Any) -> bool:
    return isinstance(obj, functools.partial) and obj.func is _entry_forward


def _as_args(example_inputs: Any) -> tuple:
    if isinstance(example_inputs, tuple):
        return example_inputs
    if isinstance(example_inputs, list):
        return tuple(example_inputs)
    return (example_inputs,)


def _record(model: nn.Module, want: str, fn: str) -> ModelRecord:
    record = model.__dict__.get("_dbr_record") if isinstance(model, nn.Module) else None
    if record is None:
        raise TypeError(f"dbr_quant.{fn}() needs a model returned by dbr_quant.prepare(); got {type(model).__name__}")
    if record.phase != want:
        raise RuntimeError(f"dbr_quant.{fn}() needs a {want} model, but this one is {record.phase}")
    return record


def prepare(
    model: nn.Module,
    example_inputs: Any = (),
    qconfig: QConfig | None = None,
    *,
    example_kwargs: Mapping[str, Any] | None = None,
    inplace: bool = False,
) -> nn.Module:
    """Trace ``model`` once on the example inputs and attach quantization state to it.

    Returns a copy (the original is untouched) unless ``inplace=True``. Every later forward of the
    returned model calibrates its observers until :func:`convert`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"dbr_quant.prepare() takes an nn.Module, got {type(model).__name__}")
    if "_dbr_record" in model.__dict__:
        raise RuntimeError("this model was already prepared by dbr_quant; prepare the original model instead")
    qconfig = QConfig() if qconfig is None else qconfig
    if not isinstance(qconfig, QConfig):
        raise TypeError(f"qconfig must be a dbr_quant.QConfig, got {type(qconfig).__name__}")
    args, kwargs = _as_args(example_inputs), dict(example_kwargs or {})
    m = model if inplace else _copy(model)
    for name, mod in m.named_modules():
        mod.__dict__[TAG] = ModuleTag(name, owner=mod is m or bool(mod._modules))
    moe.mark_experts(m)  # MoE experts modules with 3-D weights run as one op (moe/)
    record = ModelRecord(qconfig, example=(args, kwargs))
    record.trace_run = run = TraceRun(m, record)
    m.__dict__["_dbr_record"] = record
    for mod in m.modules():
        if mod is m or mod._modules:
            _install_entry_forward(m, mod)
    try:
        with torch.no_grad():
            m(*args, **kwargs)
    except Exception as e:
        failed = (run.failed_stack or run.stack)[1:]
        where = " > ".join(fqn_of(mod) or type(mod).__name__ for mod in failed)
        op = getattr(run.current, "__name__", None)
        _undo_prepare(m)
        raise PrepareError(
            f"prepare(): the model's forward raised {type(e).__name__} while tracing "
            f"{'in module ' + where if where else 'at the top level'}"
            f"{f' (last torch op: {op})' if op else ''}: {e}. Check that example_inputs "
            f"(positional) and example_kwargs (keyword) are what the model's forward takes."
        ) from e
    except BaseException:
        _undo_prepare(m)
        raise
    run.build()
    moe_siblings.adopt_untraced_experts(m, run, record)  # experts the example did not reach (moe/siblings.py)
    for module, st in run.states.items():
        _attach_state(module, st, record)
    record.states = list(run.states.values())
    # calibration needs torch-function interception only for ops observed from a function call (matmul,
    # SDPA, F.linear); linear modules are caught at the module call
    record.observes_functions = any(op.quantize and op.slots and not (op.kind == LINEAR and op.weight_owner)
                                    for st in record.states for op in st.seen_ops) or any(
        isinstance(mod, FAST_PATH_MODULES) for mod in m.modules())  # so torch declines its fast path
    record.trace_run = None
    record.hessians = collect.collector_for(qconfig, record.states)  # None unless some linear asks for GPTQ
    record.phase = "prepared"
    if not any(op.kind in QUANTIZEABLE for st in record.states for op in st.seen_ops):
        warnings.warn("dbr_quant.prepare(): the forward ran no quantizeable op (linear, matmul, "
                      "scaled_dot_product_attention); nothing will be converted to FP8", stacklevel=2)
    else:
        precision.warn_high_precision(m, record, "prepare")
    return m


def _undo_prepare(m: nn.Module) -> None:
    for mod in m.modules():
        tag: ModuleTag | None = mod.__dict__.pop(TAG, None)
        mod.__dict__.pop("_dbr_record", None)
        if _is_entry_forward(mod.__dict__.get("forward")):
            del mod.__dict__["forward"]
        if tag is not None and tag.inner_forward is not None:
            mod.__dict__["forward"] = tag.inner_forward


# ---------------------------------------------------------------------- state attachment
def _attach_state(module: nn.Module, st: AutoQuantizationState, record: ModelRecord) -> None:
    """Register the state as a child, except on containers, whose iteration and len() user code sees:
    there it is a plain attribute that saves and loads through state-dict hooks."""
    if not is_container(module):
        module._auto_quant_state = st
        return
    module.__dict__["_auto_quant_state"] = st
    module._register_state_dict_hook(_container_state_dict_hook)
    module._register_load_state_dict_pre_hook(_container_load_hook, with_module=True)
    record.hidden_states.append((module, st))


def _container_state_dict_hook(module, state_dict, prefix, local_metadata):
    st = module.__dict__.get("_auto_quant_state")
    if st is not None:
        st.state_dict(destination=state_dict, prefix=prefix + "_auto_quant_state.")


def _container_load_hook(module, state_dict, prefix, local_metadata, strict, missing, unexpected, errors):
    st = module.__dict__.get("_auto_quant_state")
    if st is None:
        return
    sub_prefix = prefix + "_auto_quant_state."
    sub = {k[len(sub_prefix):]: state_dict.pop(k) for k in list(state_dict) if k.startswith(sub_prefix)}
    result = st.load_state_dict(sub, strict=False)
    missing.extend(sub_prefix + k for k in result.missing_keys)
    unexpected.extend(sub_prefix + k for k in result.unexpected_keys)


# ---------------------------------------------------------------------- calibrate / convert
def calibrate(prepared: nn.Module, batches: Iterable[Any], *, num_batches: int | None = None,
              progress: bool = True) -> nn.Module:
    """Run batches through a prepared model so its observers see real data.

    A batch is a tensor (one positional argument), a tuple/list (positional) or a mapping (keyword).
    """
    _record(prepared, "prepared", "calibrate")
    total = num_batches if num_batches is not None else (len(batches) if isinstance(batches, Sized) else None)
    with torch.no_grad():
        for i, batch in enumerate(tqdm(batches, total=total, disable=not progress, desc="calibrate")):
            if num_batches is not None and i >= num_batches:
                break
            if isinstance(batch, torch.Tensor):
                prepared(batch)
            elif isinstance(batch, Mapping):
                prepared(**batch)
            elif isinstance(batch, (tuple, list)):
                prepared(*batch)
            else:
                raise TypeError(f"calibrate(): batch {i} is a {type(batch).__name__}; give a tensor, a tuple of "
                                "positional arguments or a dict of keyword arguments")
    return prepared


def convert(prepared: nn.Module, *, inplace: bool = False, sync: Any = True) -> nn.Module:
    """Freeze scales, store nn.Linear weights in FP8 and bind recorded subgraphs to FP8 kernels.

    With torch.distributed initialized, the observers are first merged across the ranks (every rank must
    call convert; see :func:`dbr_quant.sync_observers`): ``sync`` is True (the default group), a process
    group, or False (each rank keeps its own scales). ``inplace=True`` quantizes the prepared model one
    layer at a time without copying it (peak memory: the model plus about one layer).
    """
    if sync is not False:  # data-parallel calibration; a no-op without torch.distributed
        sync_observers(prepared, None if sync is True else sync)
        sync_hessians(prepared, None if sync is True else sync)  # GPTQ: sum Hessians across ranks
    record = _record(prepared, "prepared", "convert")
    missing = [entry for st in record.states for entry in st.uncalibrated()]
    if missing:
        raise UncalibratedError(
            f"convert(): {len(missing)} activation(s) have no calibration data:\n  {_listing(missing)}\n"
            "Run dbr_quant.calibrate(prepared, batches) first, or prepare with QConfig(dynamic=True)."
        )
    _warn_suspicious_calibration(record)
    m = prepared if inplace else _copy(prepared)
    record = m.__dict__["_dbr_record"]
    with torch.inference_mode(False):  # see _copy: scales and FP8 weights a grad-mode forward can save
        for st in record.states:
            st.freeze_scales()
        ties = precision.tied_names(m)  # before quantizing: a tied linear forced to FP8 (Override untie) unties
        _quantize_linear_weights(m, record)
        quantize_param_weights(m, [op for st in record.states for op in st.seen_ops])  # F.linear(x, self.w)
        moe_weights.quantize_expert_weights(m, record)  # 3-D expert weights (moe/weights.py)
        stack_gate_up_weights(m, record.states)
    record.phase = "converted"
    precision.warn_high_precision(m, record, "convert")
    precision.warn_untied(m, ties)
    return m


def _copy(model: nn.Module) -> nn.Module:
    """The copy prepare() and convert() return. Made outside inference mode even when called inside
    ``torch.inference_mode()``: a copy made there would hold inference tensors, which a later grad-mode forward
    cannot save for backward and in-place updates (calibration, weight edits) refuse outside the mode; the
    user's own tensors are normal ones."""
    with torch.inference_mode(False):
        return copy.deepcopy(model)


def _listing(lines: list[str], shown: int = 20) -> str:
    """The first ``shown`` lines of a message's list, one per line, and how many more there are."""
    more = f"\n  … and {len(lines) - shown} more" if len(lines) > shown else ""
    return "\n  ".join(lines[:shown]) + more


def _warn_suspicious_calibration(record: ModelRecord) -> None:
    suspicious = [line for st in record.states for line in st.suspicious_calibration()]
    if suspicious:
        warnings.warn(f"convert(): the calibration data of {len(suspicious)} activation(s) look wrong:\n  "
                      f"{_listing(suspicious)}\n"
                      "Check the calibration batches (and the model's dtype: fp16 overflows to inf), then calibrate "
                      "a fresh prepare() again.", stacklevel=3)


def _quantize_linear_weights(m: nn.Module, record: ModelRecord) -> None:
    ops_by_module: dict[str, list] = {}
    for st in record.states:
        for op in st.seen_ops:
            if op.kind == LINEAR and op.weight_owner is not None:
                ops_by_module.setdefault(op.weight_owner, []).append(op)
    token = offload.new_token()
    for fqn, ops in ops_by_module.items():
        if not all(op.quantize for op in ops):
            continue  # some call runs in high precision: it needs the original weight
        module = m.get_submodule(fqn)
        if fp8_weight_of(module) is not None:
            continue  # FP8 already: placed by load_pretrained(..., recalibrate=True), its bytes are the file's
        home = offload.weight_home(m, fqn, token)  # accelerate keeps an offloaded weight in its weights map (meta here)
        w = linear_weight(module).detach() if home is None else _loaded_weight(module, home)
        if not all_finite(w):
            raise ValueError(f"convert(): the weight of '{fqn}' ({type(module).__name__}) has NaN/inf values; "
                             "fix the weights or skip this module with QConfig(overrides=(Override(pattern=...,"
                             " skip=True),))")
        cfg = ops[0].qconfig.weight
        hessians = record.hessians if any(op.qconfig.weight_rounding == "gptq" for op in ops) else None
        rounding = functools.partial(hessians.round, fqn, type(module).__name__) if hessians is not None else None
        quantized = quantize_weight(w, cfg, rounding=rounding)  # per-channel/tensor in row blocks: bounded temporaries
        attach_fp8_weight(module, quantized.qdata, quantized.scale, w.dtype, transposed=is_transposed_linear(module),
                          block=quantized.block, qconfig=cfg)
        if home is not None:
            home.store(module)  # FP8 goes back where accelerate kept the weight; the module keeps meta
        del w, quantized  # one layer at a time: the high-precision weight can go before the next one is read


def _loaded_weight(module: nn.Module, home: offload.WeightHome) -> torch.Tensor:
    w = home.load().to(module.get_parameter("weight").dtype)
    return w.t() if is_transposed_linear(module) else w


# ---------------------------------------------------------------------- report
def report(model: nn.Module) -> list[dict[str, Any]]:
    """One row per recorded quantizeable op, plus one per weight (parameter of 2+ dims) that stays high
    precision without one (a linear module no recorded op ran, a convolution, an embedding, a bare parameter):
    where it is, whether it runs in FP8, and why not (``dbr_quant.runtime.precision``). ``weight`` names the parameter
    a row stands for (None for an op between activations)."""
    record = model.__dict__.get("_dbr_record")
    if record is None:
        raise TypeError("dbr_quant.report() needs a model returned by prepare() or convert()")
    rows = []
    for st in record.states:
        if isinstance(st, moe.MoeState):  # an experts module: one row per 3-D expert tensor
            rows += moe.report_rows(st)
            continue
        for op in st.seen_ops:
            if op.kind not in QUANTIZEABLE:
                continue
            if op.weight_param is not None:  # a functional linear on a parameter (in_proj_weight, x @ A.t())
                fqn, weight = op.weight_param.label(), op.weight_param.name
            else:
                fqn = op.fqn
                weight = f"{op.weight_owner}.weight" if op.kind == LINEAR and op.weight_owner is not None else None
            rows.append({"fqn": fqn, "kind": op.kind, "module": st.fqn, "fp8": op.quantize,
                         "fusion": op.fusion, "reason": op.reason, "weight": weight})
    rows += precision.linear_rows(model, record)
    return rows + precision.report_rows(model, record, rows)


def format_report(rows: list[dict[str, Any]]) -> str:
    """A plain-text table of :func:`report` rows, high-precision ops first."""
    rows = sorted(rows, key=lambda r: r["fp8"])
    width = max([len(r["fqn"]) for r in rows] + [3])
    lines = [f"{'op':<{width}}  kind    precision  fusion          reason"]
    for r in rows:
        lines.append(f"{r['fqn']:<{width}}  {r['kind']:<7} {'fp8' if r['fp8'] else 'high':<10} "
                     f"{r['fusion'] or '-':<15} {r['reason']}")
    return "\n".join(lines)


def quant_state(module: nn.Module) -> AutoQuantizationState | None:
    """The ``_auto_quant_state`` of a module (also for containers, where it is not a child)."""
    return state_of(module)
