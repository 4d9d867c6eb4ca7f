"""dbr_quant.inspect: numerics debugging for prepared / converted models.

    import dbr_quant.inspect as dqi
    with dqi.session(model, "debug.yaml") as s:      # YAML path or text; see config.py for the schema
        model(**batch)
    print(s.table()); s.to_csv("stats.csv")
    sens = dqi.sensitivity(prepared, batches)        # only one layer in FP8 at a time, worst first
    res = dqi.auto_fallback(prepared, batches, target=0.999)   # fewest high-precision layers
    prepared2 = dbr_quant.prepare(model, example, res.qconfig())

Built on the ``InspectRun`` hook: ``model._dbr_record.inspector`` receives every recorded quantized op.
Features are frozen dataclasses registered with ``@register_feature`` (see features.py).
"""

from dbr_quant.inspect.config import InspectConfig, InspectConfigError, Section, Selector, load_config, parse_config
from dbr_quant.inspect.fallback import CurvePoint, FallbackResult, auto_fallback, fallback_applied, plot_tradeoff
from dbr_quant.inspect.features import (
    FEATURES,
    DisableFP8,
    FakeQuant,
    Feature,
    LayerInfo,
    LogFP8Stats,
    LogTensorStats,
    Quantized,
    Scaling,
    StepRange,
    TensorContext,
    register_feature,
    unregister_feature,
)
from dbr_quant.inspect.inspector import Inspector
from dbr_quant.inspect.layers import RecordedLayer, named_ops, recorded_layers
from dbr_quant.inspect.sensitivity import (
    LayerSensitivity,
    Metrics,
    compare,
    fp8_flop_fraction,
    layer_error,
    linear_flops,
    op_flops,
    plot_sensitivity,
    rank_layers,
    sensitivity,
)
from dbr_quant.inspect.session import Session, format_records, session
from dbr_quant.inspect.stats import fp8_stats, sqnr_db, tensor_stats

__all__ = [
    "session", "Session", "format_records",
    "InspectConfig", "InspectConfigError", "Section", "Selector", "load_config", "parse_config",
    "Feature", "register_feature", "unregister_feature", "FEATURES", "LayerInfo", "Quantized", "TensorContext",
    "StepRange", "LogTensorStats", "LogFP8Stats", "DisableFP8", "FakeQuant", "Scaling",
    "Inspector", "RecordedLayer", "recorded_layers", "named_ops",
    "sensitivity", "LayerSensitivity", "Metrics", "compare", "plot_sensitivity", "op_flops", "fp8_flop_fraction",
    "layer_error", "rank_layers", "linear_flops",
    "auto_fallback", "fallback_applied", "FallbackResult", "CurvePoint", "plot_tradeoff",
    "tensor_stats", "fp8_stats", "sqnr_db",
]
