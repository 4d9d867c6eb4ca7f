"""A converted model travels through pickle (joblib, Ray, mlflow), deepcopy and torch.save, and compiles quietly."""

from __future__ import annotations

import copy
import io
import pickle
import warnings

import pytest
import torch
from test_field import _converted
from torch import nn

import dbr_quant as dq
from dbr_quant import fx_rewriter
from dbr_quant.quantize.weights import FP8Weight, fp8_weight_of


def _pickled(obj):
    return pickle.loads(pickle.dumps(obj))


def _deepcopied(obj):
    return copy.deepcopy(obj)


def _torch_saved(obj):
    buf = io.BytesIO()
    torch.save(obj, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=False)


def _torch_saved_weights_only(obj):
    """torch.load's default since torch 2.6: only allowlisted globals are unpickled."""
    buf = io.BytesIO()
    torch.save({"w": obj}, buf)
    buf.seek(0)
    return torch.load(buf)["w"]


ROUND_TRIPS = {"pickle": _pickled, "deepcopy": _deepcopied, "torch_save": _torch_saved}
WEIGHT_TRIPS = {**ROUND_TRIPS, "torch_load_weights_only": _torch_saved_weights_only}


def _linear_stack() -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8)).eval()
    x = torch.randn(4, 16)
    c = dq.convert(dq.calibrate(dq.prepare(m, (x,)), [torch.randn(4, 16) for _ in range(3)], progress=False))
    return c, torch.randn(5, 16)


def _bert() -> tuple[nn.Module, torch.Tensor]:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    m = BertModel(BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                             intermediate_size=64, max_position_embeddings=32, attn_implementation="eager")).eval()
    ids = torch.randint(0, 64, (2, 7))
    c = dq.convert(dq.calibrate(dq.prepare(m, (ids,)), [torch.randint(0, 64, (2, 7)) for _ in range(2)],
                                progress=False))
    return c, torch.randint(0, 64, (3, 5))


def _out(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        y = model(x)
    return y if isinstance(y, torch.Tensor) else y.last_hidden_state


@pytest.mark.parametrize("trip", sorted(ROUND_TRIPS))
@pytest.mark.parametrize("build", [_linear_stack, _bert], ids=["linear_stack", "bert"])
def test_round_tripped_model_gives_bit_identical_outputs(build, trip):
    c, x = build()
    want = _out(c, x)
    c2 = ROUND_TRIPS[trip](c)
    assert c2 is not c
    fp8 = [n for n, mod in c2.named_modules() if fp8_weight_of(mod) is not None]
    assert fp8 and len(fp8) == sum(fp8_weight_of(mod) is not None for mod in c.modules())
    for n in fp8:
        a, b = fp8_weight_of(c.get_submodule(n)), fp8_weight_of(c2.get_submodule(n))
        assert isinstance(b, nn.Parameter) and not b.requires_grad
        assert torch.equal(a.qdata.view(torch.uint8), b.qdata.view(torch.uint8)) and torch.equal(a.scale, b.scale)
        assert b.qconfig == a.qconfig is not None  # an edit after loading re-quantizes with convert's rule
    assert torch.equal(_out(c2, x), want)
    assert [r["fp8"] for r in dq.report(c2)] == [r["fp8"] for r in dq.report(c)]


@pytest.mark.parametrize("trip", sorted(WEIGHT_TRIPS))
def test_round_tripped_fp8_weight_keeps_float8_bytes_scale_and_flags(trip):
    q = torch.randn(6, 4).to(torch.float8_e4m3fn)
    mse = dq.TensorQConfig(format="e5m2", observer=dq.MSE(), granularity="channel")
    for w in (FP8Weight(q, torch.rand(6) + 0.5, torch.bfloat16),  # per channel, reports bf16
              FP8Weight(q, torch.rand(6) + 0.5, torch.float32, qconfig=mse),  # carries its (frozen) config
              FP8Weight(q, torch.tensor(0.25), torch.float32, transposed=True),  # Conv1D, per tensor
              FP8Weight(q, torch.rand(3, 1) + 0.5, torch.float32, block=(2, 4)),  # 2x4 blocks
              nn.Parameter(FP8Weight(q, torch.rand(6), torch.float32), requires_grad=False)):
        w2 = WEIGHT_TRIPS[trip](w)
        assert w2.qconfig == w.qconfig
        assert type(w2) is FP8Weight and isinstance(w2, nn.Parameter) == isinstance(w, nn.Parameter)
        assert w2.qdata.dtype == torch.float8_e4m3fn and torch.equal(w2.qdata.view(torch.uint8), q.view(torch.uint8))
        assert w2.scale.dtype == torch.float32 and torch.equal(w2.scale, w.scale)
        assert (w2.dtype, w2.shape, w2.transposed, w2.block) == (w.dtype, w.shape, w.transposed, w.block)
        assert torch.equal(w2.dequantize(), w.dequantize())


@pytest.mark.parametrize("trip", ["pickle", "torch_save"])
def test_stacked_gate_up_buffer_stays_shared_and_stored_once(trip):
    _, c = _converted()
    g, u = c.gate.weight.qdata, c.up.weight.qdata
    assert g.untyped_storage().data_ptr() == u.untyped_storage().data_ptr()
    c2 = ROUND_TRIPS[trip](c)
    g2, u2 = c2.gate.weight, c2.up.weight
    assert g2.qdata.untyped_storage().data_ptr() == u2.qdata.untyped_storage().data_ptr()
    assert g2.scale.untyped_storage().data_ptr() == u2.scale.untyped_storage().data_ptr()
    assert g2.qdata.untyped_storage().nbytes() == g.untyped_storage().nbytes()  # the buffer, not one per weight
    x = torch.randn(2, 5, 16)
    assert torch.equal(_out(c2, x), _out(c, x))


def _compile_warnings(fn) -> list[str]:
    """Messages warned while ``fn`` compiles and runs (torch warns this once per process: forget it first)."""
    from torch._dynamo.utils import warn_once_cache

    saved = set(warn_once_cache)
    warn_once_cache.clear()
    torch._dynamo.reset()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
    finally:
        warn_once_cache.clear()
        warn_once_cache.update(saved)
        torch._dynamo.reset()
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("target", ["eager_converted", "rewritten"])
def test_compile_does_not_warn_about_stable_hash(target):
    c, x = _linear_stack()
    module = c if target == "eager_converted" else fx_rewriter.rewrite(c, (x,))
    got = {}

    def run():
        with torch.no_grad():
            got["out"] = torch.compile(module)(x)

    messages = _compile_warnings(run)
    assert not [m for m in messages if "_stable_hash_for_caching" in m], messages
    want = _out(c, x)
    assert got["out"].shape == want.shape and torch.allclose(got["out"], want, rtol=0.05, atol=0.05)


def test_stable_hash_is_metadata_and_deterministic():
    q = torch.randn(6, 4).to(torch.float8_e4m3fn)
    w = FP8Weight(q, torch.rand(6), torch.float32)
    h = w._stable_hash_for_caching()
    assert h == FP8Weight(q.clone(), torch.rand(6), torch.float32)._stable_hash_for_caching()  # values: inputs
    assert h == _pickled(w)._stable_hash_for_caching()
    others = [FP8Weight(q, torch.rand(6), torch.bfloat16), FP8Weight(q, torch.tensor(1.0), torch.float32),
              FP8Weight(q, torch.rand(3, 1), torch.float32, block=(2, 4)),
              FP8Weight(q, torch.rand(6), torch.float32, transposed=True),
              FP8Weight(q.to(torch.float32).to(torch.float8_e5m2), torch.rand(6), torch.float32)]
    assert len({h} | {o._stable_hash_for_caching() for o in others}) == 1 + len(others)


def test_unpickled_model_compiles_before_and_after_its_first_eager_call(monkeypatch):
    """A converted model unpickled in a new process has no torch.compiler.disable'd entry yet (it is made when
    an entry forward is installed, which that process never did): compiled first, it is traced into as before
    that entry existed (no IndexError inside Dynamo) and the run makes the entry; a compile then runs the FP8
    ops eagerly. Both give the eager outputs."""
    model, x = _linear_stack()
    loaded = _pickled(model)
    monkeypatch.setattr(dq.api, "_EAGER_ENTRY", [])  # the state of a fresh process
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            expected = model(x)
            assert torch.equal(torch.compile(loaded)(x), expected)  # traced into the run, which makes the entry
            assert len(dq.api._EAGER_ENTRY) == 1
            assert torch.equal(loaded(x), expected)
            torch._dynamo.reset()
            assert torch.equal(torch.compile(loaded)(x), expected)
    finally:
        torch._dynamo.reset()
