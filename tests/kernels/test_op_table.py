"""The kernel op table (kernels/table.py): every declaration's output rule (the fake a traced graph runs)
agrees with what the reference kernel returns, and every function generated from it (entry point, Triton
forwarding, graph op, capture-time entry) has the declared signature."""

import contextlib
import inspect
import threading

import pytest
import torch

import dbr_quant  # noqa: F401  (defines the dbr_quant:: ops)
from dbr_quant import kernels
from dbr_quant.formats import FP8Format
from dbr_quant.fx_rewriter.oplib import OPS
from dbr_quant.fx_rewriter.ops import GraphOps
from dbr_quant.kernels import dispatch
from dbr_quant.kernels.cpu import backend as cpu_backend
from dbr_quant.kernels.reference import dense
from dbr_quant.kernels.table import TABLE
from dbr_quant.kernels.triton import backend as triton_backend

E4M3, E5M2 = FP8Format.E4M3, FP8Format.E5M2
BY_NAME = {op.name: op for op in TABLE}


def fp8(*shape, gen, fmt=E4M3):
    return (torch.randn(shape, generator=gen) * 4).clamp(-fmt.max, fmt.max).to(fmt.dtype)


def examples():
    """(kernel, args, kwargs) covering each kernel's output cases (FP8 or high-precision out, gated, combined)."""
    g = torch.Generator().manual_seed(0)
    s = torch.tensor(0.05)
    x = torch.randn(2, 3, 16, generator=g)
    xq, wq, w2q = fp8(3, 16, gen=g), fp8(8, 16, gen=g), fp8(16, 4, gen=g)
    routing = kernels.moe_route(torch.tensor([[0, 2], [1, 2], [2, 0], [0, 1]]), 3)
    eq, ew, eb = fp8(4, 16, gen=g), fp8(3, 8, 16, gen=g), fp8(8, 16, gen=g)
    topk = torch.rand(4, 2, generator=g)
    norm = (torch.randn(16, generator=g), torch.randn(16, generator=g), 1e-5)
    q4 = lambda *shape: fp8(*shape, gen=g)  # noqa: E731
    return [
        ("quantize", (x, s, E5M2), {}),
        ("dynamic_quantize", (x, E4M3), {}),
        ("dynamic_quantize", (x, E4M3, True), {}),
        ("dequantize", (xq, s, torch.bfloat16), {}),
        ("dynamic_scale", (x, E4M3, True), {}),
        ("dynamic_scale", (x, E4M3), {}),
        ("fp8_linear", (xq, s, wq, s), {"bias": torch.randn(8, generator=g), "out_dtype": torch.bfloat16}),
        ("fp8_linear", (xq, s, wq, s), {"activation": "swiglu", "out_scale": s, "out_fmt": E5M2}),
        ("fp8_mlp", (xq, s, wq, s, None, "geglu_tanh", s, E4M3, w2q, s, None, None), {}),
        ("layer_norm_quantize", (x, *norm, s, E4M3), {"rms": True}),
        ("fp8_matmul", (q4(2, 3, 16), s, q4(16, 5), s), {}),
        ("fp8_attention", (q4(1, 2, 3, 16), s, q4(1, 2, 5, 16), s, q4(1, 2, 5, 8), s), {"is_causal": True}),
        ("moe_quantize", (torch.randn(4, 16, generator=g), torch.full((3,), 0.05), routing, E5M2), {}),
        ("fp8_grouped_linear", (eq, s, ew, s, routing), {"activation": "swiglu", "out_scale": s}),
        ("fp8_grouped_linear", (eq, s, ew, s, routing), {"topk_weights": topk, "out_dtype": torch.bfloat16}),
        ("fp8_grouped_block_linear", (eq, torch.full((4, 2), 0.05), ew, torch.full((3, 1, 2), 0.05), routing),
         {"block": (8, 8), "topk_weights": topk}),
        ("fp8_grouped_block_linear", (eq, torch.full((4, 2), 0.05), ew, torch.full((3, 1, 2), 0.05), routing),
         {"block": (8, 8), "out_dtype": torch.bfloat16}),
        ("block_quantize_weight", (torch.randn(20, 24, generator=g), (8, 16)), {}),
        ("group_quantize", (x, 6, E5M2), {}),
        ("layer_norm_group_quantize", (x, *norm, 8), {}),
        ("fp8_block_linear", (xq, torch.full((3, 2), 0.05), eb, torch.full((2, 2), 0.05)),
         {"block": (8, 8), "activation": "swiglu", "out_dtype": torch.bfloat16}),
        ("mx_quantize", (torch.randn(2, 3, 40, generator=g),), {}),
        ("mx_quantize", (x, E5M2), {}),
        ("fp8_mx_linear", (xq, torch.full((3, 1), 120, dtype=torch.uint8), eb, torch.full((8, 1), 125,
                                                                                           dtype=torch.uint8)),
         {"activation": "swiglu", "out_dtype": torch.bfloat16}),
        ("fp8_mx_linear", (xq, torch.full((3, 1), 120, dtype=torch.uint8), eb, torch.full((8, 1), 125,
                                                                                           dtype=torch.uint8)),
         {"out_scale": s}),
        ("fp8_weight_only_linear", (x, wq, torch.full((8,), 0.05)), {"bias": torch.randn(8, generator=g)}),
        ("fp8_weight_only_linear", (x.bfloat16(), wq, s), {"activation": "geglu", "out_dtype": torch.bfloat16}),
        ("fp8_grouped_weight_only_linear", (torch.randn(4, 16, generator=g), ew, torch.full((3, 8), 0.05), routing),
         {"activation": "swiglu", "out_dtype": torch.bfloat16}),
        ("fp8_grouped_weight_only_linear", (torch.randn(4, 16, generator=g).half(), ew, s, routing),
         {"topk_weights": topk, "out_dtype": torch.float16}),
        ("fp8_grouped_mx_linear", (eq, torch.full((4, 1), 120, dtype=torch.uint8), ew,
                                   torch.full((3, 8, 1), 125, dtype=torch.uint8), routing), {"activation": "geglu"}),
        ("fp8_grouped_mx_linear", (q4(8, 16), torch.full((8, 1), 120, dtype=torch.uint8), ew,
                                   torch.full((3, 8, 1), 125, dtype=torch.uint8), routing),
         {"x_sorted": True, "topk_weights": topk, "out_dtype": torch.bfloat16}),
    ]


def test_every_kernel_has_examples():
    assert {name for name, _, _ in examples()} == set(BY_NAME)


@pytest.mark.parametrize("name,args,kwargs", examples(), ids=lambda v: v if isinstance(v, str) else "")
def test_the_declared_output_rule_matches_the_reference_kernel(name, args, kwargs):
    with kernels.use_backend("reference"):
        got = getattr(kernels, name)(*args, **kwargs)
    rule = BY_NAME[name].declaration(*args, **kwargs)
    got, rule = (got, rule) if isinstance(got, tuple) else ((got,), (rule,))
    assert [(t.shape, t.dtype) for t in rule] == [(t.shape, t.dtype) for t in got]


@pytest.mark.parametrize("op", TABLE, ids=lambda op: op.name)
def test_generated_functions_have_the_declared_signature(op):
    signature = inspect.signature(op.declaration)
    entry = getattr(kernels, op.name)
    assert inspect.signature(entry) == signature and entry.__doc__ == op.declaration.__doc__
    assert entry.__module__ == "dbr_quant.kernels"
    if op.triton is not None:
        assert inspect.signature(getattr(triton_backend, op.name)) == signature
    else:
        assert not hasattr(triton_backend, op.name)
    if "routing" in signature.parameters:  # no graph form: the MoE experts op holds the routing
        assert op.name not in OPS and not hasattr(GraphOps, op.name)
    else:
        assert op.name in OPS
        assert inspect.signature(getattr(GraphOps, op.name)).parameters.keys() == signature.parameters.keys()
        schema = getattr(torch.ops.dbr_quant, op.name).default._schema
        assert [a.name for a in schema.arguments] == list(signature.parameters)


def test_a_traceback_through_a_generated_entry_point_shows_its_source():
    import traceback

    # both ways through the body: the common case (nothing set on this thread: the CPU backend directly) and the
    # full path (launches counted: the backend chosen by _impl)
    for counting, backend in ((contextlib.nullcontext(), "cpu_backend"), (kernels.count_launches(), "_impl")):
        kernels.quantize(torch.ones(2), torch.tensor(1.0), FP8Format.E4M3)  # $DBR_QUANT_BACKEND read (first call)
        with pytest.raises(ValueError) as info, counting:
            kernels.group_quantize(torch.ones(4), 0)
        frames = traceback.extract_tb(info.tb)
        assert any(f.name == "group_quantize" and f.line and f.line.startswith(f"return {backend}")
                   and f.line.endswith(".group_quantize(x, group, fmt)") for f in frames)


def test_an_op_without_a_triton_kernel_runs_on_the_plain_backends_and_says_why_on_triton():
    """An op declared with ``without_triton`` (none in the table today: a declaration made here): the chosen plain
    backend runs it (the CPU backend by default on a CPU tensor, the reference when forced) and Triton refuses
    with the declared reason."""
    from types import SimpleNamespace

    from dbr_quant.kernels.op_table import kernel_op

    calls = []
    plain = SimpleNamespace(__name__="plain", no_triton_op=lambda x: calls.append("reference") or x + 1)

    @kernel_op(launches="no_triton_op", reference=plain, without_triton="no_triton_op: no Triton kernel; use cpu")
    def no_triton_op(x: torch.Tensor) -> torch.Tensor:
        """An op Triton cannot run."""
        return torch.empty_like(x)

    entry = kernels._entry_point(no_triton_op)
    with kernels.use_backend("reference"), kernels.count_launches() as launches:
        assert torch.equal(entry(torch.zeros(2)), torch.ones(2))
    assert launches["no_triton_op"] == 1 and calls == ["reference"]
    with kernels.use_backend("triton-interpret"), pytest.raises(NotImplementedError, match="no Triton kernel; use cpu"):
        entry(torch.zeros(2))


def test_the_entry_points_common_case_is_taken_only_while_nothing_is_set_on_the_thread(monkeypatch):
    """``dispatch._tls.all_default`` (the generated entry points' one read in the common case) follows this thread's
    settings: a forced backend, launch counting or graph capture, nested, left by an exception, and per thread."""
    ran: list[str] = []
    for name, module in (("cpu", cpu_backend), ("reference", dense)):
        monkeypatch.setattr(module, "quantize", lambda x, scale, fmt, name=name: ran.append(name) or x)
    x, s = torch.ones(2), torch.tensor(1.0)

    def run() -> str:
        kernels.quantize(x, s, FP8Format.E4M3)
        return ran.pop()

    assert dispatch._tls.all_default and run() == "cpu"
    with kernels.count_launches() as counts:
        assert not dispatch._tls.all_default and run() == "cpu" and counts["quantize"] == 1
        with kernels.use_backend("reference"):
            assert run() == "reference" and counts["quantize"] == 2
            seen_by_another_thread: list[bool] = []
            other = threading.Thread(target=lambda: seen_by_another_thread.append(dispatch._tls.all_default))
            other.start()
            other.join()
            assert seen_by_another_thread == [True]
        assert not dispatch._tls.all_default and run() == "cpu"
    assert dispatch._tls.all_default
    with pytest.raises(RuntimeError), kernels.use_backend("reference"):
        assert run() == "reference"
        raise RuntimeError
    assert dispatch._tls.all_default and run() == "cpu"
