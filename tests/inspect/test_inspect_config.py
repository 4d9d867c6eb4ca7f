"""YAML config: schema, selection, and errors that name the offending line."""

import pytest
import torch

import dbr_quant.inspect as dqi
from dbr_quant.inspect import InspectConfigError

H = "a:\n  layers: {name_regex: fc}\n"


def _error(p, text: str) -> InspectConfigError:
    with pytest.raises(InspectConfigError) as info:
        with dqi.session(p, text):
            pass
    assert p._dbr_record.inspector is None
    return info.value


@pytest.mark.parametrize(
    "text, line, words",
    [
        (H + "  features:\n    LogTensorStat: {}\n", 4, ["unknown feature", "LogTensorStats"]),
        ("a:\n  layers:\n    name_regex: 'fc('\n  features: {DisableFP8: {}}\n", 3, ["not a valid regex"]),
        ("a:\n  layers: {name_regex: fc}\n  features: {DisableFP8: {}}\nb:\n  layers:\n    name_regex: attn\n"
         "  features: {DisableFP8: {}}\n", 6, ["selects no recorded", "fc1, fc2, fc3"]),
        (H + "  features:\n    LogTensorStats:\n      freq: often\n", 5, ["freq must be int"]),
        (H + "  features:\n    LogTensorStats:\n      frq: 2\n", 5, ["unknown key 'frq'", "freq"]),
        ("a:\n  layers: {name_regex: fc}\n  features:\n    LogTensorStats:\n      stats: [amax, p99]\n", 4, ["p99"]),
        ("a:\n  layers: {name_regex: fc}\n  features:\n    Scaling: {weight_format: e3m4}\n", 4, ["e3m4"]),
        ("a:\n  layers: {name_regex: fc\n  features: {}\n", 3, ["invalid YAML"]),
        (H + "  layers: {name_regex: fc}\n  features: {DisableFP8: {}}\n", 3, ["duplicate"]),
        ("a:\n  layer: {name_regex: fc}\n  features: {DisableFP8: {}}\n", 2, ["unknown key 'layer'", "layers"]),
        ("a:\n  layers: {name_regex: fc, kind: conv}\n  features: {DisableFP8: {}}\n", 2, ["kind"]),
        ("a:\n  layers: {name_regex: fc}\n", 1, ["needs 'features:'"]),
        ("a:\n  layers: {module_type: Conv2d}\n  features: {DisableFP8: {}}\n", 2, ["selects no recorded"]),
    ],
)
def test_errors_name_the_line(mlp_prepared, text, line, words):
    _, p = mlp_prepared
    err = _error(p, text)
    assert err.line == line, str(err)
    assert f"line {line}:" in str(err)
    for w in words:
        assert w in str(err)


def test_file_errors_name_the_file(mlp_prepared, tmp_path):
    _, p = mlp_prepared
    path = tmp_path / "debug.yaml"
    path.write_text("# comment\nsec:\n  layers: {name_regex: fc1}\n  features:\n    Nope: {}\n")
    err = _error(p, path)
    assert err.line == 5 and str(path) in str(err)
    err = _error(p, str(path))  # a str without ':' or newline is a path too
    assert err.line == 5


def test_selection_and_first_section_wins(mlp_prepared):
    _, p = mlp_prepared
    cfg = dqi.parse_config(
        "first:\n  layers: {name_regex: 'fc[12]$'}\n  features:\n    LogTensorStats: {freq: 2}\n"
        "second:\n  layers: {module_type: Linear, kind: linear}\n  features:\n    LogTensorStats: {freq: 3}\n"
        "    DisableFP8:\n"
        "sec_off:\n  enabled: false\n  layers: {name_regex: fc3}\n  features: {FakeQuant: {}}\n"
        "feature_off:\n  layers: {name_regex: fc3}\n  features: {LogFP8Stats: {enabled: false}}\n")
    plan = cfg.plan(dqi.recorded_layers(p))
    assert [f.freq for f in plan["fc1"] if isinstance(f, dqi.LogTensorStats)] == [2]
    assert [f.freq for f in plan["fc3"] if isinstance(f, dqi.LogTensorStats)] == [3]
    assert all(any(isinstance(f, dqi.DisableFP8) for f in fs) for fs in plan.values())
    assert not any(isinstance(f, (dqi.FakeQuant, dqi.LogFP8Stats)) for f in plan["fc3"])
    # YAML lists become tuples, ints stay ints; the object is frozen
    f = dqi.parse_config("s:\n  layers: {kind: linear}\n  features:\n    LogTensorStats: {tensors: [input]}\n")
    feat = f.sections[0].features[0]
    assert feat.tensors == ("input",)
    with pytest.raises(AttributeError):
        feat.freq = 5


def test_module_type_matches_base_classes(mlp_prepared):
    _, p = mlp_prepared
    layers = dqi.recorded_layers(p)
    assert set(layers) == {"fc1", "fc2", "fc3"}
    assert "Linear" in layers["fc1"].module_types and layers["fc1"].info.module_type == "Linear"


def test_session_runs_nothing_when_config_is_bad(mlp_prepared):
    _, p = mlp_prepared
    x = torch.randn(8, 16)
    before = p(x)
    _error(p, "a:\n  layers: {name_regex: zzz}\n  features: {DisableFP8: {}}\n")
    assert torch.equal(p(x), before)
