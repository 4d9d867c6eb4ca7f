"""Weight rounding onto the FP8 grid beyond round-to-nearest: GPTQ with cross-validated damping.

``HessianAccumulator`` collects a linear's calibration inputs (per fold); ``gptq_quantize`` chooses the
damping by cross-validation and returns the FP8 weight and its scale. Plain tensors only: wiring into
calibrate/convert lives in the API.
"""

from dbr_quant.quantize.rounding.damping import (
    DEFAULT_DAMPINGS,
    FALLBACK_DAMPING,
    DampingChoice,
    GPTQResult,
    choose_damping,
    gptq_quantize,
)
from dbr_quant.quantize.rounding.gptq import (
    HessianNotPositiveDefiniteError,
    feedback_factor,
    gptq_round,
    output_error,
    round_to_nearest,
    weight_scale,
)
from dbr_quant.quantize.rounding.hessian import HessianAccumulator

__all__ = [
    "DEFAULT_DAMPINGS",
    "DampingChoice",
    "FALLBACK_DAMPING",
    "GPTQResult",
    "HessianAccumulator",
    "HessianNotPositiveDefiniteError",
    "choose_damping",
    "feedback_factor",
    "gptq_quantize",
    "gptq_round",
    "output_error",
    "round_to_nearest",
    "weight_scale",
]
