"""dbr_quant next to optimum-quanto's W8A8 FP8 on the real all-MiniLM-L6-v2, timed side by side on this CPU.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/quanto_compare.py [--threads 1] [--rounds 7]

Issue #10's row "dbr_quant best / optimum-quanto W8A8 FP8" (goal <= 0.4). quanto: ``quantize(weights=qfloat8,
activations=qfloat8)`` (E4M3, per-channel weights, per-tensor static activation scales), ``Calibration()`` over the
calibration sentences, then ``freeze``. dbr_quant: prepare / calibrate / convert on the same sentences, then
converted eager, ``rewrite`` + ``torch.compile`` and ``rewrite`` + ``compile_frozen``, once per CPU GEMM path
(``use_cpu_gemm``; quanto ignores it).
Per batch size every variant runs in one interleaved rotation; ratios are medians over rounds of the two times
measured in the same round; "best" is dbr_quant's faster variant on that path (by median time). Accuracy: the
embedding cosine vs fp32 on the held-out sentences, so the speed comparison is at comparable accuracy.
On CPU quanto 0.2.7 has no FP8 kernel: each QLinear quantizes its input to E4M3 (a pre-hook), then
``quanto::qbytes_mm`` upcasts activations and weights to the model dtype (fp32 here), rescales the weights and
runs an fp32 matmul (optimum/quanto/library/qbytes_mm.py), so it is slower than fp32 eager.
Needs optimum-quanto (dev only): pip install optimum-quanto==0.2.7
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import median, minilm, paired_ratio, time_interleaved  # noqa: E402
from run import Pinned, best_ratio  # noqa: E402

from dbr_quant.examples.minilm import (  # noqa: E402
    EVAL_SENTENCES,
    encode,
    sentence_embeddings,
)
from dbr_quant.fx_rewriter import compile_frozen, rewrite  # noqa: E402
from dbr_quant.kernels import use_cpu_gemm
from dbr_quant.kernels.cpu import features as cpu  # noqa: E402

QUANTO_VERSION = "0.2.7"
LABELS = {"fp32": "fp32 eager", "quanto": "quanto W8A8 FP8 (frozen)", "conv": "dbr_quant converted eager",
          "compiled": "dbr_quant rewrite + torch.compile", "frozen": "dbr_quant rewrite + compile_frozen"}


DBR_VARIANTS = ("conv", "compiled", "frozen")


def quanto_w8a8_fp8(model: torch.nn.Module, calib: list[dict]) -> torch.nn.Module:
    """A copy of ``model`` quantized by optimum-quanto as its README says: quantize, calibrate, freeze."""
    try:
        from optimum.quanto import Calibration, freeze, qfloat8, quantize
    except ImportError as e:
        raise SystemExit(f"benchmarks/quanto_compare.py needs optimum-quanto: "
                         f"pip install optimum-quanto=={QUANTO_VERSION}") from e
    qmodel = copy.deepcopy(model)
    quantize(qmodel, weights=qfloat8, activations=qfloat8)  # qfloat8 is qfloat8_e4m3fn
    with torch.no_grad(), Calibration():
        for batch in calib:
            qmodel(**batch)
    freeze(qmodel)
    return qmodel


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadier on a shared machine)")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--sentences", default="1,8,32", help="comma-separated batch sizes (sentences)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    m = minilm()
    model, tok, converted = m.model, m.tokenizer, m.converted
    quanto = quanto_w8a8_fp8(model, m.calibration)
    graph = rewrite(converted)
    models = {"fp32": model, "quanto": quanto}
    for path in cpu.GEMM_PATHS:
        with use_cpu_gemm(path):
            frozen = compile_frozen(copy.deepcopy(graph))  # compiles at its first call, with this path pinned
        # its own copy of the graph: dynamo caches compiled code per code object, not per GEMM path
        compiled = torch.compile(torch.fx.GraphModule(graph, copy.deepcopy(graph.graph)), fullgraph=True)
        models[f"conv@{path}"], models[f"compiled@{path}"] = Pinned(converted, path), Pinned(compiled, path, True)
        models[f"frozen@{path}"] = Pinned(frozen, path)

    import optimum.quanto
    print(f"dbr_quant vs optimum-quanto {optimum.quanto.__version__} W8A8 FP8: all-MiniLM-L6-v2 on CPU, "
          f"{torch.get_num_threads()} threads, torch {torch.__version__}, {args.rounds} interleaved rounds; "
          "ratio = median over rounds of the two times measured in the same round")
    print(cpu.describe())
    sizes = [int(n) for n in args.sentences.split(",")]
    batches = {(f"{n} sentences" if n > 1 else "batch 1"): encode(tok, EVAL_SENTENCES[:n]) for n in sizes}
    times = {label: time_interleaved({k: (lambda m=m, b=b: m(**b)) for k, m in models.items()}, rounds=args.rounds)
             for label, b in batches.items()}

    head = f"{'variant':<36}{'GEMM':>5}" + "".join(f"{label + ' /fp32':>20}{'ms':>8}" for label in batches)
    print(f"\n{head}\n{'-' * len(head)}")
    for k in models:
        name, _, path = k.partition("@")
        print(f"{LABELS[name]:<36}{path or '-':>5}" + "".join(
            f"{paired_ratio(times[label], k, 'fp32'):>20.2f}{median(times[label][k]) * 1e3:>8.1f}"
            for label in batches))
    print()
    for path in cpu.GEMM_PATHS:
        print(f"dbr_quant best / quanto, {path} GEMMs: " + ", ".join(
            f"{label} {best_ratio(times[label], [f'{k}@{path}' for k in DBR_VARIANTS], ['quanto']):.2f}"
            for label in batches) + " (goal <= 0.4)")

    held_out = encode(tok, EVAL_SENTENCES)
    reference = sentence_embeddings(model, held_out)
    cosine = lambda m: (reference * sentence_embeddings(m, held_out)).sum(-1).mean().item()  # noqa: E731
    print(f"\nembedding cosine vs fp32 ({len(EVAL_SENTENCES)} held-out sentences): quanto {cosine(quanto):.4f}, "
          + ", ".join(f"dbr_quant converted ({path} GEMMs) {cosine(models[f'conv@{path}']):.4f}"
                      for path in cpu.GEMM_PATHS))


if __name__ == "__main__":
    main()
