"""dbr_quant: define-by-run FP8 post-training quantization for eager PyTorch models.

    prepared = dbr_quant.prepare(model, example_inputs)
    dbr_quant.calibrate(prepared, batches)
    converted = dbr_quant.convert(prepared)
    dbr_quant.save_pretrained(converted, "out/")      # FP8 checkpoint that transformers and vLLM load
"""

__version__ = "0.1.0"  # first: checkpoints/save.py imports it while this package is still initializing

from dbr_quant import kernels
from dbr_quant.api import PrepareError, calibrate, convert, disabled, format_report, prepare, quant_state, report
from dbr_quant.checkpoints import CheckpointError, load_pretrained, save_pretrained
from dbr_quant.formats import FP8Format
from dbr_quant.fx_rewriter import ops as _ops  # noqa: F401  (defines the dbr_quant:: ops, so saved ExportedPrograms load)
from dbr_quant.integrations.distributed import SyncError, sync_observers
from dbr_quant.observers import MSE, AmaxHistory, MovingAverage, Percentile, RunningMax
from dbr_quant.ops.fusions import Fusion, register_fusion
from dbr_quant.ops.state import AutoQuantizationState, UncalibratedError, UnseenOpError
from dbr_quant.qconfig import GPTQOptions, Override, QConfig, TensorQConfig

__all__ = [
    "prepare", "calibrate", "convert", "sync_observers", "disabled", "report", "format_report", "quant_state",
    "QConfig", "TensorQConfig", "Override", "GPTQOptions", "FP8Format",
    "RunningMax", "MovingAverage", "AmaxHistory", "Percentile", "MSE",
    "AutoQuantizationState", "Fusion", "register_fusion", "kernels",
    "PrepareError", "UncalibratedError", "UnseenOpError", "SyncError",
    "save_pretrained", "load_pretrained", "CheckpointError",
]


def __getattr__(name: str):
    """``dbr_quant.inspect`` loads on first use (it pulls in more)."""
    if name == "inspect":
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
