"""Block-scaled FP8 end to end: ``TensorQConfig(granularity="block")`` weights (one scale per bn×bk tile, the
compressed-tensors FP8_BLOCK / FineGrainedFP8 layout) and ``"group"`` dynamic activations (one scale per token per
bk channels) through prepare → convert → the block kernels, on dimensions that are not multiples of the block.

Expected values come from outside the code under test: block scales from a Python loop over the blocks (amax/448),
outputs from the fp32 model, the fused path from the same model with ``fuse=False`` (every op on its own), and the
checkpoint layout from transformers' own FineGrainedFP8 dequantizer.
"""

from __future__ import annotations

import copy
import io
import math
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dbr_quant as dq
from dbr_quant.kernels.cpu import backend as cpu_backend
from dbr_quant.kernels.reference import block as RB
from dbr_quant.ops.tags import tag_of
from dbr_quant.quantize.weights import FP8Weight, adjacent_rows, fp8_weight_bytes, fp8_weight_of

D, HIDDEN, GATED = 200, 300, 136  # none a multiple of 128 (nor of 32 / 48): every edge block is ragged
BLOCKS = [(128, 128), (48, 32)]


class Block(nn.Module):
    """LayerNorm → fc1 → gelu → fc2 (+ residual), RMSNorm → gate/up → silu·up → down (+ residual), a head."""

    def __init__(self) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(D), nn.RMSNorm(D)
        self.fc1, self.fc2 = nn.Linear(D, HIDDEN), nn.Linear(HIDDEN, D)
        self.gate, self.up = nn.Linear(D, GATED, bias=False), nn.Linear(D, GATED, bias=False)
        self.down = nn.Linear(GATED, D, bias=False)
        self.head = nn.Linear(D, 72)

    def forward(self, x):
        x = x + self.fc2(F.gelu(self.fc1(self.norm1(x))))
        h = self.norm2(x)
        x = x + self.down(F.silu(self.gate(h)) * self.up(h))
        return self.head(x)


def _model(seed: int = 0) -> Block:
    torch.manual_seed(seed)
    m = Block().eval()
    with torch.no_grad():  # outlier input channels: what block scales are for
        m.fc1.weight.mul_(torch.exp(torch.randn(1, D)))
    return m


def _x(*shape, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, D, generator=g) * 2


def _convert(m: nn.Module, qc: dq.QConfig, calib: int = 2) -> nn.Module:
    p = dq.prepare(m, (_x(2, 5),), qc)
    dq.calibrate(p, [(_x(3, 6, seed=10 + i),) for i in range(calib)], progress=False)
    return dq.convert(p)


def loop_block_scale(w: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """amax/448 of every bn×bk block by explicit loops (edge blocks: their real elements only)."""
    n, k = w.shape
    out = torch.empty(math.ceil(n / bn), math.ceil(k / bk))
    for i in range(out.shape[0]):
        for j in range(out.shape[1]):
            amax = w[i * bn:(i + 1) * bn, j * bk:(j + 1) * bk].abs().max()
            out[i, j] = amax / 448.0 if amax > 0 else 1.0
    return out


# ----------------------------------------------------------------------------------------- config
@pytest.mark.parametrize("kwargs, match", [
    (dict(activation=dq.TensorQConfig(granularity="group"), weight=dq.TensorQConfig(granularity="block")),
     "set dynamic=True"),
    (dict(activation=dq.TensorQConfig(granularity="group"), dynamic=True), "needs weight granularity 'block'"),
    (dict(activation=dq.TensorQConfig(granularity="group", group_size=64), dynamic=True,
          weight=dq.TensorQConfig(granularity="block")), r"group size \(64\) must equal"),
    (dict(weight=dq.TensorQConfig(granularity="group")), "weights take granularity"),
    (dict(weight=dq.TensorQConfig(granularity="token")), "weights take granularity"),
    (dict(activation=dq.TensorQConfig(granularity="block")), "activations take granularity"),
])
def test_invalid_combinations_are_refused_with_a_reason(kwargs, match):
    with pytest.raises(ValueError, match=match):
        dq.QConfig(**kwargs)


def test_block_settings_are_validated_where_written():
    with pytest.raises(ValueError, match="TensorQConfig.block must be two positive ints"):
        dq.TensorQConfig(granularity="block", block=(128, 0))
    with pytest.raises(ValueError, match="group size must be a positive int"):
        dq.TensorQConfig(granularity="group", group_size=-1)
    with pytest.raises(ValueError, match="observer MSE is not supported"):
        dq.TensorQConfig(granularity="block", observer=dq.MSE())
    with pytest.raises(ValueError, match=r"Override\(pattern='fc1'.*needs weight granularity 'block'"):
        dq.QConfig(dynamic=True, overrides=(dq.Override(pattern="fc1",
                                                        activation=dq.TensorQConfig(granularity="group")),))
    assert dq.TensorQConfig(granularity="block", block=[64, 32]).block == (64, 32)  # frozen, hashable
    qc = dq.QConfig.fp8_block((64, 32))
    assert (qc.weight.granularity, qc.weight.block, qc.activation.granularity, qc.activation.group_size,
            qc.dynamic) == ("block", (64, 32), "group", 32, True)
    # block weights with static per-tensor or dynamic per-token activations are allowed (scale repeated per group)
    dq.QConfig(weight=dq.TensorQConfig(granularity="block"))
    dq.QConfig(weight=dq.TensorQConfig(granularity="block"), activation=dq.TensorQConfig(granularity="token"),
               dynamic=True)


# ----------------------------------------------------------------------------------------- convert
@pytest.mark.parametrize("block", BLOCKS)
def test_convert_stores_fp8_block_weights_and_runs_the_block_kernels(block, close_to_reference):
    m = _model()
    c = _convert(m, dq.QConfig.fp8_block(block))
    rows = dq.report(c)
    assert all(r["fp8"] for r in rows) and len(rows) == 6
    assert {r["fusion"] for r in rows} == {"norm_linear", "norm_gated_mlp", None}
    bn, bk = block
    for name in ("fc1", "fc2", "gate", "up", "down", "head"):
        w, orig = getattr(c, name).weight, getattr(m, name).weight.detach()
        assert isinstance(w, FP8Weight) and w.block == block and w.dtype == torch.float32 and w.shape == orig.shape
        n, k = orig.shape
        assert w.scale.shape == (math.ceil(n / bn), math.ceil(k / bk))
        torch.testing.assert_close(w.scale, loop_block_scale(orig, bn, bk), rtol=0, atol=0)
        per_elem = w.scale.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        assert torch.equal(w.dequantize(), w.qdata.float() * per_elem) and torch.equal(w.float(), w.dequantize())
        assert torch.all((w.dequantize() - orig).abs() <= orig.abs() * 2.0**-4 + per_elem * 2.0**-10)
    # gate and up: adjacent rows of one [gate; up] buffer, scales [gate blocks; up blocks]
    assert adjacent_rows(c.gate.weight.qdata, c.up.weight.qdata) is not None
    assert adjacent_rows(c.gate.weight.scale, c.up.weight.scale).shape == (2 * math.ceil(GATED / bn),
                                                                           math.ceil(D / bk))
    x = _x(4, 9)  # other shape than the trace
    with dq.kernels.count_launches() as counts, torch.no_grad():
        out = c(x)
        ref = m(x)
    # norm+group-quantize ×2, fc1, fc2 (its input group-quantized), [gate|up], down, head (group-quantized inputs)
    assert dict(counts) == {"norm_group_quantize": 2, "fp8_block_linear": 5, "group_quantize": 3}
    close_to_reference(out, ref, min_cos=0.999, max_rel=0.06)  # measured rel 0.040 / 0.038


@pytest.mark.parametrize("static", [False, True])
def test_fused_subgraphs_equal_the_ops_one_by_one(static, close_to_reference):
    """Block weights with group activations (dynamic) or calibrated per-tensor activations (static, the
    FineGrainedFP8 "static" scheme): norm fusions and the FP8 hand-off between GEMMs change nothing."""
    m = _model()
    qc = dq.QConfig(weight=dq.TensorQConfig(granularity="block", block=(48, 32))) if static else \
        dq.QConfig.fp8_block((48, 32))
    fused = _convert(m, qc)
    single = _convert(m, dq.QConfig(weight=qc.weight, activation=qc.activation, dynamic=qc.dynamic, fuse=False))
    assert {r["fusion"] for r in dq.report(single)} == {None}
    x = _x(3, 4)
    with dq.kernels.count_launches() as counts, torch.no_grad():
        out = fused(x)
    if static:  # norm + quantize, fc1 writes FP8 for fc2; norm + quantize, [gate|up] writes FP8 for down; head
        assert dict(counts) == {"norm_quantize": 2, "fp8_block_linear": 5, "quantize": 1}
    with torch.no_grad():
        assert torch.equal(out, single(x))
        close_to_reference(out, m(x), min_cos=0.999, max_rel=0.06)


def test_state_dict_holds_weight_and_2d_weight_scale_and_loads_back():
    m = _model()
    c = _convert(m, dq.QConfig.fp8_block())
    sd = c.state_dict()
    assert sd["fc1.weight"].dtype == torch.float8_e4m3fn and sd["fc1.weight"].shape == (HIDDEN, D)
    assert sd["fc1.weight_scale"].dtype == torch.float32 and sd["fc1.weight_scale"].shape == (3, 2)
    assert sd["gate.weight_scale"].shape == sd["up.weight_scale"].shape == (2, 2)
    assert sd["down.weight_scale"].shape == (2, 2) and sd["head.weight_scale"].shape == (1, 2)
    # compressed-tensors' own FP8_BLOCK code reads our tensors as we do (ragged edge blocks included), and
    # quantizing the original weight with our scales gives our bytes
    ct = pytest.importorskip("compressed_tensors.quantization.lifecycle.forward")
    from compressed_tensors.quantization import QuantizationArgs

    args = QuantizationArgs(num_bits=8, type="float", strategy="block", block_structure=[128, 128], symmetric=True,
                            dynamic=False)
    for name in ("fc1", "gate", "up", "head"):
        q, s = sd[f"{name}.weight"], sd[f"{name}.weight_scale"]
        assert torch.equal(ct.dequantize(q, s, args=args, dtype=torch.float32), getattr(c, name).weight.dequantize())
        theirs = ct.quantize(getattr(m, name).weight.detach(), s, torch.zeros_like(s), args=args, dtype=q.dtype)
        assert (theirs.float() != q.float()).float().mean() < 1e-3  # x/s vs x·(1/s): an ulp apart at most
    # a fresh converted model loads it back (through torch.save) and computes the same
    buf = io.BytesIO()
    torch.save(sd, buf)
    buf.seek(0)
    c2 = _convert(_model(seed=5), dq.QConfig.fp8_block())
    c2.load_state_dict(torch.load(buf))
    x = _x(2, 3)
    with torch.no_grad():
        assert torch.equal(c2(x), c(x))
    # a per-channel scale does not load into a block weight: the error names the tensor and both shapes
    bad = dict(sd)
    bad["fc1.weight_scale"] = torch.ones(HIDDEN)
    with pytest.raises(RuntimeError, match=r"fc1.weight: the checkpoint holds .* with scale \[300\].* scale \[3, 2\]"):
        c2.load_state_dict(bad)


def test_bytes_count_fp8_data_and_block_scales():
    m = _model()
    c = _convert(m, dq.QConfig.fp8_block())
    want = sum(w.numel() + 4 * math.ceil(w.shape[0] / 128) * math.ceil(w.shape[1] / 128)
               for w in (getattr(m, n).weight for n in ("fc1", "fc2", "gate", "up", "down", "head")))
    assert fp8_weight_bytes(c) == want
    channel = _convert(m, dq.QConfig(dynamic=True))
    assert fp8_weight_bytes(c) < fp8_weight_bytes(channel)  # 4 bytes per 128×128 block vs per row


def test_dtype_moves_copies_and_pickles_keep_block_scales(close_to_reference):
    m = _model()
    c = _convert(m, dq.QConfig.fp8_block((48, 32)))
    q0, s0 = c.fc1.weight.qdata.clone(), c.fc1.weight.scale.clone()
    x = _x(2, 3)
    with torch.no_grad():
        out32 = c(x)
    b = copy.deepcopy(c).to(torch.bfloat16)
    w = b.fc1.weight
    assert isinstance(w, FP8Weight) and w.dtype == torch.bfloat16 and w.block == (48, 32)
    assert torch.equal(w.qdata.view(torch.uint8), q0.view(torch.uint8)) and torch.equal(w.scale, s0)
    assert w.scale.dtype == torch.float32
    assert adjacent_rows(b.gate.weight.scale, b.up.weight.scale) is not None  # the stacked pair stays stacked
    with torch.no_grad():
        out16 = b(x.bfloat16())
    assert out16.dtype == torch.bfloat16
    close_to_reference(out16.float(), out32, min_cos=0.999, max_rel=0.04)
    buf = io.BytesIO()
    torch.save(c, buf)
    buf.seek(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = torch.load(buf, weights_only=False)
    assert fp8_weight_of(loaded.fc1).block == (48, 32)
    flat, ctx = c.fc1.weight.__tensor_flatten__()
    assert ctx[-1] == (48, 32)
    with torch.no_grad():
        assert torch.equal(loaded(x), out32)
        with dq.disabled():  # high precision = the dequantized block weights
            hp = c(x)
    close_to_reference(hp, m(x), min_cos=0.999, max_rel=0.05)  # measured rel 0.029: the FP8 weights alone


def test_functional_linear_quantizes_its_weight_per_call_in_blocks():
    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.randn(70, D))

        def forward(self, x):
            return F.linear(x, self.w)

    m = Functional().eval()
    c = _convert(m, dq.QConfig.fp8_block((32, 64)))
    x = _x(2, 3)
    w_q, w_s = RB.block_quantize_weight(m.w.detach(), (32, 64))
    x_q, x_s = RB.group_quantize(x, 64)
    with torch.no_grad():
        assert torch.equal(c(x), cpu_backend.fp8_block_linear(x_q, x_s, w_q, w_s, block=(32, 64)))


def test_many_threads_get_the_single_threaded_outputs():
    c = _convert(_model(), dq.QConfig.fp8_block((48, 32)))
    xs = [_x(1 + i % 3, 1 + (i * 5) % 7, seed=100 + i) for i in range(6)]
    with torch.no_grad():
        want = [c(x) for x in xs]
    got: dict[int, list] = {}
    errors = []
    barrier = threading.Barrier(4)

    def work(t):
        try:
            barrier.wait()
            with torch.no_grad():
                got[t] = [(i, c(xs[i])) for i in [*range(t, len(xs)), *range(t)]]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert not errors, errors
    for results in got.values():
        for i, out in results:
            assert torch.equal(out, want[i])


@pytest.mark.parametrize("static", [False, True])
def test_rewritten_graph_runs_the_block_ops_and_equals_eager(static):
    from dbr_quant.fx_rewriter import rewrite

    qc = dq.QConfig(weight=dq.TensorQConfig(granularity="block", block=(48, 32))) if static else \
        dq.QConfig.fp8_block((48, 32))
    c = _convert(_model(), qc)
    g = rewrite(c)
    ops = [n.target._name for n in g.graph.nodes if n.op == "call_function" and hasattr(n.target, "_name")
           and n.target._name.startswith("dbr_quant::")]
    assert ops.count("dbr_quant::fp8_block_linear") == 5 and "dbr_quant::fp8_linear" not in ops
    assert ops.count("dbr_quant::layer_norm_quantize" if static else "dbr_quant::layer_norm_group_quantize") == 2
    with torch.no_grad():
        for x in (_x(2, 5), _x(3, 8, seed=7)):  # the traced shape and another
            assert torch.equal(g(x), c(x))


def test_inspect_features_run_on_block_layers():
    """Block layers under inspect features (full checks: tests/inspect/test_inspect_block.py)."""
    import dbr_quant.inspect as dqi

    p = dq.prepare(_model(), (_x(2, 5),), dq.QConfig.fp8_block())
    config = "all:\n  layers: {name_regex: 'fc1'}\n  features:\n    LogFP8Stats: {tensors: [input]}\n"
    x = _x(2, 5)
    with dqi.session(p, config) as s:
        y = p(x)
    assert torch.equal(y, dq.convert(p)(x))  # logging only: what the converted model's block kernels give
    stats = {r["stat"] for r in s.records if r["layer"] == "fc1"}
    assert {"scale_min", "scale_max", "sqnr_db"} <= stats


@pytest.mark.parametrize("family, block, min_cos", [
    # measured output cosine vs fp32 on real tokens: bert 0.99896 (128×128), gpt2 0.99821, llama 0.99686 (32×32);
    # per-channel/per-token on the same: 0.99918, 0.99804, 0.99673 (benchmarks/block_accuracy.py)
    ("bert", (128, 128), 0.998), ("gpt2", (32, 32), 0.996), ("llama", (32, 32), 0.993)])
def test_hf_families_run_block_scaled(family, block, min_cos):
    """BERT, GPT-2 (Conv1D: weights stored transposed) and Llama (RMSNorm → stacked gate|up) of the suite."""
    import test_hf_models as hf  # tests/ is on sys.path (pytest's rootdir-relative import)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = hf.run_pipeline(family, qconfig=dq.QConfig.fp8_block(block))
    linears = hf.linear_fqns(p.model)
    assert all(r["fp8"] for r in dq.report(p.converted) if r["kind"] == "linear")
    stacked = 0
    for fqn in linears:
        m = p.converted.get_submodule(fqn)
        w, (n, k) = fp8_weight_of(m), hf.out_in(m)
        assert w.block == block and w.qdata.shape == (n, k)
        assert w.scale.shape == (math.ceil(n / block[0]), math.ceil(k / block[1])), fqn
        stacked += tag_of(m).stacked_after is not None
    assert stacked == (hf.LAYERS if family == "llama" else 0)
    with dq.kernels.count_launches() as counts:
        out, ref = hf.forward(p.converted, p.eval_batch), hf.forward(p.model, p.eval_batch)
    assert counts["fp8_block_linear"] == len(linears) - stacked and "fp8_linear" not in counts
    keep = p.eval_batch["attention_mask"].bool()
    field = p.spec.outputs[0]
    hf.assert_close(out[field][keep], ref[field][keep], min_cos, family)  # cosine and norm ratio (scale)
