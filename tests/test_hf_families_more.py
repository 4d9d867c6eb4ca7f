"""More Hugging Face families through prepare → calibrate → convert, the ones tests/test_hf_families.py and
tests/test_moe*.py do not build: MoE routers written as functional linears (OLMoE, Qwen3-MoE, DeepSeek-V3's
group-limited routing, GPT-OSS, GraniteMoE), softcapped / sliding-window decoders (Gemma-2/3, Mistral,
Starcoder2), q/k norms (Qwen3), fused qkv linears called as ``x @ W.T`` (Falcon), ALiBi (Bloom), GPT-J,
multi-query GPT-BigCode, BART, encoders (RoBERTa, ModernBERT, DeBERTa-v2), CLIP, Swin, Wav2Vec2's conv front
end, and the state-space / hybrid models (Mamba, Jamba, Qwen3-Next).

Tiny configs (hidden 64 or less, 2 layers), random weights, no downloads. Per family:

* report: every ``nn.Linear``, every functional linear on a parameter and every 3-D expert tensor is FP8, or
  is in high precision for the reason the family's ``high`` pins (a router, an experts module the FP8 MoE
  block cannot run); every other high-precision weight (convolutions, lookup tables, state-space parameters)
  has a reason; each FP8 linear runs as an FP8 GEMM;
* the output is close to the fp32 model's (cosine and relative error, bounds from measurements:
  ``python tests/test_hf_families_more.py`` prints them beside a per-tensor FP8 fake quantization of the same
  model — every nn.Linear's weight per channel, its input per tensor — as the yardstick);
* decoders: greedy ``generate()`` with the KV cache gives the tokens and step logits of the converted model's
  own forward over the same tokens without cache;
* ``save_pretrained`` → ``load_pretrained`` gives the same outputs, bit for bit;
* three of them (MoE, ``x @ W.T`` linears, ALiBi) through ``fx_rewriter.rewrite`` and ``torch.export``.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
import transformers as hf
from hf_families_more import (
    BOS,
    CAL_BATCH,
    CAL_BATCHES,
    EOS,
    EVAL_BATCH,
    FAMILIES,
    GEN_BATCH,
    GEN_PROMPT,
    GENERATORS,
    NAMES,
    NEW_TOKENS,
    PAD,
    Family,
    build,
    make_batch,
)
from test_hf_families import gated_pairs  # tests/ is on sys.path (conftest)
from test_hf_models import cosine, dbr_warnings, untied
from torch import nn

import dbr_quant as dq
from dbr_quant import fx_rewriter
from dbr_quant.ops.basic import stored_fp8_weight


@dataclasses.dataclass
class Pipeline:
    family: Family
    model: nn.Module  # the fp32 original
    converted: nn.Module
    example: dict[str, torch.Tensor]
    eval_batch: dict[str, torch.Tensor]
    warnings: list[str]


def run_pipeline(name: str, qconfig: dq.QConfig | None = None) -> Pipeline:
    model = build(name)
    gen = torch.Generator().manual_seed(1)
    example = make_batch(name, gen, 2, 12)
    calibration = [make_batch(name, gen, CAL_BATCH) for _ in range(CAL_BATCHES)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = dq.prepare(model, example_kwargs=example, qconfig=untied(qconfig or dq.QConfig()))
        dq.calibrate(prepared, calibration, progress=False)
        converted = dq.convert(prepared)
    return Pipeline(FAMILIES[name], model, converted, example, make_batch(name, gen, EVAL_BATCH), dbr_warnings(caught))


@pytest.fixture(scope="module")
def pipelines() -> Callable[[str], Pipeline]:
    """Shared (read-only) pipelines."""
    cache: dict[str, Pipeline] = {}

    def get(name: str) -> Pipeline:
        if name not in cache:
            cache[name] = run_pipeline(name)
        return cache[name]

    return get


def forward(model: nn.Module, batch: dict[str, torch.Tensor], **extra: Any) -> Any:
    with torch.no_grad():
        return model(**batch, **extra)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def expected_reason(family: Family, fqn: str) -> str | None:
    return next((why for pattern, why in family.high if re.search(pattern, fqn)), None)


# ----------------------------------------------------------------------------------------- report
@pytest.mark.parametrize("name", NAMES)
def test_every_linear_and_expert_fp8_or_reported(pipelines, name):
    """Every nn.Linear, functional linear on a parameter and 3-D expert tensor has a report row: FP8 (stored as
    FP8, run as an FP8 GEMM), or high precision for the reason the family pins; every other weight left high
    precision says why; prepare / convert warn exactly when a weight stays high precision not by design."""
    p = pipelines(name)
    rows = dq.report(p.converted)
    by_fqn: dict[str, list[dict]] = {}
    for r in rows:
        by_fqn.setdefault(r["fqn"], []).append(r)
    linears = {n for n, m in p.model.named_modules() if isinstance(m, nn.Linear)}
    assert not linears - set(by_fqn), f"linears missing from the report: {sorted(linears - set(by_fqn))}"
    experts = {n for n, t in p.model.named_parameters() if t.dim() == 3 and re.search(r"\.experts\.", n)}
    assert experts <= set(by_fqn), f"expert tensors missing from the report: {sorted(experts - set(by_fqn))}"
    matched = set()
    for r in rows:
        if r["kind"] not in ("linear", "experts"):
            if not r["fp8"]:
                assert r["reason"], f"{r['fqn']} ({r['kind']}) stays high precision without a reason"
            continue
        why = expected_reason(p.family, r["fqn"])
        if r["fp8"]:
            assert why is None, f"{r['fqn']} is FP8; expected high precision: {why}"
            continue
        assert why is not None and r["reason"].startswith(why), f"{r['fqn']} stays high precision: {r['reason']}"
        matched.add(next(pattern for pattern, w in p.family.high if re.search(pattern, r["fqn"])))
    assert matched == {pattern for pattern, _ in p.family.high}, "an expected high-precision op is not in the report"
    for fqn in linears:
        if all(r["fp8"] for r in by_fqn[fqn]):
            w_q, _ = stored_fp8_weight(p.converted.get_submodule(fqn))
            assert w_q.dtype == torch.float8_e4m3fn, fqn
    high_warning = [w for w in p.warnings if "stay high precision" in w]
    assert bool(high_warning) == p.family.warns, p.warnings
    # each FP8 linear row runs as an FP8 GEMM (a gated MLP's gate and up share one: stacked weights)
    linear_rows = [r for r in rows if r["kind"] == "linear"]
    fp8_linears = sum(r["fp8"] for r in linear_rows)
    with dq.kernels.count_launches() as counts:
        forward(p.converted, p.eval_batch)
    assert counts["fp8_linear"] == fp8_linears - gated_pairs(linear_rows), dict(counts)
    fp8_expert_modules = {r["module"] for r in rows if r["kind"] == "experts" and r["fp8"]}
    assert counts["fp8_grouped_linear"] == 2 * len(fp8_expert_modules), dict(counts)


def test_matmul_with_a_parameter_operand_reports_its_reason():
    """Experts like Llama 4's (``torch.bmm(x, self.w)``, a 3-D parameter; Llama4TextExperts itself runs as FP8
    experts, dbr_quant/moe/experts.py) and Mamba's ``dt_proj.weight @ x``:
    the matmul row says why it stays high precision — an operand is not an activation — not "attention stays in
    high precision", which is what QConfig(quantize_attention=True) would not change."""

    class Experts(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.randn(4, 8, 16))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return torch.bmm(x.view(4, -1, 8), self.w)

    for attention in (False, True):
        prepared = dq.prepare(Experts(), (torch.randn(8, 8),), qconfig=dq.QConfig(quantize_attention=attention))
        (row,) = [r for r in dq.report(prepared) if r["kind"] == "matmul"]
        assert not row["fp8"] and row["reason"].startswith("an operand is not an activation"), row


# ----------------------------------------------------------------------------------------- fp32
@pytest.mark.parametrize("name", NAMES)
def test_close_to_fp32(pipelines, name):
    p = pipelines(name)
    field = p.family.output
    ref, out = forward(p.model, p.eval_batch)[field], forward(p.converted, p.eval_batch)[field]
    c, rel = cosine(out, ref), relative_error(out, ref)
    assert c >= p.family.min_cos and rel <= p.family.max_rel, f"{name}: cosine {c:.5f}, relative error {rel:.4f}"
    assert not torch.equal(out, ref), "the converted model ran nothing in FP8"


# ----------------------------------------------------------------------------------------- generate
def generate(model: nn.Module, prompt: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy, KV cache on, exactly NEW_TOKENS new tokens: (the whole sequences, step logits (B, N, V))."""
    config = hf.GenerationConfig(
        max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False, num_beams=1, use_cache=True,
        pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, output_logits=True, return_dict_in_generate=True,
        decoder_start_token_id=getattr(model.config, "decoder_start_token_id", None))
    with torch.no_grad():
        out = model.generate(**prompt, generation_config=config)
    return out.sequences, torch.stack(out.logits, 1)


def teacher_forced_logits(name: str, model: nn.Module, prompt: dict[str, torch.Tensor],
                          sequences: torch.Tensor) -> torch.Tensor:
    """The logits ``model`` gives at each generated position from one forward without cache over ``sequences``."""
    if FAMILIES[name].inputs == "seq2seq":
        return forward(model, prompt, decoder_input_ids=sequences[:, :-1]).logits[:, -NEW_TOKENS:]
    mask = torch.cat([prompt["attention_mask"], prompt["attention_mask"].new_ones(len(sequences), NEW_TOKENS)], 1)
    batch = {"input_ids": sequences[:, :-1], "attention_mask": mask[:, :-1]}
    if "position_ids" in inspect.signature(model.forward).parameters and FAMILIES[name].inputs == "causal":
        batch["position_ids"] = (mask.cumsum(-1) - 1).clamp(min=0)[:, :-1]  # what generate() gives a left-padded row
    return forward(model, batch).logits[:, -NEW_TOKENS:]


# Measured: step logits vs the forward without cache, cosine ≥ 0.9999 (Jamba 0.9989: its Mamba mixer's cached
# step is another sum order), the greedy tokens equal that forward's argmax everywhere.
MIN_STEP_COS = 0.995


@pytest.mark.parametrize("name", GENERATORS)
def test_generate_matches_own_forward(pipelines, name):
    """Greedy generate() of the converted model with the KV cache: its step logits are the converted model's own
    logits over the same tokens (one forward, no cache), and so are its tokens."""
    p = pipelines(name)
    prompt = make_batch(name, torch.Generator().manual_seed(7), GEN_BATCH, GEN_PROMPT, decoder=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sequences, step_logits = generate(p.converted, prompt)
    assert not dbr_warnings(caught), dbr_warnings(caught)
    reference = teacher_forced_logits(name, p.converted, prompt, sequences)
    step_cos = [cosine(step_logits[:, i], reference[:, i]) for i in range(NEW_TOKENS)]
    assert min(step_cos) >= MIN_STEP_COS, f"step logits vs the converted forward without cache: {step_cos}"
    reference[..., EOS] = -torch.inf  # min_new_tokens: generate() masks EOS out of the (returned raw) logits
    assert torch.equal(sequences[:, -NEW_TOKENS:], reference.argmax(-1)), "greedy tokens differ from the forward's"


@pytest.mark.parametrize("name", ["qwen3", "qwen3_next"])
def test_generate_matches_own_forward_with_fp8_attention(name):
    """With quantize_attention the cached decode step runs the same FP8 math as the full forward. Qwen3-Next's
    linear-attention layer multiplies activations in chunks when it sees a prompt and elementwise when it
    decodes: those products are not softmax attention and stay high precision (before, they were FP8 in the
    forward only, and cached steps agreed with it on 80 % of the greedy tokens)."""
    converted = run_pipeline(name, dq.QConfig(quantize_attention=True)).converted
    assert any(r["kind"] == "sdpa" and r["fp8"] for r in dq.report(converted))
    prompt = make_batch(name, torch.Generator().manual_seed(7), GEN_BATCH, GEN_PROMPT, decoder=False)
    sequences, step_logits = generate(converted, prompt)
    reference = teacher_forced_logits(name, converted, prompt, sequences)
    step_cos = [cosine(step_logits[:, i], reference[:, i]) for i in range(NEW_TOKENS)]
    assert min(step_cos) >= MIN_STEP_COS, f"step logits vs the converted forward without cache: {step_cos}"
    reference[..., EOS] = -torch.inf
    assert torch.equal(sequences[:, -NEW_TOKENS:], reference.argmax(-1)), "greedy tokens differ from the forward's"


# ----------------------------------------------------------------------------------------- checkpoints
@pytest.mark.parametrize("name", NAMES)
def test_save_load_roundtrip(pipelines, name, tmp_path):
    p = pipelines(name)
    dq.save_pretrained(p.converted, tmp_path)
    loaded = dq.load_pretrained(tmp_path, build(name), example_kwargs=p.example)
    field = p.family.output
    assert torch.equal(forward(loaded, p.eval_batch)[field], forward(p.converted, p.eval_batch)[field])


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_falcon_linear_saved_as_a_linear(dynamic, tmp_path):
    """FalconLinear, an nn.Linear whose forward is ``x @ self.weight.T + bias``, is saved as the Linear it is to
    compressed-tensors (weight, weight_scale, input_scale when static; no refusal as a "functional linear"),
    loads back bit for bit (its FP8 weight placed before the trace) and loads in transformers to the same logits."""
    from safetensors import safe_open

    model = build("falcon")
    gen = torch.Generator().manual_seed(1)
    example, batch = make_batch("falcon", gen, 2, 12), make_batch("falcon", gen, EVAL_BATCH)
    prepared = dq.prepare(model, example_kwargs=example, qconfig=dq.QConfig(dynamic=dynamic))
    dq.calibrate(prepared, [make_batch("falcon", gen, CAL_BATCH)], progress=False)
    converted = dq.convert(prepared)
    dq.save_pretrained(converted, tmp_path)
    linears = [n for n, m in model.named_modules() if type(m).__name__ == "FalconLinear"]
    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        keys = set(f.keys())
        assert all(f.get_tensor(f"{n}.weight").dtype == torch.float8_e4m3fn for n in linears)
    assert all(f"{n}.weight_scale" in keys and (f"{n}.input_scale" in keys) != dynamic for n in linears)
    expected = forward(converted, batch).logits
    loaded = dq.load_pretrained(tmp_path, build("falcon"))
    assert torch.equal(forward(loaded, batch).logits, expected)
    assert all(stored_fp8_weight(loaded.get_submodule(n))[0].dtype == torch.float8_e4m3fn for n in linears)
    pytest.importorskip("compressed_tensors")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        theirs = hf.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    # measured: cosine 1 − 4e-14 (static); the same FP8 bytes and scales, their arithmetic order
    assert cosine(forward(theirs, batch).logits, expected) >= 0.99999


# ----------------------------------------------------------------------------------------- rewrite / export
@pytest.mark.parametrize("name", ["qwen3_moe", "falcon", "bloom", pytest.param("llama4", marks=pytest.mark.slow)])
def test_rewrite_and_export(pipelines, name):
    """MoE experts (Llama 4's dense ones too), FalconLinear's ``x @ W.T`` and ALiBi through rewrite and
    torch.export: the same logits as the eager converted model, bit for bit."""
    p = pipelines(name)
    eager = forward(p.converted, p.eval_batch).logits
    gm = fx_rewriter.rewrite(p.converted, example_kwargs=p.eval_batch)
    exported = torch.export.export(gm, (), p.eval_batch).module()
    for graph in (gm, exported):
        with torch.no_grad():
            out = graph(**p.eval_batch)
        assert torch.equal(out["logits"], eager)


# ----------------------------------------------------------------------------------------- measurements
def fake_quant(model: nn.Module) -> nn.Module:
    """A copy with every nn.Linear's weight FP8 per output channel and its input FP8 per tensor (max-scaled
    on each call), and every 3-D expert tensor FP8 per expert and output channel: the yardstick."""
    model = build_copy(model)

    def fq(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (t / scale).to(torch.float8_e4m3fn).to(t.dtype) * scale

    def quantize_input(_: nn.Module, args: tuple) -> tuple:
        x = args[0]
        return (fq(x, x.abs().amax().clamp(min=1e-12) / 448), *args[1:])

    for mod in model.modules():
        if isinstance(mod, nn.Linear):
            mod.register_forward_pre_hook(quantize_input)
        for p in mod.parameters(recurse=False):
            if isinstance(mod, nn.Linear) and p is mod.weight or p.dim() == 3:
                p.data = fq(p.data, p.data.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448)
    return model


def build_copy(model: nn.Module) -> nn.Module:
    copy = type(model)(model.config).eval()
    copy.load_state_dict(model.state_dict())
    return copy


def measure(name: str) -> str:
    """The numbers the thresholds rest on (``python tests/test_hf_families_more.py [names]``)."""
    p = run_pipeline(name)
    field = p.family.output
    ref = forward(p.model, p.eval_batch)[field]
    out = forward(p.converted, p.eval_batch)[field]
    yard = forward(fake_quant(p.model), p.eval_batch)[field]
    line = (f"{name}: cos {cosine(out, ref):.5f} rel {relative_error(out, ref):.4f} | fake-quant cos "
            f"{cosine(yard, ref):.5f} rel {relative_error(yard, ref):.4f}")
    if p.family.generates:
        prompt = make_batch(name, torch.Generator().manual_seed(7), GEN_BATCH, GEN_PROMPT, decoder=False)
        sequences, step_logits = generate(p.converted, prompt)
        reference = teacher_forced_logits(name, p.converted, prompt, sequences)
        steps = min(cosine(step_logits[:, i], reference[:, i]) for i in range(NEW_TOKENS))
        reference[..., EOS] = -torch.inf
        same = (sequences[:, -NEW_TOKENS:] == reference.argmax(-1)).float().mean().item()
        line += f" | generate: min step cos {steps:.5f}, tokens = forward's argmax {same:.3f}"
    return line


if __name__ == "__main__":
    import sys

    for family in sys.argv[1:] or list(FAMILIES):
        try:
            print(measure(family), flush=True)
        except Exception as e:  # noqa: BLE001 - a table of every family, failures included
            print(f"{family}: {type(e).__name__}: {e}", flush=True)
