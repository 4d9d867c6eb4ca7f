"""GPTQ vs round-to-nearest FP8 weights on the real all-MiniLM-L6-v2, with fake quantization (issue #15).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/gptq_minilm.py [--variants nearest,gptq-cv,...]

All-FP8 as convert makes it: every encoder linear gets E4M3 weights (per output channel) and a static
per-tensor E4M3 input scale (running max over the calibration batches). Here the FP8 values are
dequantized back to fp32 (fake quantization), so only the rounding differs between the rows. Calibration
runs the fp32 model over the 16 calibration sentences in batches (default 4 × 4 sentences, 2 folds),
collecting each linear's input amax and its Hessian 2/n Σ xᵀx over every token the linear sees (padding
included, as a calibrate hook sees it). The cosine is between mean-pooled embeddings of the quantized model
and fp32 on the 32 evaluation sentences, disjoint from the calibration ones; "calib" is the same on the
calibration sentences (in-sample: how much a variant fits its calibration data).
"""

from __future__ import annotations

import argparse
import collections
import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from dbr_quant.examples.minilm import CALIBRATION_SENTENCES, EVAL_SENTENCES, encode, load_minilm, sentence_embeddings
from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference import dense as reference
from dbr_quant.observers import MSE, RunningMax
from dbr_quant.quantize.rounding import HessianAccumulator, gptq_quantize, gptq_round, round_to_nearest, weight_scale

FMT = FP8Format.E4M3
VARIANTS = {
    "nearest": "round to nearest (today)",
    "gptq-1%": "GPTQ, fixed damping 0.01",
    "gptq-cv": "GPTQ, damping by k-fold CV (k = --folds)",
    "gptq-cv-mse": "GPTQ (CV) + MSE weight scales",
    "gptq-cv-actorder": "GPTQ (CV), act order",
    "nearest-mse": "round to nearest + MSE weight scales",
    "gptq-cv-seq": "GPTQ (CV), sequential: Hessians from the inputs of the already-quantized layers",
}  # plus "gptq-d<x>": GPTQ with fixed damping x, e.g. gptq-d0.3


def encoder_linears(model: nn.Module) -> dict[str, nn.Linear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear) and name.startswith("encoder.")}


def calibrate(model: nn.Module, batches: list[dict], folds: int, real_tokens_only: bool = False,
              names: set[str] | None = None) -> tuple[dict, dict]:
    """Per linear: a running-max input observer and a Hessian accumulator (one fold per batch, round robin).
    ``real_tokens_only``: leave padding positions out of the Hessians (a calibrate hook cannot: it sees only
    the linear's input)."""
    linears = {n: m for n, m in encoder_linears(model).items() if names is None or n in names}
    observers = {n: RunningMax().create(FMT, None) for n in linears}
    hessians = {n: HessianAccumulator(m.in_features, folds=folds) for n, m in linears.items()}
    mask: list[torch.Tensor] = []

    def hook(name):
        def observe(_module, args):
            x = args[0]
            observers[name](x)
            hessians[name].add(x[mask[0]] if real_tokens_only else x)
        return observe

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in linears.items()]
    try:
        with torch.no_grad():
            for batch in batches:
                mask[:] = [batch["attention_mask"].bool()]
                model(**batch)
    finally:
        for h in handles:
            h.remove()
    return {n: o.scale() for n, o in observers.items()}, hessians


def round_weight(w: torch.Tensor, hessians: HessianAccumulator, variant: str) -> tuple[torch.Tensor, float | None]:
    """(fake-quantized weight, chosen damping or None) of one linear."""
    observer = MSE() if "mse" in variant else None
    scale = weight_scale(w, FMT, "channel", observer)
    damping = None
    if variant.startswith("nearest"):
        q, _ = round_to_nearest(w, FMT, "channel", scale)
    elif variant == "gptq-1%" or variant.startswith("gptq-d"):
        damping = 0.01 if variant == "gptq-1%" else float(variant.removeprefix("gptq-d"))
        q, _ = gptq_round(w, hessians.hessian(), FMT, "channel", scale, damping=damping)
    else:
        result = gptq_quantize(w, hessians, FMT, "channel", scale, act_order="actorder" in variant)
        q, damping = result.qdata, result.damping.damping
    return reference.dequantize(q, scale.reshape(-1, 1)), damping


def quantize_weights(model: nn.Module, hessians: dict, variant: str) -> tuple[dict, dict, float]:
    """name -> fake-quantized (dequantized FP8) weight; name -> chosen damping; CPU seconds spent rounding
    (process time: on a shared machine wall time mostly measures the other processes)."""
    weights, dampings = {}, {}
    start = time.process_time()
    for name, m in encoder_linears(model).items():
        weights[name], dampings[name] = round_weight(m.weight.detach(), hessians[name], variant)
    return weights, {n: d for n, d in dampings.items() if d is not None}, time.process_time() - start


def sequential_weights(model: nn.Module, batches: list[dict], act_scales: dict, variant: str, folds: int,
                       real_tokens_only: bool) -> tuple[dict, dict, float]:
    """Layer by layer: the Hessians of layer l's linears come from a calibration pass through the model with
    layers < l already fake-quantized (weights and inputs), so GPTQ also absorbs the upstream error."""
    weights, dampings = {}, {}
    cpu = 0.0
    layers = sorted({n.split(".")[2] for n in encoder_linears(model)}, key=int)
    for layer in layers:
        names = {n for n in encoder_linears(model) if n.split(".")[2] == layer}
        with fake_quantized(model, weights, act_scales):
            _, hessians = calibrate(model, batches, folds, real_tokens_only, names)
        start = time.process_time()
        for name in sorted(names):
            w = model.get_submodule(name).weight.detach()
            weights[name], dampings[name] = round_weight(w, hessians[name], variant)
        cpu += time.process_time() - start
    return weights, dampings, cpu


def fake_quantized(model: nn.Module, weights: dict, act_scales: dict):
    """Context: the encoder linears named in ``weights`` use those weights and fake-quantize their inputs."""
    class _Ctx:
        def __enter__(self):
            self.saved, self.handles = {}, []
            for name in weights:
                m = model.get_submodule(name)
                self.saved[name] = m.weight.data
                m.weight.data = weights[name]
                scale = act_scales[name]
                self.handles.append(m.register_forward_pre_hook(
                    lambda _m, args, s=scale: (reference.dequantize(reference.quantize(args[0], s, FMT), s),)))

        def __exit__(self, *exc):
            for h in self.handles:
                h.remove()
            for name, weight in self.saved.items():
                model.get_submodule(name).weight.data = weight
    return _Ctx()


def cosines(model: nn.Module, batch: dict, reference_emb: torch.Tensor) -> torch.Tensor:
    return F.cosine_similarity(sentence_embeddings(model, batch), reference_emb, dim=-1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {','.join(VARIANTS)}")
    parser.add_argument("--batch-size", type=int, default=4, help="calibration sentences per batch")
    parser.add_argument("--folds", type=int, default=2)
    parser.add_argument("--real-tokens-only", action="store_true",
                        help="Hessians from non-padding tokens only (activation scales still see every token)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads (GPTQ's column loop is many small ops: on a shared, loaded CPU the "
                             "intra-op thread barriers made it ~60x slower with 2 threads than with 1)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model, tok = load_minilm()
    calib_batches = [encode(tok, CALIBRATION_SENTENCES[i:i + args.batch_size])
                     for i in range(0, len(CALIBRATION_SENTENCES), args.batch_size)]
    calib_all, evaluation = encode(tok, CALIBRATION_SENTENCES), encode(tok, EVAL_SENTENCES)
    act_scales, hessians = calibrate(model, calib_batches, args.folds, args.real_tokens_only)
    tokens = int(next(iter(hessians.values())).tokens.sum())
    print(f"calibration: {len(calib_batches)} batches, {tokens} tokens per linear "
          f"({'real tokens only' if args.real_tokens_only else 'padding included'}), "
          f"{args.folds} folds; evaluation: {len(EVAL_SENTENCES)} held-out sentences")
    ref_eval, ref_calib = sentence_embeddings(model, evaluation), sentence_embeddings(model, calib_all)
    hess_mb = sum(h.nbytes for h in hessians.values()) / 2**20
    print(f"Hessian accumulators: {hess_mb:.1f} MiB for {len(hessians)} linears (fp64, {args.folds} folds)\n")
    print("| variant | eval mean cos | eval min cos | calib mean cos | damping chosen (count) | rounding CPU s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for variant in args.variants.split(","):
        if variant.endswith("-seq"):
            weights, dampings, seconds = sequential_weights(model, calib_batches, act_scales, variant, args.folds,
                                                            args.real_tokens_only)
        else:
            weights, dampings, seconds = quantize_weights(model, hessians, variant)
        with fake_quantized(model, weights, act_scales):
            ev, ca = cosines(model, evaluation, ref_eval), cosines(model, calib_all, ref_calib)
        counts = collections.Counter(f"{d:g}" for d in dampings.values())
        chosen = ", ".join(f"{d}: {c}" for d, c in sorted(counts.items(), key=lambda kv: float(kv[0]))) or "-"
        label = VARIANTS.get(variant) or f"GPTQ, fixed damping {variant.removeprefix('gptq-d')}"
        print(f"| {label} | {ev.mean():.5f} | {ev.min():.5f} | {ca.mean():.5f} | {chosen} | "
              f"{seconds:.1f} |", flush=True)
    print(f"\n(median eval cos of the last row: {statistics.median(ev.tolist()):.5f})")


if __name__ == "__main__":
    main()
