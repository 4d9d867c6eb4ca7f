"""A rewritten graph under ``torch.autocast`` computes what the eager converted model computes under it.

The rule (kernels/autocast.py) is written once: each FP8 kernel runs with autocast off, and a GEMM kernel's result
takes the dtype autocast gives the linear / matmul / SDPA it replaces (a fused residual promoted with it). The eager
model applies it to its kernels; the graph's ``dbr_quant::`` ops carry it as their Autocast kernel. So under the same
autocast both give the fp32 model's output dtypes and the same bits (they run the same kernels: the launch counts
are compared too). Before, the graph kept its capture dtype (a plain linear returned float32 where the fp32 model
returns bfloat16) or failed outright (``Tensor dtype mismatch`` from the dtype check export put after SDPA).
"""

from __future__ import annotations

import pytest
import test_moe_own_gate as oss
import torch
import torch.nn.functional as F
from test_hf_models import run_pipeline  # tests/ is on sys.path (conftest)
from test_moe import batches, pipeline
from test_moe_schemes import rope_as_captured
from test_oplib import linear_inputs
from torch import nn
from torch.utils._pytree import tree_flatten

import dbr_quant as dq
from dbr_quant import kernels
from dbr_quant.fx_rewriter import rewrite
from dbr_quant.fx_rewriter.oplib import OPS

OP = torch.ops.dbr_quant
D = 32
DTYPES = [torch.bfloat16, torch.float16]


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(D, 48)

    def forward(self, x):
        return self.fc(x)


class LinearBiasGelu(Linear):
    def forward(self, x):
        return F.gelu(self.fc(x))


class NormLinear(Linear):
    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)

    def forward(self, x):
        return self.fc(self.ln(x))


class Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(D, 64), nn.Linear(64, D)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class Attention(nn.Module):
    """norm → qkv → SDPA → o + residual (quantize_attention: SDPA in FP8 too)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln, self.qkv, self.o = nn.LayerNorm(D), nn.Linear(D, 3 * D), nn.Linear(D, D)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (y.view(b, t, 4, -1).transpose(1, 2) for y in self.qkv(self.ln(x)).split(d, -1))
        return x + self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, d))


TOYS = {"linear": Linear, "linear_bias_gelu": LinearBiasGelu, "norm_linear": NormLinear, "mlp": Mlp,
        "attention": Attention}


def _toy(name: str) -> tuple[nn.Module, nn.Module, torch.fx.GraphModule]:
    torch.manual_seed(0)
    model = TOYS[name]().eval()
    qconfig = dq.QConfig(quantize_attention=name == "attention")
    prepared = dq.prepare(model, (torch.randn(2, 5, D),), qconfig)
    dq.calibrate(prepared, [torch.randn(2, 5, D) for _ in range(3)], progress=False)
    converted = dq.convert(prepared)
    return model, converted, rewrite(converted)


def _leaves(out) -> list[torch.Tensor]:
    return [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]


def _under(dtype: torch.dtype | None, fn, *args, **kwargs):
    """``fn(...)`` under no_grad and cpu autocast to ``dtype`` (None: no autocast), with its kernel launches."""
    with torch.no_grad(), torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None), \
            kernels.count_launches() as counts:
        out = fn(*args, **kwargs)
    return _leaves(out), dict(counts)


def _assert_graph_follows_autocast(model, converted, gm, dtype, *args, **kwargs) -> None:
    """Output dtypes: the fp32 model's under autocast; graph = eager bit for bit, with the same kernels."""
    want, _ = _under(dtype, model, *args, **kwargs)
    eager, eager_launches = _under(dtype, converted, *args, **kwargs)
    graph, graph_launches = _under(dtype, gm, *args, **kwargs)
    assert [t.dtype for t in eager] == [t.dtype for t in graph] == [t.dtype for t in want]
    assert eager_launches == graph_launches
    for e, g in zip(eager, graph):
        assert torch.equal(e, g)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("name", list(TOYS))
def test_toy_graphs_follow_autocast_as_eager_does(name, dtype):
    model, converted, gm = _toy(name)
    for shape in [(2, 5, D), (3, 9, D)]:
        _assert_graph_follows_autocast(model, converted, gm, dtype, torch.randn(shape))


def test_a_linear_under_autocast_is_its_exact_result_cast():
    """The kernels run with autocast off: the graph's linear is its own result without autocast, then cast."""
    _, _, gm = _toy("linear")
    x = torch.randn(4, 7, D)
    (plain,), _ = _under(None, gm, x)
    for dtype in DTYPES:
        (got,), _ = _under(dtype, gm, x)
        assert torch.equal(got, plain.to(dtype))


@pytest.mark.parametrize("name", ["mlp", "attention"])
def test_eager_keeps_its_fusions_under_autocast(name):
    """Under autocast the eager model runs the kernels it runs without (its fusions, as the graph has them: the
    MLP is one fp8_mlp node), where it used to run every recorded op alone."""
    _, converted, gm = _toy(name)
    x = torch.randn(2, 5, D)
    assert _under(torch.bfloat16, converted, x)[1] == _under(None, converted, x)[1]
    if name == "mlp":
        assert any(n.target is OP.fp8_mlp.default for n in gm.graph.nodes)


@pytest.mark.parametrize("name", ["llama", "bert"])
def test_hf_models_follow_autocast(name, monkeypatch):
    p = run_pipeline(name)
    gm = rewrite(p.converted, example_kwargs=p.eval_batch)
    if name == "llama":
        rope_as_captured(monkeypatch, "llama")
    _assert_graph_follows_autocast(p.model, p.converted, gm, torch.bfloat16, **p.eval_batch)


def test_mixtral_follows_autocast(monkeypatch):
    """The MoE experts block keeps the hidden states' dtype, as transformers' experts modules do under autocast
    (they accumulate in it), and equals its result without autocast: its kernels run with autocast off."""
    model, _, converted = pipeline("mixtral", "eager")
    gm = rewrite(converted, example_kwargs=batches(1, (2, 5), 9)[0])
    ev = batches(1, (3, 7), 5)[0]
    rope_as_captured(monkeypatch, "mixtral")
    _assert_graph_follows_autocast(model, converted, gm, torch.bfloat16, **ev)
    experts = converted.model.layers[0].mlp.experts
    x = torch.randn(6, experts.gate_up_proj.shape[-1])
    ids, w = torch.randint(0, experts.num_experts, (6, 2)), torch.rand(6, 2)
    (plain,), _ = _under(None, experts, x, ids, w)
    (got,), _ = _under(torch.bfloat16, experts, x, ids, w)
    assert got.dtype == torch.float32 and torch.equal(got, plain)


def test_gpt_oss_experts_with_their_own_gate_follow_autocast(monkeypatch):
    """GPT-OSS experts: two graph ops with the module's own gate traced between them (moe_ops.py). Output dtypes
    are the fp32 model's and the kernels the same. Not the same bits: GPT-OSS's router computes
    ``softmax(top_values, dtype=top_values.dtype)``, a dtype read in Python, which a graph holds as the capture's
    float32 (eager under autocast: bfloat16 routing weights); so graph and eager differ by less than autocast's
    own rounding does (eager with against without autocast)."""
    model = oss.build()
    converted = oss.convert(model)
    gm = rewrite(converted, example_kwargs=oss.batches(1, (2, 8), 3)[0])
    rope_as_captured(monkeypatch, "gpt_oss")
    batch = oss.batches(1, (3, 6), 5)[0]
    want, _ = _under(torch.bfloat16, model, **batch)
    (eager,), eager_launches = _under(torch.bfloat16, converted, **batch)
    (graph,), graph_launches = _under(torch.bfloat16, gm, **batch)
    (plain,), _ = _under(None, converted, **batch)
    assert eager.dtype == graph.dtype == want[0].dtype and eager_launches == graph_launches
    rel = lambda a, b: ((a.double() - b.double()).norm() / b.double().norm()).item()  # noqa: E731
    assert rel(graph, eager) < rel(eager, plain), (rel(graph, eager), rel(eager, plain))


@pytest.mark.parametrize("name", ["linear", "attention"])
def test_compiled_graph_follows_autocast_without_graph_breaks(name, close_to_reference):
    """``torch.compile(gm, fullgraph=True)`` under autocast: the Autocast kernels run while it traces, so its graph
    holds each op and then a cast; the same compiled module outside autocast recompiles to float32."""
    _, converted, gm = _toy(name)
    compiled = torch.compile(gm, fullgraph=True)
    x = torch.randn(2, 5, D)
    for dtype in [torch.bfloat16, None]:
        (eager,), _ = _under(dtype, converted, x)
        (got,), _ = _under(dtype, compiled, x)
        assert got.dtype == eager.dtype
        close_to_reference(got.float(), eager.float(), min_cos=0.9999, max_rel=0.01)


def test_export_follows_autocast_inside_the_program_and_at_run_time():
    """``torch.export`` ignores an autocast region around the export call (it records the program, not the
    caller's state); the exported program follows autocast when it runs, as the graph does. An autocast region
    inside the exported forward is captured (``wrap_with_autocast``); decomposed, it is the ops and their casts."""
    _, converted, gm = _toy("attention")
    x = torch.randn(2, 5, D)
    (want,), _ = _under(torch.bfloat16, gm, x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ep = torch.export.export(gm, (x,))
    (at_run_time,), _ = _under(torch.bfloat16, ep.module(), x)
    assert torch.equal(at_run_time, want)

    class Autocast(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return self.inner(x)

    inside = torch.export.export(Autocast(gm), (x,)).run_decompositions()
    casts = [n for n in inside.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert casts, inside.graph
    (got,), _ = _under(None, inside.module(), x)
    assert torch.equal(got, want)


def test_every_op_has_autocast_kernels_and_cuda_fp16_follows_the_rule():
    """The AutocastCUDA kernel's logic on CPU tensors (autocast's CUDA state set by hand, the key dispatched to):
    a GEMM result in float16, with a float32 residual float32, an FP8 result and a quantize unchanged."""
    for name in OPS:
        for key in ("AutocastCPU", "AutocastCUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dbr_quant::{name}", key), (name, key)
    xq, sx, wq, sw, b = linear_inputs(torch.Generator().manual_seed(0))
    residual = torch.randn(3, 8)
    cuda = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA)
    plain = OP.fp8_linear(xq, sx, wq, sw, b, "gelu", None, torch.float32, None, "e4m3")
    with_residual = OP.fp8_linear(xq, sx, wq, sw, b, "", residual, torch.float32, None, "e4m3")
    fp8_out = OP.fp8_linear(xq, sx, wq, sw, b, "", None, torch.float32, torch.tensor(0.05), "e4m3")
    x = torch.randn(3, 16)
    quantized = OP.quantize(x, sx, "e4m3")
    was = torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.float16)
    try:
        got = OP.fp8_linear.default.redispatch(cuda, xq, sx, wq, sw, b, "gelu", None, torch.float32, None, "e4m3")
        got_residual = OP.fp8_linear.default.redispatch(cuda, xq, sx, wq, sw, b, "", residual, torch.float32, None,
                                                         "e4m3")
        got_fp8 = OP.fp8_linear.default.redispatch(cuda, xq, sx, wq, sw, b, "", None, torch.float32,
                                                    torch.tensor(0.05), "e4m3")
        got_quantized = OP.quantize.default.redispatch(cuda, x, sx, "e4m3")
    finally:
        torch.set_autocast_enabled("cuda", False)
        torch.set_autocast_dtype("cuda", was)
    assert got.dtype == torch.float16 and torch.equal(got, plain.half())
    assert got_residual.dtype == torch.float32 and torch.equal(got_residual, with_residual)
    assert got_fp8.dtype == torch.float8_e4m3fn and torch.equal(got_fp8.float(), fp8_out.float())
    assert torch.equal(got_quantized.float(), quantized.float())


@pytest.mark.parametrize("rms", [False, True])
def test_cuda_autocast_runs_a_fused_layer_norm_in_float32(rms):
    """CUDA's autocast runs ``layer_norm`` in float32 (its fp32 op list; the CPU's does not): the fused LayerNorm +
    quantize op on a float16 input gives what it gives on the float32 input; an RMSNorm (a module as written, not
    an autocast op) stays as it is."""
    gen = torch.Generator().manual_seed(2)
    x, bias = torch.randn(4, 16, generator=gen), torch.randn(16, generator=gen)
    weight = torch.rand(16, generator=gen) + 0.5
    scale = x.abs().amax() / 448
    args = (weight, bias, 1e-5, scale, "e4m3", rms)
    half = x.half()
    want = OP.layer_norm_quantize(half if rms else half.float(), *args)  # LayerNorm: float32 math on the values
    was = torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.float16)
    try:
        got = OP.layer_norm_quantize.default.redispatch(
            torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCUDA), half, *args)
    finally:
        torch.set_autocast_enabled("cuda", False)
        torch.set_autocast_dtype("cuda", was)
    assert got[0].dtype == want[0].dtype and torch.equal(got[0], want[0])
    assert torch.equal(got[1].float(), want[1].float())
