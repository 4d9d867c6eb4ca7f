"""Reader of ``"quant_method": "fbgemm_fp8"`` folders (Meta's FBGEMM row-wise FP8, e.g. Llama-3.1-405B-FP8)
into a :class:`FolderScheme`.

Learned from transformers 5 (``integrations/fbgemm_fp8.py`` FbgemmFp8Linear: ``weight`` E4M3 [out, in],
``weight_scale`` float32 [out, 1]; inputs quantized per row at run time by ``quantize_fp8_per_row`` with the
upper bound ``input_scale_ub``; ``utils/quantization_config.py`` FbgemmFp8Config: ``activation_scale_ub`` 1200,
``modules_to_not_convert``) and vLLM (``model_executor/layers/quantization/fbgemm_fp8.py``: per-channel
``weight_scale``, dynamic per-token inputs, ``input_scale_ub`` from the config, ``modules_to_not_convert``).

``activation_scale_ub`` caps a token's amax before its scale is taken (a token larger than the cap saturates
to ±448 · cap/448 in FBGEMM); dbr_quant's per-token scale has no cap, so for tokens under it (any model whose
activations stay below 1200) the two are the same computation, and above it dbr_quant keeps the token
unclipped.
"""

from __future__ import annotations

from typing import Any

from dbr_quant.checkpoints.errors import CheckpointError
from dbr_quant.checkpoints.foreign_schemes import ActivationScheme, FolderScheme, LinearScheme, Target, WeightScheme

QUANT_METHOD = "fbgemm_fp8"


def read(qc: dict[str, Any], where: str) -> FolderScheme:
    ub = qc.get("activation_scale_ub", 1200.0)
    if not isinstance(ub, (int, float)) or isinstance(ub, bool) or not ub > 0:
        raise CheckpointError(f"{where}: activation_scale_ub must be a positive number, the config holds {ub!r}")
    skip = qc.get("modules_to_not_convert") or []
    if not isinstance(skip, list) or not all(isinstance(s, str) for s in skip):
        raise CheckpointError(f"{where}: modules_to_not_convert must be a list of module names, the config holds "
                              f"{skip!r}")
    scheme = LinearScheme(WeightScheme("channel"), ActivationScheme("token", True))
    return FolderScheme("FBGEMM fp8", where, ((Target("class", "Linear"), scheme),),
                        tuple(Target("glob", f"*{s}*") for s in skip))
