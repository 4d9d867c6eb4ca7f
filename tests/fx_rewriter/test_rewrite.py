"""rewrite(): converted model → GraphModule of custom ops; equal to eager bit for bit; compiles and exports."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dbr_quant as dq
from dbr_quant.fx_rewriter import RewriteError, rewrite


class Block(nn.Module):
    def __init__(self, d=32, heads=4):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x, mask=None):
        b, t, d = x.shape
        q, k, v = (y.view(b, t, self.heads, -1).transpose(1, 2) for y in self.qkv(self.ln1(x)).split(d, -1))
        a = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return {"out": x + self.fc2(F.gelu(self.fc1(self.ln2(x)))), "shape": x.shape[1]}


def converted_block(qconfig=None):
    m = Block().eval()
    x = torch.randn(2, 5, 32)
    p = dq.prepare(m, (x,), qconfig)
    dq.calibrate(p, [torch.randn(2, 5, 32) for _ in range(3)], progress=False)
    return m, dq.convert(p), x


def graph_ops(gm):
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function" and "dbr_quant" in str(n.target)}


@pytest.mark.parametrize("attention", [False, True])
def test_rewrite_equals_eager_bit_for_bit_on_new_shapes(attention):
    m, c, x = converted_block(dq.QConfig(quantize_attention=attention))
    gm = rewrite(c)
    assert isinstance(gm, torch.fx.GraphModule)
    ops = graph_ops(gm)
    # the MLP block (ln2 → fc1 → gelu → fc2 + x) is one fused-MLP node after the norm+quantize node
    assert {"dbr_quant.quantize.default", "dbr_quant.fp8_linear.default", "dbr_quant.layer_norm_quantize.default",
            "dbr_quant.fp8_mlp.default"} <= ops
    assert ("dbr_quant.fp8_attention.default" in ops) == attention
    code = gm.code
    assert "dbr_quant.fp8_linear" in code and "empty" not in code  # readable: no runtime placeholders left
    for shape in [(2, 5, 32), (3, 9, 32), (1, 1, 32)]:
        x = torch.randn(shape)
        with torch.no_grad():
            want, got = c(x), gm(x)
        assert torch.equal(want["out"], got["out"]) and got["shape"] == shape[1]


def test_rewritten_graph_has_no_interception_left():
    from dbr_quant.runtime.interception import is_patched

    _, c, x = converted_block()
    gm = rewrite(c)
    seen = []

    class Spy(torch.overrides.TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            assert not is_patched()
            return func(*args, **(kwargs or {}))

    with Spy(), torch.no_grad():
        gm(x)
    assert seen and not any("dbr_quant.runtime.runs" in getattr(f, "__module__", "") for f in seen)


def test_rewrite_errors_name_the_problem():
    m, c, x = converted_block()
    with pytest.raises(RewriteError, match="needs a model returned by dbr_quant.convert.*not prepared"):
        rewrite(m)
    p = dq.prepare(m, (x,))
    with pytest.raises(RewriteError, match="this one is prepared"):
        rewrite(p)
    with pytest.raises(RewriteError, match="positional argument 0 is .*the trace had"):
        rewrite(c, (torch.randn(2, 5, 32).double(),))
    with pytest.raises(RewriteError, match="keyword arguments \\['mask'\\].*tensors in \\['mask'\\]"):
        rewrite(c, (x,), example_kwargs={"mask": torch.ones(5, 5, dtype=torch.bool)})


def test_export_of_the_rewritten_graph_saves_loads_and_keeps_dynamic_dims(tmp_path):
    _, c, x = converted_block()
    gm = rewrite(c)
    batch, seq = torch.export.Dim("batch", max=64), torch.export.Dim("seq", max=512)
    ep = torch.export.export(gm, (x,), dynamic_shapes=({0: batch, 1: seq},))
    path = tmp_path / "model.pt2"
    torch.export.save(ep, path)
    loaded = torch.export.load(path)
    x2 = torch.randn(4, 11, 32)
    with torch.no_grad():
        assert torch.equal(loaded.module()(x2)["out"], c(x2)["out"])
    assert any("dbr_quant.fp8_linear" in str(n.target) for n in loaded.graph.nodes)


@pytest.mark.slow
def test_compile_fullgraph_has_no_graph_breaks(close_to_reference):
    _, c, x = converted_block()
    gm = rewrite(c)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(gm)(x)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1
    compiled = torch.compile(gm, fullgraph=True)
    with torch.no_grad():
        out, want = compiled(x)["out"], c(x)["out"]
    # inductor fuses the surrounding fp32 ops differently, so FP8 roundings may flip: close, not equal
    close_to_reference(out, want, min_cos=0.999, max_rel=0.03)


@pytest.mark.slow
def test_per_head_attention_scales_rewrite_and_compile(close_to_reference):
    """attention_scales="head": the graph's fp8_attention takes the per-head scales (eager's result bit for bit,
    not the per-tensor model's), and compiles in one graph."""
    _, c, x = converted_block(dq.QConfig(quantize_attention=True, attention_scales="head"))
    st = next(s for s in c.__dict__["_dbr_record"].states if any(op.kind == "sdpa" for op in s.seen_ops))
    op = next(op for op in st.seen_ops if op.kind == "sdpa")
    assert all(st.scale(op, slot).shape == (4,) for slot in "qkv")
    gm = rewrite(c)
    assert "dbr_quant.fp8_attention.default" in graph_ops(gm)
    _, per_tensor, _ = converted_block(dq.QConfig(quantize_attention=True))
    x = torch.randn(3, 9, 32)
    with torch.no_grad():
        want = c(x)["out"]
        assert torch.equal(gm(x)["out"], want) and not torch.equal(rewrite(per_tensor)(x)["out"], want)
        got = torch.compile(gm, fullgraph=True)(x)["out"]
    close_to_reference(got, want, min_cos=0.999, max_rel=0.03)


def test_saved_program_loads_in_a_fresh_process_with_only_import_dbr_quant(tmp_path):
    """``import dbr_quant`` defines the custom ops: a saved ExportedProgram loads and runs without
    importing anything else of ours (and without paying for inductor's import)."""
    import subprocess
    import sys

    _, c, x = converted_block()
    torch.export.save(torch.export.export(rewrite(c), (x,)), tmp_path / "block.pt2")
    torch.save({"x": x, "want": c(x)["out"]}, tmp_path / "io.pt")
    script = ("import sys, torch, dbr_quant\n"
              f"io = torch.load({str(tmp_path / 'io.pt')!r})\n"
              f"out = torch.export.load({str(tmp_path / 'block.pt2')!r}).module()(io['x'])['out']\n"
              "assert torch.equal(out, io['want'])\n"
              "assert 'torch._inductor.decomposition' not in sys.modules\n")
    subprocess.run([sys.executable, "-c", script], check=True, timeout=300)


def test_compile_with_grad_mode_on_runs_as_inference_and_backward_is_a_clear_error(close_to_reference):
    m, c, x = converted_block()
    gm = rewrite(c)
    assert not any(p.requires_grad for p in gm.parameters())
    assert all(p.requires_grad for p in c.parameters() if type(p) is nn.Parameter), "the converted model is untouched"
    compiled = torch.compile(gm, fullgraph=True)
    assert torch.is_grad_enabled()
    got = compiled(x)["out"]  # grad mode on, as in a plain script
    with torch.no_grad():
        want = c(x)["out"]
    close_to_reference(got, want, min_cos=0.999, max_rel=0.03)
    x_grad = x.clone().requires_grad_()
    with pytest.raises(RuntimeError, match="has no gradient: this graph was captured for inference"):
        gm(x_grad)["out"].sum().backward()


def test_rewritten_decoder_with_default_kwargs_exports_again():
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    lm = LlamaForCausalLM(cfg).eval()
    batch = {"input_ids": torch.randint(0, 64, (2, 6)), "attention_mask": torch.ones(2, 6, dtype=torch.long)}
    p = dq.prepare(lm, example_kwargs=batch)
    dq.calibrate(p, [batch], progress=False)
    c = dq.convert(p)
    gm = rewrite(c)  # prepare()'s example: the model's default use_cache=True
    with torch.no_grad():
        want = c(**batch).logits
        assert torch.equal(gm(**batch).logits, want)
    ep = torch.export.export(gm, (), batch)  # the graph's own signature: no use_cache to pass
    with torch.no_grad():
        assert torch.equal(ep.module()(**batch).logits, want)


def test_compiles_under_each_cpu_gemm_path_get_their_own_code():
    """inductor's and AOTAutograd's caches key a graph before the lowering picks bf16 or fp32 GEMMs: without
    ``gemm_path_cache_key`` the second compile of the same rewritten graph got the first one's code back (its
    outputs, bit for bit). With it, each path compiles its own: bf16 and fp32 results differ, and each is nearer
    to the rewritten graph run eagerly on its own path than to the other path's."""
    import copy

    from dbr_quant.fx_rewriter import gemm_path_cache_key
    from dbr_quant.kernels import use_cpu_gemm
    from dbr_quant.kernels.cpu.features import describe

    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(128, 128), nn.GELU(), nn.Linear(128, 128)).eval()
    x = torch.randn(4, 64, 128)  # operands above SMALL_OPERAND: the CPU GEMM path decides the GEMM dtype
    p = dq.prepare(model, (x,))
    dq.calibrate(p, [(x,)], progress=False)
    gm = rewrite(dq.convert(p))
    compiled, eager = {}, {}
    with torch.no_grad():
        for path in ("bf16", "fp32"):
            fresh = torch.compile(torch.fx.GraphModule(gm, copy.deepcopy(gm.graph)), fullgraph=True)
            with use_cpu_gemm(path), gemm_path_cache_key():
                compiled[path] = fresh(x)
            with use_cpu_gemm(path):
                eager[path] = gm(x)
    assert not torch.equal(compiled["bf16"], compiled["fp32"])
    for path, other in (("bf16", "fp32"), ("fp32", "bf16")):
        own, cross = ((compiled[k] - eager[path]).norm() for k in (path, other))
        assert own < cross, (path, own, cross, describe())


def test_compile_cache_is_keyed_on_the_c_kernels(monkeypatch):
    """Whether the C kernels run decides which linears the lowering keeps as calls to the fused C GEMM, after
    torch.compile's caches keyed the graph: CI once got, with the C kernels on, the decomposed bf16 GEMM that
    a compile with ``DBR_QUANT_CPU_DECODE=torch`` had left in the on-disk cache. With ``gemm_path_cache_key``
    the second compile gets its own code: the kept call, equal to eager bit for bit."""
    import copy

    from dbr_quant.fx_rewriter import gemm_path_cache_key
    from dbr_quant.fx_rewriter.lowering import lowering_cache_key
    from dbr_quant.kernels import use_cpu_gemm
    from dbr_quant.kernels.cpu import backend as cpu_backend
    from dbr_quant.kernels.cpu import e4m3 as cpu_e4m3

    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(128, 96), nn.GELU(), nn.Linear(96, 128)).eval()
    x = torch.randn(4, 128)  # 4 rows: the fused GEMM's decode-sized batch on every ISA it is built for
    p = dq.prepare(model, (x,))
    dq.calibrate(p, [(x,)], progress=False)
    gm = rewrite(dq.convert(p))
    out, keys = {}, {}
    with torch.no_grad(), use_cpu_gemm("bf16"):
        for mode in ("torch", "c"):
            monkeypatch.setenv(cpu_e4m3.ENV_VAR, mode)
            cpu_e4m3.reset()
            keys[mode] = lowering_cache_key("bf16")
            fresh = torch.compile(torch.fx.GraphModule(gm, copy.deepcopy(gm.graph)), fullgraph=True)
            with gemm_path_cache_key():
                out[mode] = fresh(x)
        monkeypatch.delenv(cpu_e4m3.ENV_VAR)
        cpu_e4m3.reset()
        if cpu_e4m3.gemm_isa() is None:
            pytest.skip("no C library on this machine: nothing for the lowering to keep as a call")
        assert cpu_backend.runs_fused_gemm(torch.empty(4, 128, dtype=torch.float8_e4m3fn),
                                           torch.empty(96, 128, dtype=torch.float8_e4m3fn))
        want = gm(x)
    assert not torch.equal(out["torch"], want)  # the decomposed bf16 GEMM: what a stale cache hit returns
    assert torch.equal(out["c"], want), cpu_e4m3.describe_fused()
    assert keys["torch"] != keys["c"]
