"""Per-head vs per-tensor FP8 attention scales (``QConfig(quantize_attention=True, attention_scales=...)``) on a
small GQA Llama, against its fp32 logits on held-out sequences.

    PYTHONPATH=. .venv/bin/python benchmarks/attention_heads.py      (CPU, about a minute)

The model: ``LlamaConfig`` with 4 layers, hidden 256, 8 query heads and 2 KV heads of dimension 32 (GQA, as Llama-3
and Qwen2 group them), SDPA attention, random weights (``initializer_range`` 0.02), float32. Two changes make it a
realistic test of attention scales, both leaving the fp32 function as it was:

* q_proj and k_proj are multiplied by 2.5 so the attention logits spread like a trained model's (std ≈ 1.5, a few
  heads peaked); random-init attention is nearly uniform, where the rounding of q·kᵀ hardly matters.
* Each layer's KV heads get key ranges ``spread`` apart: kv head j's k_proj rows are multiplied by
  s_j = spread^(j/(G-1) - 1/2) and the q_proj rows of its query heads by 1/s_j, so every score q·k — and the
  fp32 logits — stay the same (exactly: s_j are powers of two, and RoPE rotates within a head). Outlier key heads
  of this kind are what per-head KV-cache scales are for (vllm#11906; compressed-tensors' ``attn_head``).
  v is not spread: a per-head range in v would land in o_proj's per-tensor input scale, which attention scales
  do not set.

E4M3 has the same relative precision over its whole normal range (2^-6 .. 448, a factor 2^14.8), so one scale
shared by heads costs the small heads accuracy only where it pushes their values below that range: the rows show
per-tensor scales close to per-head ones up to a spread of 2^12 and falling behind beyond. Per-head scales
give the same numbers for every spread (each head's scale moves by its own power of two).

Configurations: "attention" (only SDPA in FP8: the linears high precision, so the rows isolate the attention
scales) and "W8A8 + attention" (every linear but lm_head in FP8 too, the serving configuration). Calibration: 8
batches of 4 × 64 random tokens; held out: 8 × 64 other random tokens. Metrics: relative logits error
‖Δ‖/‖ref‖ and the cosine of each token's logits to fp32 (mean, min over the 512 held-out tokens).
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import nn
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.utils import logging as hf_logging

import dbr_quant as dq

hf_logging.set_verbosity_error()

VOCAB, HEADS, KV_HEADS = 512, 8, 2
SPREADS = (1, 2**12, 2**14, 2**16)
SHARPEN = 2.5  # q_proj and k_proj: attention logits with a trained model's spread (std ≈ 1.5)
CONFIGS = {
    "attention": (dq.Override(pattern=r"(_proj|lm_head)$", skip=True),),
    "W8A8 + attention": (dq.Override(pattern=r"^lm_head$", skip=True),),
}


def llama(spread: int) -> nn.Module:
    """The benchmark model with kv heads' key ranges ``spread`` apart (the same fp32 function for every spread)."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=688, num_hidden_layers=4,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=256,
                      attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).eval()
    head_dim, group = cfg.hidden_size // HEADS, HEADS // KV_HEADS
    factors = [spread ** (j / (KV_HEADS - 1) - 0.5) for j in range(KV_HEADS)]
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_proj.weight.mul_(SHARPEN)
            attn.k_proj.weight.mul_(SHARPEN)
            for j, s in enumerate(factors):
                attn.k_proj.weight[j * head_dim:(j + 1) * head_dim].mul_(s)
                attn.q_proj.weight[j * group * head_dim:(j + 1) * group * head_dim].div_(s)
    return model


def tokens(batch: int, seed: int) -> dict[str, torch.Tensor]:
    return {"input_ids": torch.randint(0, VOCAB, (batch, 64), generator=torch.Generator().manual_seed(seed))}


def convert(model: nn.Module, config: str, scales: str) -> nn.Module:
    qconfig = dq.QConfig(quantize_attention=True, attention_scales=scales, overrides=CONFIGS[config])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "stays high precision" notes: the same for every row
        prepared = dq.prepare(model, example_kwargs=tokens(2, 0), qconfig=qconfig)
        dq.calibrate(prepared, [tokens(4, 1 + i) for i in range(8)], progress=False)
        return dq.convert(prepared)


def key_range_ratio(converted: nn.Module) -> float:
    """The largest over layers of max/min of the per-kv-head k scales (the spread the calibration saw)."""
    ratios = []
    for st in converted.__dict__["_dbr_record"].states:
        for op in st.seen_ops:
            if op.kind == "sdpa" and op.quantize:
                k = st.scale(op, "k")
                ratios.append((k.max() / k.min()).item())
    return max(ratios)


def rows() -> list[dict]:
    held_out = tokens(8, 100)
    out = []
    ref = None
    for spread in SPREADS:
        model = llama(spread)
        with torch.no_grad():
            logits = model(**held_out).logits
        ref = logits if ref is None else ref
        assert torch.allclose(logits, ref, rtol=1e-4, atol=1e-4), "the spread changed the fp32 model"
        for config in CONFIGS:
            for scales in ("tensor", "head"):
                converted = convert(model, config, scales)
                with torch.no_grad():
                    got = converted(**held_out).logits
                cos = F.cosine_similarity(got.flatten(0, 1).double(), logits.flatten(0, 1).double(), dim=-1)
                out.append({"spread": spread, "config": config, "scales": scales,
                            "k_range": key_range_ratio(converted) if scales == "head" else None,
                            "rel_err": ((got - logits).norm() / logits.norm()).item(),
                            "cos_mean": cos.mean().item(), "cos_min": cos.min().item()})
    return out


def main() -> None:
    table = rows()
    print(f"{'key spread':>10} | {'k range seen':>12} | {'configuration':<17} | {'scales':<6} | {'logits err':>10} | "
          f"{'cos mean':>8} | {'cos min':>8}")
    k_range = {}
    for r in table:
        if r["k_range"] is not None:
            k_range[(r["spread"], r["config"])] = r["k_range"]
    for r in table:
        spread, seen = f"2^{r['spread'].bit_length() - 1}", k_range[(r["spread"], r["config"])]
        print(f"{spread:>10} | {seen:>12.3g} | {r['config']:<17} | {r['scales']:<6} | {r['rel_err']:>10.4f} | "
              f"{r['cos_mean']:>8.5f} | {r['cos_min']:>8.5f}")


if __name__ == "__main__":
    main()
