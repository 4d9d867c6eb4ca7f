"""Issue #23: whole models on a CUDA GPU, end to end — each checked against its own fp32 (or bf16) model and
against the same converted model on the CPU, with the Triton kernels' launches counted so a silent fallback
to the reference path fails.

Skipped without CUDA (CI has none); ``make gpu-check`` runs it on the lent GPU machine.
"""

from __future__ import annotations

import copy
import threading

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import (
    BertConfig,
    BertModel,
    LlamaConfig,
    LlamaForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
)
from transformers.utils import logging as hf_logging

import dbr_quant as dq
from dbr_quant import kernels
from dbr_quant.fx_rewriter import rewrite

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
hf_logging.set_verbosity_error()
VOCAB = 512


def _bert() -> nn.Module:
    return BertModel(BertConfig(vocab_size=VOCAB, hidden_size=256, num_hidden_layers=2, num_attention_heads=4,
                                intermediate_size=1024, initializer_range=0.1, attn_implementation="eager"))


def _llama() -> nn.Module:
    return LlamaForCausalLM(LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=768,
                                        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                        initializer_range=0.05, tie_word_embeddings=False))


def _mixtral() -> nn.Module:
    return MixtralForCausalLM(MixtralConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512,
                                            num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
                                            num_local_experts=8, num_experts_per_tok=2, initializer_range=0.05,
                                            tie_word_embeddings=False))


def _ids(batch: int, seq: int, seed: int, device: str = "cuda") -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed)).to(device)


def _main(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def _converted(build, dtype: torch.dtype, qconfig: dq.QConfig | None = None,
               device: str = "cuda") -> tuple[nn.Module, nn.Module]:
    """(high-precision model on ``device``, its converted copy), calibrated on 4 batches of token ids."""
    torch.manual_seed(0)
    model = build().to(device, dtype).eval()
    prepared = dq.prepare(model, example_kwargs={"input_ids": _ids(2, 16, 0, device)}, qconfig=qconfig)
    dq.calibrate(prepared, [{"input_ids": _ids(4, 32, s, device)} for s in range(1, 5)], progress=False)
    return model, dq.convert(prepared)


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    """Mean cosine over the batch rows (a routed MoE token whose top-k flips moves one row a lot)."""
    return F.cosine_similarity(a.float().flatten(1), b.float().flatten(1)).mean().item()


@pytest.mark.parametrize("build,dtype,min_cos,kernel", [
    (_bert, torch.float32, 0.99, "fp8_linear"),
    (_llama, torch.bfloat16, 0.98, "fp8_linear"),
    (_mixtral, torch.bfloat16, 0.95, "fp8_grouped_linear"),  # 0.965 on the CPU: top-2 routing flips
])
def test_model_on_cuda_runs_triton_and_matches(build, dtype, min_cos, kernel):
    model, conv = _converted(build, dtype)
    ids = _ids(3, 40, 99)
    with torch.no_grad(), kernels.count_launches() as launches:
        out = _main(conv(input_ids=ids))
    with torch.no_grad():
        ref = _main(model(input_ids=ids))
    assert launches[kernel] > 0 and launches["quantize"] + launches["layer_norm_quantize"] > 0, dict(launches)
    assert _cos(out, ref) >= min_cos
    # the same converted model on the CPU (cpu backend: exact FP8 semantics) is as close to the high-precision
    # model there as the GPU run is here. (The two runs differ by FP8 codes that one ulp of GEMM order flips
    # and the next layers carry: measured cosine between them 0.987-0.998, so that is not the check.)
    cpu, cpu_model = copy.deepcopy(conv).to("cpu"), copy.deepcopy(model).to("cpu")
    with torch.no_grad():
        out_cpu, ref_cpu = _main(cpu(input_ids=ids.cpu())), _main(cpu_model(input_ids=ids.cpu()))
    # MoE: a token whose top-2 choice flips on one device moves the mean by ~0.003-0.01 (measured on an H100:
    # Mixtral 0.955 here vs 0.965 on the CPU; dense models within 0.002)
    tolerance = 0.015 if kernel == "fp8_grouped_linear" else 0.005
    assert abs(_cos(out, ref) - _cos(out_cpu, ref_cpu)) <= tolerance, (_cos(out, ref), _cos(out_cpu, ref_cpu))


def _self_agreement(model: nn.Module, prompt: torch.Tensor) -> tuple[float, torch.Tensor]:
    """Greedy ``generate`` (cached decode steps, M = 1 GEMMs) against the argmax of one uncached forward of the
    whole generated sequence: the fraction of new tokens they agree on, and that forward's logits."""
    with torch.no_grad():
        tokens = model.generate(input_ids=prompt, max_new_tokens=12, do_sample=False, pad_token_id=0)
        logits = model(input_ids=tokens).logits
    assert tokens.shape == (2, 24) and torch.equal(tokens[:, :12], prompt)
    return (logits[:, 11:-1].argmax(-1) == tokens[:, 12:]).float().mean().item(), logits


def test_llama_generate_bf16():
    model, conv = _converted(_llama, torch.bfloat16)
    prompt = _ids(2, 12, 7)
    ours, logits = _self_agreement(conv, prompt)
    theirs, _ = _self_agreement(model, prompt)
    # the cached and the uncached runs sum in other orders (M = 1 vs M = 48 GEMMs); a 1-ulp difference that
    # flips one FP8 code (1/16 relative) moves this random-weight model's logits by ~0.1 (std 0.8; bf16 flips
    # move them by ~0.02), enough to reorder near-ties: measured on the CPU, 22 of 24 tokens agree (bf16: 24)
    assert ours >= theirs - 3 / 24, (ours, theirs)
    assert torch.isfinite(logits).all()
    with torch.no_grad():
        seq = _ids(2, 24, 9)
        assert _cos(conv(input_ids=seq).logits, model(input_ids=seq).logits) >= 0.98


def test_rewrite_and_compile_on_cuda():
    model, conv = _converted(_llama, torch.bfloat16)
    ids = _ids(2, 24, 5)
    gm = rewrite(conv, example_kwargs={"input_ids": ids})
    compiled = torch.compile(gm, fullgraph=True)
    with torch.no_grad():
        eager = _main(conv(input_ids=ids))
        graph = _main(gm(input_ids=ids))
        comp = _main(compiled(input_ids=ids))
        hp = _main(model(input_ids=ids))
    assert torch.equal(graph, eager)
    # inductor keeps bf16 pointwise chains in fp32 (as it does for the bf16 model), so FP8 inputs can round
    # differently: the compiled model must be as close to the high-precision one as eager is
    assert _cos(comp, hp) >= _cos(eager, hp) - 0.005


def test_save_and_load_on_cuda(tmp_path):
    _, conv = _converted(_llama, torch.bfloat16)
    dq.save_pretrained(conv, tmp_path)
    torch.manual_seed(1)  # other random weights: everything must come from the folder
    loaded = dq.load_pretrained(tmp_path, _llama().to("cuda", torch.bfloat16).eval())
    ids = _ids(2, 20, 3)
    with torch.no_grad():
        assert torch.equal(_main(loaded(input_ids=ids)), _main(conv(input_ids=ids)))


def test_threads_and_streams_give_the_single_thread_result():
    _, conv = _converted(_bert, torch.float32)
    inputs = [_ids(2, 8 + 8 * i, 40 + i) for i in range(6)]
    with torch.no_grad():
        expected = [_main(conv(input_ids=x)) for x in inputs]
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def serve(i: int) -> None:
        try:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream), torch.no_grad():
                for _ in range(3):
                    results[i] = _main(conv(input_ids=inputs[i]))
            stream.synchronize()
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=serve, args=(i,)) for i in range(len(inputs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    for i, exp in enumerate(expected):
        assert torch.equal(results[i], exp), i
