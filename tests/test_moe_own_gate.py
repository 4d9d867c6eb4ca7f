"""MoE experts modules with a gate function of their own (transformers' ``GptOssExperts``: gate / up columns
interleaved, a clamped SwiGLU ``(clamp(up) + 1)·glu(clamp(gate))``, biases on both projections) in FP8:
the gate_up grouped GEMM with its bias and no epilogue, the module's own ``_apply_gate`` in high precision on
its rows, then each row quantized with its expert's down-input scale and the down grouped GEMM with its bias and
the routing-weighted scatter-add (dbr_quant/moe/compute.py). Tiny GPT-OSS, random weights and biases.
"""

from __future__ import annotations

import contextlib
import json
import warnings

import pytest
import torch
import transformers as hf
from safetensors import safe_open
from torch import nn
from transformers.utils import logging as hf_logging

import dbr_quant as dq
from dbr_quant import fx_rewriter, kernels
from dbr_quant.formats import FP8Format
from dbr_quant.kernels.cpu import backend as cpu_backend
from dbr_quant.moe.compute import fp8_experts_compute
from dbr_quant.moe.experts import EXPERTS, OWN_GATE_NOTE, MoeState
from dbr_quant.quantize.weights import FP8Weight

hf_logging.set_verbosity_error()

VOCAB, HIDDEN, INTER, LAYERS, NUM_EXPERTS, TOP_K = 96, 32, 48, 2, 4, 2


def build() -> nn.Module:
    """A 2-layer GPT-OSS with random (non-zero) expert biases: its init zeroes them, which would hide a lost bias."""
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = hf.GptOssForCausalLM(hf.GptOssConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
            num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K, max_position_embeddings=64, initializer_range=0.05, sliding_window=8,
            layer_types=["sliding_attention", "full_attention"], pad_token_id=0)).eval()
        for experts in _experts_modules(model):
            for name in ("gate_up_proj_bias", "down_proj_bias"):
                getattr(experts, name).data.normal_(0, 0.05)
    return model


def _experts_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if type(m).__name__ == "GptOssExperts"]


def batches(n: int, shape: tuple[int, int], seed: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(1, VOCAB, shape, generator=gen)} for _ in range(n)]


@contextlib.contextmanager
def no_warnings():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


def convert(model: nn.Module, qconfig: dq.QConfig | None = None, calibrate: bool = True) -> nn.Module:
    prepared = dq.prepare(model, example_kwargs=batches(1, (1, 4), 1)[0], qconfig=qconfig)
    if calibrate:
        dq.calibrate(prepared, batches(2, (2, 16), 2), progress=False)
    return dq.convert(prepared)


@pytest.fixture(scope="module")
def converted() -> tuple[nn.Module, nn.Module]:
    model = build()
    with no_warnings():  # no weight stays high precision but the router (by design: no warning)
        return model, convert(model)


def logits(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    with torch.no_grad():
        return model(**batch).logits


# ----------------------------------------------------------------------------------------- report
def test_the_experts_are_fp8_per_expert_and_channel_and_reported_with_their_gate(converted):
    model, conv = converted
    rows = [r for r in dq.report(conv) if r["kind"] == EXPERTS]
    assert len(rows) == 2 * LAYERS and all(r["fp8"] for r in rows), rows
    assert all(r["fusion"] == f"moe_block[{NUM_EXPERTS} experts]" for r in rows)
    assert all(r["reason"] == OWN_GATE_NOTE for r in rows if r["fqn"].endswith("gate_up_proj"))
    routers = [r for r in dq.report(conv) if ".router" in r["fqn"]]
    assert routers and not any(r["fp8"] for r in routers)
    for mod, orig in zip(_experts_modules(conv), _experts_modules(model)):
        for name in ("gate_up_proj", "down_proj"):
            p, w = mod._parameters[name], orig._parameters[name]
            assert type(p) is FP8Weight and p.qdata.dtype == torch.float8_e4m3fn
            # reported as the module's own parameter ([E, in, out]); stored [E, out, in], one scale per row
            assert p.shape == w.shape and p.qdata.shape == w.transpose(1, 2).shape
            assert p.scale.shape == (NUM_EXPERTS, w.shape[2])


# ----------------------------------------------------------------------------------------- exactness
def _fp8(v: torch.Tensor) -> torch.Tensor:
    return v.clamp(-FP8Format.E4M3.max, FP8Format.E4M3.max).to(torch.float8_e4m3fn).double()


def _as_gemm_gives(v: torch.Tensor, w_q: torch.Tensor, rows: int) -> torch.Tensor:
    """A GEMM's output as the CPU backend gives it: rounded once to bf16 on its bf16 path, unless both operands
    are small enough for the exact fp32 GEMM (README, "What runs where"); fp32 rounding is below the bound."""
    a = torch.empty(rows, w_q.shape[-1])
    return v.to(torch.bfloat16).double() if cpu_backend.gemm_dtype(a, w_q) == torch.bfloat16 else v


def emulate(mod: nn.Module, st: MoeState, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The experts call in fp64 from the stored FP8 weights, the frozen activation scales and the module's own
    gate: x quantized once with the gate_up input scale, per (token, slot) ``gate_up = q(x)·Wq[e]ᵀ·sx·sw[e] + b``,
    ``h = mod._apply_gate(gate_up)``, ``y = q(h/hs[e])·W2q[e]ᵀ·hs[e]·sw2[e] + b2[e]``, summed with the routing
    weights."""
    g, d = mod.gate_up_proj, mod.down_proj
    xs, hs = (st.frozen_scale(op, "input").double() for op in st.seen_ops)
    xq = _fp8(x.double() / xs)
    ref = torch.zeros_like(x, dtype=torch.float64)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            rows = int((ids == e).sum())
            gu = _as_gemm_gives(g.qdata[e].double() @ xq[t], g.qdata[e], rows) * xs * g.scale[e].double()
            h = mod._apply_gate(gu + mod.gate_up_proj_bias[e].double())
            y = _as_gemm_gives(d.qdata[e].double() @ _fp8(h / hs[e]), d.qdata[e], rows) * hs[e] * d.scale[e].double()
            ref[t] += w[t, j].double() * (y + mod.down_proj_bias[e].double())
    return ref


def _call(model: nn.Module, mod: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[tuple, torch.Tensor]:
    seen: dict = {}
    handle = mod.register_forward_hook(lambda m, a, o: seen.update(args=a, out=o))
    try:
        logits(model, batch)
    finally:
        handle.remove()
    return seen["args"], seen["out"]


# The emulation differs from the kernels by fp32 arithmetic (accumulation ≤ K·2⁻²⁴ ≈ 3e-6 relative per GEMM at
# K ≤ 48, the gate and the combine a few 2⁻²⁴ more); measured 4.6e-6 (the model's limit), 1.0e-7 (limit 0.25).
# An FP8 rounding of h that this flipped would add one FP8 step (2⁻³ relative) on one element of a row, ~1e-3
# of the output: no flip happens here, and an expert, scale or row mixed up is off by far more.
EXACT = 1e-5


@pytest.mark.parametrize("limit", [None, 0.25], ids=["model-limit", "instance-limit"])
def test_the_experts_call_equals_a_per_expert_fp64_emulation_with_the_modules_own_gate(converted, limit):
    """Each (token, slot) row through its own expert's dequantized FP8 weights and biases, the module's own gate
    (an instance's ``limit`` changed after convert is the one the call uses: the gate is the module's), the
    quantized activations: the converted call, to fp32 accumulation."""
    model, conv = converted
    mod = _experts_modules(conv)[0]
    st = mod._auto_quant_state
    assert st.frozen_scale(st.seen_ops[1], "input").shape == (NUM_EXPERTS,)  # one down-input scale per expert
    default = mod.limit
    if limit is not None:
        mod.limit = limit
    try:
        (x, ids, w), out = _call(conv, mod, batches(1, (3, 16), 7)[0])
        ref = emulate(mod, st, x, ids, w)
    finally:
        mod.limit = default
    err = ((out.double() - ref).norm() / ref.norm()).item()
    assert err < EXACT, err
    hp = _experts_modules(model)[0](x, ids, w)  # for scale: the fp32 experts differ by a few %
    assert ((hp.double() - ref).norm() / ref.norm()).item() > 0.01
    if limit is not None:  # the clamp at 0.25 changes the result: the model's 7.0 would not pass the bound
        mod_default = emulate(mod, st, x, ids, w)
        assert ((out.double() - mod_default).norm() / mod_default.norm()).item() > 100 * EXACT


def test_an_expert_without_calibration_tokens_takes_the_max_down_scale_and_runs(close_to_reference):
    """A forward pre-hook sends expert 0's calibration rows to expert 1: expert 0 gets the largest down-input
    scale of the others (reported); later forwards that route to it run it in FP8, close to fp32."""
    model = build()
    prepared = dq.prepare(model, example_kwargs=batches(1, (1, 4), 1)[0])
    hooks = [m.register_forward_pre_hook(lambda m, a: (a[0], torch.where(a[1] == 0, 1, a[1]), a[2]))
             for m in _experts_modules(prepared)]
    dq.calibrate(prepared, batches(2, (2, 16), 2), progress=False)
    for h in hooks:
        h.remove()
    conv = dq.convert(prepared)
    for mod in _experts_modules(conv):
        st = mod._auto_quant_state
        assert st.fallback == [0]
        hs = st.frozen_scale(st.seen_ops[1], "input")
        assert hs[0] == hs[1:].max()
    downs = [r for r in dq.report(conv) if r["kind"] == EXPERTS and r["fqn"].endswith("down_proj")]
    assert all(r["reason"].startswith("1/4 experts got no calibration tokens (0)") for r in downs), downs
    batch = batches(1, (4, 16), 9)[0]
    (_, ids, _), _ = _call(conv, _experts_modules(conv)[0], batch)
    assert bool((ids == 0).any())  # expert 0 runs now
    # measured: relative error 0.0445 / 0.0412, cosine 0.99901 (calibrated on every expert: 0.0440 / 0.0431)
    close_to_fp32_experts(conv, model, batch, close_to_reference, max_rel=0.07, min_cos=0.998)


def close_to_fp32_experts(conv: nn.Module, model: nn.Module, batch: dict[str, torch.Tensor], close_to_reference,
                          *, max_rel: float, min_cos: float) -> None:
    """Each converted experts module's output against the fp32 module's on the same call (the tiny model's
    logits are dominated by its other linears' FP8 error: 0.16 relative, the experts' 0.04)."""
    for mod, orig in zip(_experts_modules(conv), _experts_modules(model)):
        (x, ids, w), out = _call(conv, mod, batch)
        with torch.no_grad():
            close_to_reference(out, orig(x, ids, w), max_rel=max_rel, min_cos=min_cos)


# ----------------------------------------------------------------------------------------- schemes
@pytest.mark.parametrize("scheme", ["dynamic", "weight_only", "mx"])
def test_the_other_schemes_run_the_gate_between_their_gemms(scheme, close_to_reference):
    """Dynamic per-token activations, weight-only FP8 and MXFP8: the experts FP8 in that scheme (reported), the
    module's gate between the GEMMs, close to fp32."""
    qconfig = {"dynamic": dq.QConfig(dynamic=True, activation=dq.TensorQConfig(granularity="token")),
               "weight_only": dq.QConfig.fp8_weight_only(), "mx": dq.QConfig.mxfp8()}[scheme]
    model = build()
    with no_warnings():
        conv = convert(model, qconfig, calibrate=False)
    rows = [r for r in dq.report(conv) if r["kind"] == EXPERTS]
    assert rows and all(r["fp8"] for r in rows)
    assert all(OWN_GATE_NOTE in r["reason"] for r in rows if r["fqn"].endswith("gate_up_proj"))
    assert all(type(m.gate_up_proj) is FP8Weight for m in _experts_modules(conv))
    # measured (relative error, cosine), worst of the two layers: dynamic 0.0403, 0.99919; weight-only 0.0285,
    # 0.99960; MX 0.0525, 0.99864 — bounds at 1.5× the error, 2× (1 − cosine)
    max_rel, min_cos = {"dynamic": (0.06, 0.998), "weight_only": (0.045, 0.999), "mx": (0.08, 0.997)}[scheme]
    close_to_fp32_experts(conv, model, batches(1, (4, 16), 9)[0], close_to_reference, max_rel=max_rel,
                          min_cos=min_cos)


def test_block_scaled_weights_keep_interleaved_experts_high_precision_and_say_why():
    with pytest.warns(UserWarning, match="interleaves them"):
        conv = convert(build(), dq.QConfig.fp8_block((16, 16)), calibrate=False)
    rows = [r for r in dq.report(conv) if r["kind"] == EXPERTS]
    assert rows and not any(r["fp8"] for r in rows)
    assert all("interleaves them (gate even rows, up odd rows)" in r["reason"] for r in rows)


# ----------------------------------------------------------------------------------------- checkpoints
def test_save_and_load_round_trip_bit_for_bit_with_gate_and_up_de_interleaved(converted, tmp_path):
    """The folder keeps each expert's gate_proj / up_proj / down_proj as Linear entries: gate_proj is the gate
    (the even rows of the stored gate_up weight, with their scales and bias), up_proj the up (odd rows);
    ``dbr_quant.json`` records the interleaving, loading interleaves them back: the same logits, bit for bit."""
    model, conv = converted
    with pytest.warns(UserWarning, match="GptOssExperts experts .gate / up interleaved. are saved per expert with "
                                         "gate_proj / up_proj de-interleaved, which transformers' from_pretrained"):
        dq.save_pretrained(conv, tmp_path)
    mod = _experts_modules(conv)[0]
    fqn = next(n for n, m in conv.named_modules() if m is mod)
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        for e in range(NUM_EXPERTS):
            for name, rows in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                prefix = f"{fqn}.{e}.{name}"
                q = f.get_tensor(f"{prefix}.weight")
                assert q.dtype == torch.float8_e4m3fn
                assert torch.equal(q.view(torch.uint8), mod.gate_up_proj.qdata[e, rows].view(torch.uint8))
                assert torch.equal(f.get_tensor(f"{prefix}.weight_scale").float().flatten(),
                                   mod.gate_up_proj.scale[e, rows].float())
                assert torch.equal(f.get_tensor(f"{prefix}.bias"), mod.gate_up_proj_bias[e, rows])
    meta = json.loads((tmp_path / "dbr_quant.json").read_text())
    assert meta["experts"][fqn]["interleaved"] is True
    batch = batches(1, (2, 11), 4)[0]
    loaded = dq.load_pretrained(tmp_path, build(), example_kwargs=batches(1, (1, 4), 1)[0])
    assert torch.equal(logits(loaded, batch), logits(conv, batch))
    lmod = _experts_modules(loaded)[0]
    for name in ("gate_up_proj", "down_proj"):
        saved, back = (m._parameters[name].qdata.view(torch.uint8) for m in (mod, lmod))
        assert torch.equal(back, saved)


def test_a_folder_saved_stacked_refuses_to_load_into_interleaved_experts(converted, tmp_path):
    _, conv = converted
    with pytest.warns(UserWarning, match="vLLM"):
        dq.save_pretrained(conv, tmp_path)
    meta_path = tmp_path / "dbr_quant.json"
    meta = json.loads(meta_path.read_text())
    for info in meta["experts"].values():
        del info["interleaved"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(Exception, match=r"experts.*saved with gate / up rows stacked \[gate; up\].*interleaved"):
        dq.load_pretrained(tmp_path, build(), example_kwargs=batches(1, (1, 4), 1)[0])


# ----------------------------------------------------------------------------------------- graphs
@pytest.mark.parametrize("scheme", ["static", "dynamic"])
def test_rewrite_and_export_run_the_gate_between_two_graph_ops_equal_to_eager(converted, scheme):
    """fx_rewriter.rewrite: each experts call is two nodes (dbr_quant::fp8_moe_gate_up, fp8_moe_down) with the
    module's gate traced between them; the graph and its torch.export give the eager converted logits, bit for
    bit."""
    model, conv = converted
    if scheme == "dynamic":
        conv = convert(model, dq.QConfig(dynamic=True, activation=dq.TensorQConfig(granularity="token")),
                       calibrate=False)
    batch = batches(1, (2, 8), 3)[0]
    eager = logits(conv, batch)
    gm = fx_rewriter.rewrite(conv, example_kwargs=batch)
    targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    assert sum("fp8_moe_gate_up" in t for t in targets) == LAYERS
    assert sum("fp8_moe_down" in t for t in targets) == LAYERS
    assert not any("fp8_moe_experts" in t for t in targets)
    exported = torch.export.export(gm, (), batch).module()
    for graph in (gm, exported):
        with torch.no_grad():
            assert torch.equal(graph(**batch)["logits"], eager)


# ----------------------------------------------------------------------------------------- backends
@pytest.mark.parametrize("static", [True, False], ids=["static", "dynamic"])
def test_the_triton_backend_runs_the_gated_experts_as_the_reference_does(converted, static):
    """No kernel of its own: the Triton grouped GEMM's no-epilogue variant (act=None, bias, high-precision
    rows; in its AOT table), the quantize kernel with one scale per row, the grouped down GEMM with per-expert
    input scales and the scatter-add — here through the experts computation, against the reference backend."""
    _, conv = converted
    mod = _experts_modules(conv)[0]
    st = mod._auto_quant_state
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, HIDDEN, generator=gen)
    ids = torch.stack([torch.randperm(NUM_EXPERTS, generator=gen)[:TOP_K] for _ in range(5)])
    weights = torch.rand(5, TOP_K, generator=gen)
    xs, hs = (st.frozen_scale(op, "input") for op in st.seen_ops) if static else (None, None)
    outs = {}
    for backend in ("triton-interpret", "reference"):
        with kernels.use_backend(backend):
            outs[backend] = fp8_experts_compute(
                x, ids, weights, mod.gate_up_proj.qdata, mod.gate_up_proj.scale, mod.down_proj.qdata,
                mod.down_proj.scale, xs, hs, mod.gate_up_proj_bias, mod.down_proj_bias, fmt=FP8Format.E4M3,
                per_token=not static, out_dtype=torch.float32, gate=mod._apply_gate)
    torch.testing.assert_close(outs["triton-interpret"], outs["reference"], rtol=1e-5, atol=1e-5)


def test_inspect_session_runs_the_modules_gate_and_equals_the_converted_model(converted):
    import dbr_quant.inspect as dqi

    _, conv = converted
    b = batches(1, (3, 9), 7)[0]
    cfg = "experts:\n  layers: {kind: experts}\n  features:\n    LogFP8Stats: {tensors: [input], stats: [sqnr_db]}\n"
    with torch.no_grad():
        want = logits(conv, b)
        with dqi.session(conv, cfg):
            got = logits(conv, b)
    assert torch.equal(got, want)
