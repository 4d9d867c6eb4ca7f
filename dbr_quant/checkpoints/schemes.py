"""compressed-tensors ``float-quantized`` schemes: the scheme of one FP8 weight (refusing what the format lacks),
the ``quantization_config`` that groups them, and the dtype a scale is written in (``layout.py`` has the mapping).
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import torch

from dbr_quant.checkpoints.errors import CheckpointError
from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference.mx import MX_BLOCK
from dbr_quant.ops.state import SeenOp
from dbr_quant.quantize.weights import FP8Weight

CT_VERSION = "0.20.0"  # the compressed-tensors release whose layout this writes (checked by the tests)
FLOAT_FORMAT = "float-quantized"
MXFP8_FORMAT = "mxfp8-quantized"  # compressed-tensors 0.20 CompressionFormat.mxfp8_quantized (compressors/mxfp8)
E8M0_SCALE_DTYPE = "torch.uint8"  # QuantizationArgs.scale_dtype as compressed-tensors 0.20 serializes its MXFP8 preset


def scale_dtype(scale: torch.Tensor, model_dtype: torch.dtype) -> torch.dtype:
    """The model's dtype when it holds every value of ``scale`` exactly, else float32."""
    if model_dtype.is_floating_point and torch.equal(scale.to(model_dtype).float(), scale.float()):
        return model_dtype
    return torch.float32


def _args(strategy: str, dynamic: bool, size: tuple[int, ...] | None = None) -> dict[str, Any]:
    """One compressed-tensors QuantizationArgs; ``size`` is the block (rows, columns) of a ``block`` strategy or
    the (group size,) of a ``group`` one (the FP8_BLOCK preset: [128, 128] weight blocks, 128 groups). Strategy
    "mx": the MXFP8 preset's args (quant_scheme.py: strategy group, group_size 32, scale_dtype uint8)."""
    if strategy == "mx":
        return {**_args("group", dynamic, (MX_BLOCK,)), "scale_dtype": E8M0_SCALE_DTYPE}
    args = {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": dynamic,
            "group_size": size[0] if strategy == "group" and size else None, "observer": None if dynamic else "minmax"}
    if strategy == "block" and size:
        args["block_structure"] = list(size)
    return args


# (weight strategy, activation strategy, dynamic, weight block or None, activation group or None); MXFP8 is
# ("mx", "mx", True, None, 32), weight-only FP8 (W8A16) has activation strategy "none" (no input_activations)
Scheme = tuple[str, str, bool, "tuple[int, int] | None", "int | None"]


def scheme(fqn: str, w: FP8Weight, ops: list[SeenOp]) -> Scheme:
    """The scheme of an FP8 linear (see ``Scheme``); raises for what the format lacks."""
    if w.qdata.dtype != torch.float8_e4m3fn:
        raise CheckpointError(f"'{fqn}': its weight is {FP8Format.of(w.qdata.dtype).name}; the compressed-tensors "
                              "format stores FP8 weights as E4M3 only. Convert with QConfig(weight=TensorQConfig("
                              "format='e4m3', ...)) to save for serving.")
    if all(op.qconfig.weight_only for op in ops):  # vLLM's CompressedTensorsW8A16Fp8: weights only
        return ("tensor" if w.scale.dim() == 0 else "channel"), "none", True, None, None
    formats = {op.qconfig.activation.format for op in ops}
    if formats != {FP8Format.E4M3}:
        raise CheckpointError(f"'{fqn}': its input is quantized as {sorted(f.name for f in formats)}; the "
                              "compressed-tensors format has E4M3 activations only. Convert with E4M3 activations "
                              "(the default) to save for serving.")
    modes = {(op.qconfig.dynamic, op.qconfig.activation.granularity if op.qconfig.dynamic else "tensor")
             for op in ops}
    if len(modes) != 1:
        raise CheckpointError(f"'{fqn}' is called at {len(ops)} sites with different activation settings "
                              f"{sorted(modes)}; the format has one per linear. Give its call sites one setting.")
    (dynamic, granularity), = modes
    group = ops[0].qconfig.activation.group_size if granularity == "group" else None
    if w.scale.dtype == torch.uint8:  # E8M0 codes: MXFP8
        if w.qdata.shape[-1] % MX_BLOCK and not w.transposed:
            raise CheckpointError(f"'{fqn}': in_features {w.qdata.shape[-1]} is not a multiple of 32; "
                                  "compressed-tensors' MXFP8 (group strategy, group_size 32) needs whole groups. Keep "
                                  "it in high precision (Override(pattern=..., skip=True)).")
        return "mx", "mx", True, None, MX_BLOCK
    if w.block is not None:
        in_features = w.qdata.shape[-1]
        if in_features % w.block[1] and granularity == "group" and not w.transposed:  # Conv1D: dequantized
            # compressed-tensors' group fake-quantization raises "tensor column shape must be divisble by the
            # given group_size" at the first forward, and vLLM / SGLang per-token-group kernels assert it
            raise CheckpointError(
                f"'{fqn}': in_features {in_features} is not a multiple of the activation group {group}; the "
                "compressed-tensors group strategy (and vLLM's / SGLang's per-token-group kernels) need whole "
                "groups, so loaders could not run this layer. Keep it in high precision (Override(pattern=..., "
                "skip=True)) or convert with a block whose column count divides every in_features.")
        return "block", granularity, dynamic, w.block, group
    return ("tensor" if w.scale.dim() == 0 else "channel"), granularity, dynamic, None, group


def quantization_config(schemes: dict[str, Scheme], ignore: list[str], kv: str | None) -> dict[str, Any]:
    """One config group per distinct scheme: the most common targets ``Linear``, the others list their
    modules by exact name (an exact name outranks a class name in compressed-tensors and vLLM). ``kv``: the
    ``kv_cache_scheme`` strategy ("tensor" or "attn_head"), None for none."""
    by_scheme: dict[Scheme, list[str]] = defaultdict(list)
    for fqn, s in schemes.items():
        by_scheme[s].append(fqn)
    ordered = sorted(by_scheme.items(), key=lambda kv_: -len(kv_[1]))
    groups = {}
    for i, ((wstrat, astrat, dynamic, block, group), names) in enumerate(ordered):
        groups[f"group_{i}"] = {
            "targets": ["Linear"] if i == 0 else sorted(names),
            "format": MXFP8_FORMAT if wstrat == "mx" else FLOAT_FORMAT,
            "weights": _args(wstrat, False, block),
            "input_activations": None if astrat == "none" else _args(astrat, dynamic, (group,) if group else None),
            "output_activations": None,
        }
    formats = {g["format"] for g in groups.values()}
    fmt = formats.pop() if len(formats) == 1 else "mixed-precision"
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "kv_cache_scheme": _args(kv, False) if kv else None, "ignore": ignore,
            "config_groups": groups, "global_compression_ratio": None, "sparsity_config": {},
            "transform_config": {}, "version": CT_VERSION}
