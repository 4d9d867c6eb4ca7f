"""``load_pretrained`` for block-scaled FP8 folders written by other tools (no ``dbr_quant.json``).

Two layouts, told apart by ``config.json``'s ``quantization_config``:

* compressed-tensors (llm-compressor's ``FP8_BLOCK``): ``"quant_method": "compressed-tensors"``, format
  ``float-quantized``, every config group with ``weights.strategy: "block"`` and ``block_structure`` [bn, bk];
  tensors ``weight`` (E4M3) and ``weight_scale`` [⌈out/bn⌉, ⌈in/bk⌉]; activations dynamic ``group`` (group
  size bk), dynamic ``token`` / ``tensor``, or static ``tensor`` with ``input_scale``.
* transformers FineGrainedFP8 (DeepSeek-V3, Qwen3-FP8): ``"quant_method": "fp8"``, ``weight_block_size``
  [bn, bk]; tensors ``weight`` (E4M3) and ``weight_scale_inv`` — the *dequantization* scale despite its name,
  same grid; ``activation_scheme`` ``dynamic`` (per token per bk channels, what DeepGEMM / vLLM run) or
  ``static`` with a per-tensor ``activation_scale``.

In both, ``W[n, k] = weight[n, k] · scale[n // bn, k // bk]``. The block size comes from the config, never
from the scale grid: a 300×200 weight with 128×128 blocks has a 3×2 grid, which the grid-inferring route
(transformers' ``Fp8Dequantize``: 100×100 blocks) dequantizes wrongly. Any other scale shape is an error
naming the tensor and the shape expected.

The modules whose ``weight`` is E4M3 in the file become block-scaled FP8 linears running dbr_quant's block
kernels; every other linear stays high precision. As for dbr_quant folders, everything is checked before
the model is built (``assemble.py``: FP8 weights placed as read, no high-precision copy), and the passed
model is never modified.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dbr_quant.checkpoints.assemble import Skeleton, check_scale, example_args, finish_convert, trace
from dbr_quant.checkpoints.errors import CheckpointError
from dbr_quant.checkpoints.layout import model_modules, own_tensors
from dbr_quant.checkpoints.safetensors_io import read_tensor
from dbr_quant.ops.mappings import LINEAR
from dbr_quant.ops.state import AutoQuantizationState, SeenOp
from dbr_quant.qconfig import Granularity, Override, QConfig, TensorQConfig

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class ForeignLayout:
    """What a foreign quantization_config says about its block-scaled linears."""

    tool: str  # for messages
    block: tuple[int, int]
    scale_name: str  # weight_scale (compressed-tensors) / weight_scale_inv (FineGrainedFP8)
    activation: Granularity  # "group", "token" or "tensor"
    dynamic: bool
    input_scale_name: str | None  # static activations: input_scale / activation_scale


def quantization_config_of(folder: Path) -> dict[str, Any] | None:
    path = folder / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: cannot read it as JSON ({e})") from e
    qc = config.get("quantization_config") if isinstance(config, dict) else None
    return qc if isinstance(qc, dict) else None


def is_block_config(qc: dict[str, Any]) -> bool:
    """Does this quantization_config describe block-scaled FP8 weights (what this module reads)?"""
    if qc.get("quant_method") == "fp8":
        return qc.get("weight_block_size") is not None
    groups = qc.get("config_groups") if qc.get("quant_method") == "compressed-tensors" else None
    return isinstance(groups, dict) and any(
        isinstance(g, dict) and isinstance(g.get("weights"), dict) and g["weights"].get("strategy") == "block"
        for g in groups.values())


def _block_of(value: Any, where: str) -> tuple[int, int]:
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in value)):
        raise CheckpointError(f"{where} must be two positive ints [rows, columns], the config holds {value!r}")
    return value[0], value[1]


def parse_layout(qc: dict[str, Any], where: str) -> ForeignLayout:
    """The block layout a foreign quantization_config describes; a CheckpointError for anything else."""
    method = qc.get("quant_method")
    if method == "fp8":
        if qc.get("weight_block_size") is None:
            raise CheckpointError(f"{where}: a FineGrainedFP8 config without weight_block_size (per-tensor FP8); "
                                  "dbr_quant.load_pretrained reads its block-scaled form only")
        block = _block_of(qc["weight_block_size"], f"{where}: weight_block_size")
        if qc.get("scale_fmt", "float") not in (None, "float"):
            raise CheckpointError(f"{where}: scale_fmt {qc['scale_fmt']!r}; dbr_quant reads float scales only")
        scheme = qc.get("activation_scheme", "dynamic")
        if scheme not in ("dynamic", "static"):
            raise CheckpointError(f"{where}: activation_scheme {scheme!r}, expected 'dynamic' or 'static'")
        dynamic = scheme == "dynamic"
        return ForeignLayout("FineGrainedFP8", block, "weight_scale_inv", "group" if dynamic else "tensor", dynamic,
                             None if dynamic else "activation_scale")
    if method != "compressed-tensors":
        raise CheckpointError(f"{where}: quant_method {method!r}; dbr_quant.load_pretrained reads folders of "
                              "dbr_quant.save_pretrained, compressed-tensors block FP8 and transformers FineGrainedFP8")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}: a compressed-tensors config without config_groups")
    layouts = set()
    for name, g in groups.items():
        w, a = (g or {}).get("weights") or {}, (g or {}).get("input_activations") or {}
        fmt = g.get("format") or qc.get("format")
        gw = f"{where}: config_groups.{name}"
        if fmt not in ("float-quantized", "naive-quantized"):
            raise CheckpointError(f"{gw}: format {fmt!r}; dbr_quant reads float-quantized FP8 only")
        if (w.get("type"), w.get("num_bits"), w.get("strategy")) != ("float", 8, "block") or not w.get(
                "symmetric", True):
            raise CheckpointError(f"{gw}: weights {w.get('type')} {w.get('num_bits')}-bit strategy "
                                  f"{w.get('strategy')!r}; this reader takes symmetric FP8 'block' weights (a "
                                  "per-channel / per-tensor folder loads with dbr_quant.save_pretrained's own format "
                                  "or transformers)")
        block = _block_of(w.get("block_structure"), f"{gw}.weights.block_structure")
        if not a:
            raise CheckpointError(f"{gw}: no input_activations (weight-only FP8); dbr_quant runs FP8 activations")
        strategy, dynamic = a.get("strategy"), a.get("dynamic") is True
        if (a.get("type"), a.get("num_bits")) != ("float", 8) or strategy not in ("group", "token", "tensor") or (
                strategy in ("group", "token") and not dynamic):
            raise CheckpointError(f"{gw}: input_activations {a.get('type')} {a.get('num_bits')}-bit "
                                  f"{strategy!r} dynamic={a.get('dynamic')!r} is not an FP8 scheme dbr_quant runs")
        if strategy == "group" and a.get("group_size") != block[1]:
            raise CheckpointError(f"{gw}: activation group_size {a.get('group_size')} differs from the weight "
                                  f"block's column count {block[1]}; the block GEMM takes one scale per K block")
        layouts.add(ForeignLayout("compressed-tensors", block, "weight_scale", strategy, dynamic,
                                  None if dynamic else "input_scale"))
    if len(layouts) != 1:
        raise CheckpointError(f"{where}: config groups with different block schemes {sorted(map(str, layouts))}; "
                              "dbr_quant reads one scheme per folder")
    return layouts.pop()


def expected_scale_shape(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def _model_tensors(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """name → tensor of everything a state_dict holds, and name → first name of a tied (same object) tensor."""
    tensors: dict[str, torch.Tensor] = {}
    first: dict[int, str] = {}
    tied: dict[str, str] = {}
    for fqn, mod in model_modules(model):
        for pname, t in own_tensors(mod):
            name = f"{fqn}.{pname}" if fqn else pname
            if id(t) in first:
                tied[name] = first[id(t)]
            else:
                first[id(t)] = name
            tensors[name] = t
    return tensors, tied


def check_folder(model: nn.Module, layout: ForeignLayout, stored: dict[str, Any]) -> tuple[dict[str, torch.Tensor],
                                                                                           list[str]]:
    """Every tensor read and checked against ``model``: (name → value, FP8 linear names). Raises naming the
    tensor; reads nothing into the model."""
    tensors, tied = _model_tensors(model)
    modules = dict(model_modules(model))
    fp8 = sorted(n.removesuffix(".weight") for n, t in stored.items()
                 if n.endswith("weight") and t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2))
    expected: dict[str, tuple[tuple[torch.dtype, ...], tuple[int, ...]]] = {}
    for fqn in fp8:
        name = f"{fqn}.weight"
        mod, t = modules.get(fqn), tensors.get(name)
        if stored[name].dtype != torch.float8_e4m3fn:
            raise CheckpointError(f"{name}: {stored[name].dtype} weights; dbr_quant's block kernels take E4M3")
        if mod is None or t is None or t.dim() != 2 or not isinstance(mod, nn.Linear):
            raise CheckpointError(f"{name}: an FP8 weight in the checkpoint, but the model has no nn.Linear "
                                  f"'{fqn}'; build the architecture the checkpoint was made from")
        wshape = (t.shape[0], t.shape[1])
        expected[name] = ((torch.float8_e4m3fn,), wshape)
        expected[f"{fqn}.{layout.scale_name}"] = (_FLOATS, expected_scale_shape(wshape, layout.block))
        if layout.input_scale_name is not None:
            expected[f"{fqn}.{layout.input_scale_name}"] = (_FLOATS, ())
    for name, t in tensors.items():
        if name in expected:
            continue
        if name in tied and name not in stored:  # tied weights are written once
            continue
        expected[name] = ((t.dtype,) if not t.dtype.is_floating_point else _FLOATS, tuple(t.shape))
    for name, (dtypes, shape) in expected.items():
        t = stored.get(name)
        if t is None:
            raise CheckpointError(f"{name}: missing from the {layout.tool} checkpoint (the model needs shape "
                                  f"{list(shape)}); is this the checkpoint of this architecture?")
        scalar = shape == () and t.shape in ((), (1,))
        if t.dtype not in dtypes or (t.shape != shape and not scalar):
            what = "block scale" if name.endswith(layout.scale_name) else "tensor"
            hint = (f" (the {layout.block[0]}×{layout.block[1]} block grid of the "
                    f"{list(expected[name.rsplit('.', 1)[0] + '.weight'][1])} weight)" if what == "block scale" else "")
            raise CheckpointError(f"{name}: the checkpoint holds {str(t.dtype).removeprefix('torch.')} "
                                  f"{list(t.shape)}, the model needs {list(shape)}{hint}; this {what} does not match "
                                  f"the {layout.tool} layout of this architecture")
    unexpected = sorted(set(stored) - set(expected))
    if unexpected:
        raise CheckpointError(f"{unexpected[0]}: in the checkpoint but not in the model ({len(unexpected)} such "
                              f"tensor(s)); build the architecture the checkpoint was made from")
    values = {name: read_tensor(stored[name]) for name in expected if name in stored}
    for fqn in fp8:
        check_scale(f"{fqn}.{layout.scale_name}", values[f"{fqn}.{layout.scale_name}"])
        if layout.input_scale_name is not None:
            check_scale(f"{fqn}.{layout.input_scale_name}", values[f"{fqn}.{layout.input_scale_name}"])
        if bool(((values[f"{fqn}.weight"].view(torch.uint8) & 0x7F) == 0x7F).any()):
            raise CheckpointError(f"{fqn}.weight: the FP8 weight holds NaN bytes (0x7f/0xff)")
    return values, fp8


def _default_example(model: nn.Module) -> tuple[tuple, dict]:
    config = getattr(model, "config", None)
    vocab = getattr(config, "vocab_size", None)
    if getattr(model, "main_input_name", None) == "input_ids" and isinstance(vocab, int) and vocab > 1:
        return (), {"input_ids": (torch.arange(8) % (vocab - 1) + 1).reshape(1, 8)}
    raise CheckpointError("a checkpoint of another tool has no example inputs: pass example_inputs= / "
                          "example_kwargs= to load_pretrained (what the model's forward takes)")


def _traced_fp8(states: list[AutoQuantizationState]) -> set[str]:
    """The linear modules every traced call of which runs in FP8."""
    ops: dict[str, list[SeenOp]] = {}
    for st in states:
        for op in st.seen_ops:
            if op.kind == LINEAR and op.weight_owner is not None:
                ops.setdefault(op.weight_owner, []).append(op)
    return {fqn for fqn, calls in ops.items() if all(op.quantize for op in calls)}


def load_foreign(folder: Path, model: nn.Module, qc: dict[str, Any], stored: dict[str, Any],
                 example_inputs: Any, example_kwargs: dict[str, Any] | None) -> nn.Module:
    """A converted model running the folder's block-scaled FP8 linears, built as ``load.py`` builds one
    (``assemble.py``): FP8 weights placed as read, static input scales from the folder, no calibration."""
    layout = parse_layout(qc, f"{folder / 'config.json'}: quantization_config")
    values, fp8 = check_folder(model, layout, stored)
    if not fp8:
        raise CheckpointError(f"{folder}: no E4M3 'weight' tensor, nothing to load as FP8")
    if example_inputs is None and example_kwargs is None:
        args, kwargs = _default_example(model)
    else:
        args, kwargs = example_args(example_inputs, example_kwargs)
    fp8_set = set(fp8)
    keep_hp = tuple(Override(pattern=f"^{re.escape(fqn)}$", skip=True) for fqn, mod in model_modules(model)
                    if isinstance(mod, nn.Linear) and fqn not in fp8_set)
    bn, bk = layout.block
    qconfig = QConfig(weight=TensorQConfig(granularity="block", block=layout.block),
                      activation=TensorQConfig(granularity=layout.activation, group_size=bk),
                      dynamic=layout.dynamic, overrides=keep_hp)
    skeleton = Skeleton(model)
    for fqn in fp8:
        skeleton.put_fp8(f"{fqn}.weight", values.pop(f"{fqn}.weight"),
                         values.pop(f"{fqn}.{layout.scale_name}").float(), False, layout.block)
    for name in list(skeleton.slots):
        if name in values:
            skeleton.put(name, values[name])
    skeleton.check_complete()
    prepared = trace(skeleton.model, args, kwargs, qconfig)
    record = prepared.__dict__["_dbr_record"]
    lost = sorted(fp8_set - _traced_fp8(record.states))
    if lost:
        raise CheckpointError(f"'{lost[0]}': an FP8 linear in the checkpoint, but the trace runs it in high "
                              "precision (the example inputs did not run it?); pass example inputs that do")
    input_scale = layout.input_scale_name

    def scale_of(st: AutoQuantizationState, op: SeenOp, slot: str) -> torch.Tensor | None:
        if input_scale is None or op.kind != LINEAR or op.weight_owner not in fp8_set:
            return None
        return values[f"{op.weight_owner}.{input_scale}"].float().reshape(())

    return finish_convert(prepared, scale_of)
