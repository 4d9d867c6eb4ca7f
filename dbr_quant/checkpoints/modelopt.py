"""Reader of NVIDIA ModelOpt's Hugging Face export (TensorRT-LLM / vLLM / SGLang FP8 checkpoints) into a
:class:`FolderScheme`.

Learned from vLLM (``model_executor/layers/quantization/modelopt.py``: the config is ``hf_quant_config.json``
``{"quantization": {"quant_algo", "kv_cache_quant_algo", "exclude_modules"}}`` or ``config.json``'s
``quantization_config`` ``{"quant_method": "modelopt", "quant_algo", "kv_cache_scheme", "ignore"}``;
``quant_algo`` ``FP8``: ``weight`` E4M3, per-tensor ``weight_scale`` and static per-tensor ``input_scale``
(ModelOptFp8LinearMethod); ``FP8_PER_CHANNEL_PER_TOKEN``: ``weight_scale`` [out], dynamic per-token inputs;
``FP8_PB_WO``: weight-only 128×128 blocks, ``weight_scale`` [out/128, 1, in/128, 1]; ``exclude_modules`` are
shell wildcards (fnmatch)) and ``model_loader/weight_utils.py`` ``maybe_remap_kv_scale_name``: ModelOpt writes
the KV-cache scales as ``<attention>.k_proj.k_scale`` / ``<attention>.v_proj.v_scale``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dbr_quant.checkpoints import foreign_schemes as fs
from dbr_quant.checkpoints.errors import CheckpointError, read_json

QUANT_METHOD = "modelopt"
HF_QUANT_CONFIG = "hf_quant_config.json"


def config_file(folder: Path) -> dict[str, Any] | None:
    """``hf_quant_config.json`` as vLLM reads it (its ``quantization`` object), or None."""
    path = folder / HF_QUANT_CONFIG
    if not path.is_file():
        return None
    data = read_json(path)
    if not isinstance(data, dict) or not isinstance(data.get("quantization"), dict):
        raise CheckpointError(f"{path}: no 'quantization' object")
    return {"quant_method": QUANT_METHOD, **data["quantization"], "_legacy": True}


def read(qc: dict[str, Any], where: str) -> fs.FolderScheme:
    algo = str(qc.get("quant_algo") or "").upper()
    if qc.get("_legacy"):
        kv_algo, exclude = qc.get("kv_cache_quant_algo"), qc.get("exclude_modules") or []
    else:
        kv = qc.get("kv_cache_scheme")
        kv_algo = "FP8" if isinstance(kv, dict) and (kv.get("type"), kv.get("num_bits")) == ("float", 8) else kv
        exclude = qc.get("ignore") or []
    if algo == "FP8":
        scheme = fs.LinearScheme(fs.WeightScheme("tensor"), fs.ActivationScheme("tensor", False))
    elif algo == "FP8_PER_CHANNEL_PER_TOKEN":
        scheme = fs.LinearScheme(fs.WeightScheme("channel"), fs.ActivationScheme("token", True))
    elif algo == "FP8_PB_WO":
        scheme = fs.LinearScheme(fs.WeightScheme("block", block=(128, 128)), None)
    else:
        raise CheckpointError(f"{where}: ModelOpt quant_algo {algo or None!r}; dbr_quant reads 'FP8', "
                              "'FP8_PER_CHANNEL_PER_TOKEN' (and refuses weight-only 'FP8_PB_WO' by name)")
    if kv_algo not in (None, "FP8", "fp8"):
        raise CheckpointError(f"{where}: kv_cache_quant_algo {kv_algo!r}; dbr_quant reads FP8 k/v scales only")
    if not isinstance(exclude, list) or not all(isinstance(e, str) for e in exclude):
        raise CheckpointError(f"{where}: exclude_modules must be a list of module wildcards, the config holds "
                              f"{exclude!r}")
    ignore = tuple(fs.Target("glob", e) for e in exclude) + tuple(fs.Target("glob", e + ".*") for e in exclude)
    return fs.FolderScheme(f"ModelOpt {algo}", where, ((fs.Target("class", "Linear"), scheme),), ignore,
                           fs.KVCacheScheme(("k_proj.k_scale", "v_proj.v_scale")) if kv_algo is not None else None)
