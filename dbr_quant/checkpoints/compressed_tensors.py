"""Reader of compressed-tensors ``float-quantized`` folders (llm-compressor's output; ``"quant_method":
"compressed-tensors"`` in ``config.json``) into a :class:`FolderScheme`.

Learned from compressed-tensors 0.20 (``quantization/quant_args.py``: strategies tensor / channel / group /
block / token, ``block_structure``, ``group_size``, ``dynamic``; ``quantization/quant_scheme.py``: the presets
``FP8`` (tensor weights, static tensor inputs), ``FP8_DYNAMIC`` (channel weights, dynamic token inputs),
``FP8_BLOCK`` (128×128 block weights, dynamic 1×128 group inputs); ``quantization/lifecycle/initialize.py``:
``weight_scale`` [1] / [out, 1] / [out, in/g] / [⌈out/bn⌉, ⌈in/bk⌉], ``input_scale`` [1], attention
``k_scale`` / ``v_scale`` [1]; ``utils/match.py``: a target is an exact module name, a ``re:`` regex or a class
name, exact names first) and vLLM's loader (``compressed_tensors/compressed_tensors.py`` picks the scheme per
layer; ``schemes/compressed_tensors_w8a8_fp8.py`` runs FP8 weights with static or dynamic FP8 inputs,
``schemes/compressed_tensors_w8a16_fp8.py`` the weight-only case, ``compressed_tensors_kv.py`` the k/v scales).
"""

from __future__ import annotations

from typing import Any

from dbr_quant.checkpoints.errors import CheckpointError
from dbr_quant.checkpoints.foreign_schemes import (
    ActivationScheme,
    FolderScheme,
    KVCacheScheme,
    LinearScheme,
    Target,
    WeightScheme,
)

QUANT_METHOD = "compressed-tensors"
_FORMATS = ("float-quantized", "naive-quantized")  # both store E4M3 ``weight`` + scales for 8-bit float


def targets(names: Any, where: str) -> tuple[Target, ...]:
    """compressed-tensors target strings: ``re:<regex>``, else an exact module name or a class name."""
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"{where}: expected a list of module names / 're:' patterns, the config holds {names!r}")
    out: list[Target] = []
    for n in names:
        out += [Target("regex", n[3:])] if n.startswith("re:") else [Target("name", n), Target("class", n)]
    return tuple(out)


def _fp8(args: dict[str, Any]) -> str | None:
    """Why these QuantizationArgs are not symmetric 8-bit float (E4M3), or None."""
    if (args.get("type"), args.get("num_bits")) != ("float", 8):
        return f"{args.get('type')} {args.get('num_bits')}-bit values (not FP8)"
    if args.get("symmetric", True) is not True:
        return "asymmetric (zero-point) FP8"
    return None


def _weight(w: dict[str, Any], where: str) -> tuple[WeightScheme | None, str | None]:
    why = _fp8(w)
    if why is not None:
        return None, f"weights: {why}"
    strategy = w.get("strategy")
    if w.get("dynamic") not in (False, None):
        return None, f"weights dynamic={w.get('dynamic')!r} (a weight scale computed at run time)"
    if strategy in ("tensor", "channel"):
        return WeightScheme(strategy), None
    if strategy == "block":
        block = w.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
            raise CheckpointError(f"{where}.weights.block_structure must be two positive ints [rows, columns], the "
                                  f"config holds {block!r}")
        return WeightScheme("block", block=(block[0], block[1])), None
    if strategy == "group":
        g = w.get("group_size")
        if not isinstance(g, int) or g <= 0:
            raise CheckpointError(f"{where}.weights.group_size must be a positive int, the config holds {g!r}")
        if w.get("actorder") not in (None, False):
            return None, f"weights with activation ordering (actorder={w.get('actorder')!r})"
        return WeightScheme("block", block=(1, g)), None  # one scale per row per g columns
    return None, f"weight strategy {strategy!r}"


def _activation(a: dict[str, Any] | None, where: str) -> tuple[ActivationScheme | None, str | None]:
    if not a:
        return None, None  # weight-only
    why = _fp8(a)
    if why is not None:
        return None, f"input_activations: {why}"
    strategy, dynamic = a.get("strategy"), a.get("dynamic")
    if dynamic is True and strategy in ("tensor", "token"):
        return ActivationScheme(strategy, True), None
    if dynamic is True and strategy == "group":
        g = a.get("group_size")
        if not isinstance(g, int) or g <= 0:
            raise CheckpointError(f"{where}.input_activations.group_size must be a positive int, the config "
                                  f"holds {g!r}")
        return ActivationScheme("group", True, g), None
    if dynamic is False and strategy == "tensor":
        return ActivationScheme("tensor", False), None
    return None, f"input_activations strategy {strategy!r} with dynamic={dynamic!r}"


def _group(g: dict[str, Any], qc: dict[str, Any], where: str) -> LinearScheme:
    fmt = g.get("format") or qc.get("format")
    w_args, a_args = g.get("weights"), g.get("input_activations")
    if not isinstance(w_args, dict):
        raise CheckpointError(f"{where}: no 'weights' arguments")
    weight, why = _weight(w_args, where)
    activation, why_a = _activation(a_args if isinstance(a_args, dict) else None, where)
    refused = why or why_a
    if fmt not in _FORMATS:
        refused = f"format {fmt!r}; dbr_quant reads FP8 stored as {' / '.join(_FORMATS)}"
    elif g.get("output_activations"):
        refused = "output_activations are quantized (no loader runs that for FP8)"
    if refused is not None:
        return LinearScheme(weight or WeightScheme("tensor"), None, refused=f"compressed-tensors {refused}; dbr_quant "
                            "reads FP8 (E4M3, symmetric) weights with static per-tensor or dynamic per-tensor / "
                            "token / group inputs")
    assert weight is not None
    return LinearScheme(weight, activation)


def read(qc: dict[str, Any], where: str) -> FolderScheme:
    """The FolderScheme of a compressed-tensors ``quantization_config`` (``where``: its file, for messages)."""
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where}: a compressed-tensors config without config_groups")
    status = qc.get("quantization_status")
    if status not in (None, "compressed"):
        raise CheckpointError(f"{where}: quantization_status {status!r}; the folder holds high-precision weights "
                              "(not compressed to FP8), load it as a plain model and quantize it with dbr_quant")
    rules: list[tuple[Target, LinearScheme]] = []
    for name, g in groups.items():
        gw = f"{where}: config_groups.{name}"
        if not isinstance(g, dict):
            raise CheckpointError(f"{gw}: not an object")
        scheme = _group(g, qc, gw)
        rules += [(t, scheme) for t in targets(g.get("targets"), f"{gw}.targets")]
    kv = qc.get("kv_cache_scheme")
    kv_scheme = None
    if kv is not None:
        if not isinstance(kv, dict) or _fp8(kv) is not None or kv.get("strategy") != "tensor" or kv.get("dynamic"):
            raise CheckpointError(f"{where}: kv_cache_scheme {kv!r}; dbr_quant reads static per-tensor FP8 k/v "
                                  "scales only")
        kv_scheme = KVCacheScheme(("k_scale", "v_scale"))
    return FolderScheme("compressed-tensors", where, tuple(rules), targets(qc.get("ignore") or [], f"{where}: ignore"),
                        kv_scheme)
