"""Reader of the Hugging Face Hub's ``"quant_method": "fp8"`` folders (DeepSeek-V3, Qwen3-FP8, many Llama FP8
releases) into a :class:`FolderScheme`.

Learned from transformers 5 (``utils/quantization_config.py`` FineGrainedFP8Config: ``activation_scheme``
dynamic / static, ``weight_block_size``, ``modules_to_not_convert`` (MiniMax: ``ignored_layers``), ``scale_fmt``;
``integrations/finegrained_fp8.py`` FP8Linear: ``weight`` E4M3 [out, in], ``weight_scale_inv`` the grid
[⌈out/bn⌉, ⌈in/bk⌉] or a 0-d per-tensor scale when ``weight_block_size`` is null, ``activation_scale`` 0-d when
static; dynamic inputs are scaled per token per bk channels, per token when the block is the whole weight)
and vLLM (``model_executor/layers/quantization/fp8.py`` Fp8Config / Fp8LinearMethod: block weights read
``weight_scale_inv``, per-tensor ones ``weight_scale``, static inputs ``input_scale``; ``ignored_layers``).
Both names are accepted for each tensor; ``weight_scale_inv`` is a dequantization scale despite its name.
"""

from __future__ import annotations

from typing import Any

from dbr_quant.checkpoints.errors import CheckpointError
from dbr_quant.checkpoints.foreign_schemes import ActivationScheme, FolderScheme, LinearScheme, Target, WeightScheme

QUANT_METHOD = "fp8"
_STATIC_NAMES = ("activation_scale", "input_scale")  # transformers, vLLM


def read(qc: dict[str, Any], where: str) -> FolderScheme:
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise CheckpointError(f"{where}: activation_scheme {scheme!r}, expected 'dynamic' or 'static'")
    if qc.get("scale_fmt", "float") not in (None, "float"):
        raise CheckpointError(f"{where}: scale_fmt {qc['scale_fmt']!r} (power-of-two UE8M0 scales); dbr_quant reads "
                              "float scales only")
    block = qc.get("weight_block_size")
    dynamic = scheme == "dynamic"
    if block is None:
        weight = WeightScheme("tensor", ("weight_scale", "weight_scale_inv"))
        activation = ActivationScheme("token", True) if dynamic else ActivationScheme("tensor", False,
                                                                                     scale_names=_STATIC_NAMES)
    else:
        if (not isinstance(block, list) or len(block) != 2
                or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
            raise CheckpointError(f"{where}: weight_block_size must be two positive ints [rows, columns], the config "
                                  f"holds {block!r}")
        weight = WeightScheme("block", ("weight_scale_inv", "weight_scale"), (block[0], block[1]))
        activation = (ActivationScheme("group", True, block[1]) if dynamic
                      else ActivationScheme("tensor", False, scale_names=_STATIC_NAMES))
    skip = qc.get("modules_to_not_convert") or qc.get("ignored_layers") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise CheckpointError(f"{where}: modules_to_not_convert must be a list of module names, the config holds "
                              f"{skip!r}")
    # transformers skips a module whose name contains an entry (should_convert_module: substring or prefix)
    ignore = tuple(Target("glob", f"*{s}*") for s in skip)
    return FolderScheme("transformers FineGrainedFP8 / vLLM fp8", where,
                        ((Target("class", "Linear"), LinearScheme(weight, activation)),), ignore)
