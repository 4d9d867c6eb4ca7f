"""rewrite() on Hugging Face BERT / GPT-2 / Llama (small random configs) and the real all-MiniLM-L6-v2."""

import pytest
import torch
from test_hf_models import OTHER_SHAPES, SPECS, make_batch, run_pipeline  # tests/ is on sys.path (conftest)

import dbr_quant as dq
from dbr_quant.examples.minilm import CALIBRATION_SENTENCES, EVAL_SENTENCES, encode, load_minilm
from dbr_quant.fx_rewriter import rewrite
from dbr_quant.kernels.cpu.features import current_gemm_path


def _leaves(out, fields):
    return [getattr(out, f) for f in fields]


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("attention", [False, True])
def test_hf_models_rewrite_bit_for_bit(name, attention):
    p = run_pipeline(name, qconfig=dq.QConfig(quantize_attention=attention))
    # with its default kwargs a decoder returns a KV cache object, which a graph cannot: rewrite() captures
    # decoders with use_cache=False and the graph is called without it
    gm = rewrite(p.converted)
    assert "use_cache" not in {n.target for n in gm.graph.find_nodes(op="placeholder")}
    gen = torch.Generator().manual_seed(7)
    for shape in [tuple(p.eval_batch["input_ids"].shape), *OTHER_SHAPES]:
        batch = make_batch(gen, shape, p.spec.left_pad)
        with torch.no_grad():
            want, got = p.converted(**batch), gm(**batch)
        assert type(got) is type(want)
        for a, b in zip(_leaves(want, p.spec.outputs), _leaves(got, p.spec.outputs)):
            assert torch.equal(a, b), f"{name}: rewritten output differs at shape {shape}"


@pytest.mark.slow
@pytest.mark.parametrize("name,attention", [("llama", True), ("gpt2", False)])
def test_hf_models_compiled_close_to_eager(name, attention, close_to_reference):
    """Compiled through the inductor lowering — Llama: RMSNorm + SwiGLU + FP8 attention (causal, GQA,
    left padding); GPT-2: Conv1D + GELU-tanh — the outputs match eager up to FP8 rounding flips."""
    p = run_pipeline(name, qconfig=dq.QConfig(quantize_attention=attention))
    gm = rewrite(p.converted, example_kwargs={**p.example, "use_cache": False})
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True), torch.no_grad():
        compiled = torch.compile(gm, fullgraph=True)
        for shape in [tuple(p.eval_batch["input_ids"].shape), OTHER_SHAPES[0]]:
            batch = make_batch(torch.Generator().manual_seed(3), shape, p.spec.left_pad)
            want = _leaves(p.converted(**batch, use_cache=False), p.spec.outputs)[0]
            got = _leaves(compiled(**batch, use_cache=False), p.spec.outputs)[0]
            assert torch.isfinite(got).all()
            close_to_reference(got, want, min_cos=0.999, max_rel=0.03)  # measured 0 (equal)
    torch._dynamo.reset()


@pytest.fixture(scope="module")
def minilm():
    model, tok = load_minilm()
    calib = [encode(tok, CALIBRATION_SENTENCES[i:i + 8]) for i in range(0, len(CALIBRATION_SENTENCES), 8)]
    p = dq.prepare(model, example_kwargs=calib[0])
    dq.calibrate(p, calib, progress=False)
    return tok, dq.convert(p)


def test_minilm_rewrite_equal_compile_and_export(minilm, tmp_path):
    tok, c = minilm
    gm = rewrite(c)
    ops = [str(n.target) for n in gm.graph.nodes if "dbr_quant" in str(n.target)]
    assert ops.count("dbr_quant.fp8_mlp.default") == 6  # each layer's intermediate → output block, one node
    batches = [encode(tok, EVAL_SENTENCES[:32]), encode(tok, EVAL_SENTENCES[:1])]
    with torch.no_grad():
        for b in batches:
            assert torch.equal(gm(**b).last_hidden_state, c(**b).last_hidden_state)
    ep = torch.export.export(gm, (), dict(batches[0]),
                             dynamic_shapes={k: {0: torch.export.Dim.AUTO, 1: torch.export.Dim.AUTO}
                                             for k in batches[0]})
    torch.export.save(ep, tmp_path / "minilm.pt2")
    loaded = torch.export.load(tmp_path / "minilm.pt2").module()
    with torch.no_grad():
        assert torch.equal(loaded(**batches[1]).last_hidden_state, c(**batches[1]).last_hidden_state)


@pytest.mark.slow
def test_minilm_compiled_is_as_accurate_as_eager(minilm):
    """The compiled graph (inductor lowering of the FP8 ops, frozen and not) is as close to fp32 as the
    eager model. It is not bit-equal: inductor rounds a few fp32 ops differently (no FMA in the epilogue,
    its own LayerNorm sums), a 1-ulp change flips some FP8 roundings, and the flips spread through the
    layers — eager itself moves as far (min cosine ≈ 0.9988) when its addcmul becomes mul + add. ``compile_frozen``
    moves further where eager runs the fused C GEMM (bf16 path): there it runs oneDNN's bf16 GEMM on folded weights,
    whose result rounds to bf16 (2⁻⁹) where eager keeps fp32 sums, so each sentence is held to being nearer eager
    than eager is to fp32 (measured: min 0.9980 vs eager's own min 0.996 to fp32), with the same accuracy."""
    from dbr_quant.examples.minilm import sentence_embeddings
    from dbr_quant.fx_rewriter import compile_frozen

    tok, c = minilm
    fp32, _ = load_minilm()
    gm = rewrite(c)
    torch._dynamo.reset()
    with torch._inductor.config.patch(force_disable_caches=True), torch.no_grad():
        for frozen, compiled in ((False, torch.compile(gm, fullgraph=True)), (True, compile_frozen(gm))):
            for b in (encode(tok, EVAL_SENTENCES[:32]), encode(tok, EVAL_SENTENCES[:1])):
                emb = {name: sentence_embeddings(m, b) for name, m in
                       (("compiled", compiled), ("eager", c), ("fp32", fp32))}
                vs_eager = (emb["compiled"] * emb["eager"]).sum(-1)
                if frozen and current_gemm_path() == "bf16":  # bf16-rounded GEMM results: see the docstring
                    assert (vs_eager > (emb["eager"] * emb["fp32"]).sum(-1)).all(), vs_eager
                else:
                    assert vs_eager.min() > 0.998 and vs_eager.mean() > 0.999, vs_eager
                accuracy = {k: (emb[k] * emb["fp32"]).sum(-1).mean() for k in ("compiled", "eager")}
                assert abs(accuracy["compiled"] - accuracy["eager"]) < 5e-4, accuracy
    torch._dynamo.reset()
