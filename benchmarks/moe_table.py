"""MEASURED: issue #12's table — what dbr_quant records and converts of a small Mixtral's experts, per
``config._experts_implementation``.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/moe_table.py

``MixtralForCausalLM`` with 1 layer (hidden 64, FFN 128, 8 experts, top-2, fp32), prepared on a 2-token
example (it reaches ≤ 4 experts), calibrated on 2 × [3, 16] tokens, then run on other batches. Columns:
expert tensors the report lists / of them in FP8 / bytes of the 3-D expert weights before → after convert
(FP8 data + fp32 scales) / kernel launches inside one experts call / warnings over prepare, calibrate,
convert and three re-routed forwards.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.utils import logging as hf_logging

import dbr_quant as dq
from dbr_quant import kernels
from dbr_quant.moe.experts import EXPERTS
from dbr_quant.moe.weights import expert_weight_bytes

hf_logging.set_verbosity_error()


def row(impl: str) -> str:
    torch.manual_seed(0)
    model = MixtralForCausalLM(MixtralConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=128,
        experts_implementation=impl)).eval()
    gen = torch.Generator().manual_seed(1)
    ids = lambda shape: {"input_ids": torch.randint(0, 256, shape, generator=gen)}  # noqa: E731
    launches: list = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepared = dq.prepare(model, example_kwargs=ids((1, 2)))
        dq.calibrate(prepared, [ids((3, 16)), ids((3, 16))], progress=False)
        converted = dq.convert(prepared)
        experts = converted.model.layers[0].mlp.experts
        stack = contextlib.ExitStack()
        experts.register_forward_pre_hook(lambda m, a: launches.append(stack.enter_context(kernels.count_launches())))
        experts.register_forward_hook(lambda m, a, o: stack.close())
        with torch.no_grad():
            for shape in ((4, 16), (2, 7), (1, 1)):
                converted(**ids(shape))
    rows = [r for r in dq.report(converted) if r["kind"] == EXPERTS or ".experts." in r["fqn"]]
    before, _ = expert_weight_bytes(model)
    after, _ = expert_weight_bytes(converted)
    per_call = sorted({tuple(sorted(c.items())) for c in launches})
    return (f"| `{impl}` | {len(rows)} | {sum(r['fp8'] for r in rows)} | {before:,} → {after:,} "
            f"({after / before:.3f}×) | {'; '.join(', '.join(f'{k} {v}' for k, v in c) for c in per_call)} "
            f"| {len(caught)} |")


if __name__ == "__main__":
    print("| experts implementation | expert tensors recorded | in FP8 | expert bytes after convert "
          "| launches per experts call | warnings |")
    print("| --- | --- | --- | --- | --- | --- |")
    for impl in ("grouped_mm", "batched_mm", "eager"):
        print(row(impl))
