"""One command, two tables: dbr_quant on the real all-MiniLM-L6-v2, measured side by side on this CPU.

    .venv/bin/python benchmarks/run.py --threads 1 --rounds 5       (make bench: --rounds 25)

Prints the CPU features and the CPU GEMM path that runs here ($DBR_QUANT_CPU_GEMM, else auto from the CPU's
features), then one table per path: first that path, then the other one forced (``--cpu-gemm bf16|fp32|auto``
times one path only). Every path's FP8 rows are timed in the same rotation as the fp32 / bf16 eager anchors.
Columns: batch 1, 8 sentences (`make demo`'s "forward time, 8 sentences") and 32 sentences (``--sentences``).
Each ratio is the median over rounds of the two times measured in the same round (lower is faster); ms is the
median time. Under each table: the tiny stack (48 × Linear(16,16)+ReLU, batch 1; benchmarks/tiny_stack.py:
converted / fp32 and the runtime's own µs per quantized op, kernels replaced by no-ops; thread CPU time, one
thread whatever ``--threads`` says, at least 15 rounds, in a fresh process), the embedding cosine against fp32
on held-out sentences; then weight bytes and accuracy by scale granularity.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import tiny_stack  # noqa: E402
from block_accuracy import SCHEMES, format_rows, minilm_rows  # noqa: E402
from harness import linear_weight_bytes, median, minilm, paired_ratio, state_dict_bytes, time_interleaved  # noqa: E402

from dbr_quant.examples.minilm import (  # noqa: E402
    EVAL_SENTENCES,
    encode,
    sentence_embeddings,
)
from dbr_quant.fx_rewriter import FrozenCompiled, compile_frozen, gemm_path_cache_key, rewrite  # noqa: E402
from dbr_quant.kernels import use_cpu_gemm
from dbr_quant.kernels.cpu import features as cpu  # noqa: E402

LABELS = {"fp32": "fp32 eager", "bf16": "bf16 eager", "bf16+frozen": "bf16 + compile, frozen",
          "fp32+frozen": "fp32 + compile, frozen",
          "calib": "calibration forward (prepared)", "fp8": "FP8 converted eager", "fx": "FP8 rewritten (FX) eager",
          "fx+compile": "FP8 rewritten + compile", "fx+frozen": "FP8 rewritten + compile, frozen"}
_COMPILED_GOAL = "best of the two <= 1.1 x the faster HP compiled (line below)"
GOALS = {"calib": "<= 1.3 x fp32 (batch 1)", "fp8": "<= 1.2 / 1.0 / 1.0 x fp32 (1 / 8 / 32)",
         "fx": "< converted eager", "fx+compile": _COMPILED_GOAL, "fx+frozen": _COMPILED_GOAL,
         "bf16+frozen": "(what bf16 reaches the same way)",
         "fp32+frozen": "(what fp32 reaches the same way)"}
# "frozen" = compiled with inductor's freezing (dbr_quant.fx_rewriter.compile_frozen): the weights are constants,
# so the FP8 weight upcast is folded at compile time (the compiled artifact holds bf16 or fp32 copies of the
# weights, per the CPU GEMM path) and oneDNN/MKL get pre-packed weights. Without it the FP8 weights are upcast on
# every call.


class Pinned:
    """A model called with one CPU GEMM path forced (a compiled one compiles with it at its first call, with
    torch.compile's caches keyed on it: ``gemm_path_cache_key``)."""

    def __init__(self, model, path: str, compiled: bool = False) -> None:
        self.model, self.path, self.compiled = model, path, compiled

    def __call__(self, *args, **kwargs):
        with use_cpu_gemm(self.path), gemm_path_cache_key(self.path) if self.compiled else contextlib.nullcontext():
            return self.model(*args, **kwargs)


def fp8_models(converted, graph, path: str, compile: bool) -> dict[str, object]:
    """The FP8 variants with ``path`` pinned; compiled ones get their own copy of the graph (dynamo caches
    compiled code per code object and does not guard on the GEMM path)."""
    models = {"fp8": converted, "fx": graph}
    if compile:
        models["fx+compile"] = torch.compile(torch.fx.GraphModule(graph, copy.deepcopy(graph.graph)), fullgraph=True)
        with use_cpu_gemm(path):
            models["fx+frozen"] = compile_frozen(copy.deepcopy(graph))
    return {k: Pinned(m, path, compiled=k != "fp8" and k != "fx") for k, m in models.items()}


def gemm_paths(choice: str | None) -> list[str]:
    """The CPU GEMM paths to time, the one that runs here first: default (and ``both``) the current path
    ($DBR_QUANT_CPU_GEMM, else auto from the CPU's features) then the other one forced; else just ``choice``."""
    if choice in (None, "both"):
        first = cpu.current_gemm_path()
        return [first, *(p for p in cpu.GEMM_PATHS if p != first)]
    return [cpu.detected_gemm_path() if choice == "auto" else choice]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile (it takes ~30 s per path)")
    parser.add_argument("--no-accuracy", action="store_true", help="skip the accuracy-by-granularity rows (~20 s)")
    parser.add_argument("--no-tiny", action="store_true", help="skip the tiny-stack rows (benchmarks/tiny_stack.py)")
    parser.add_argument("--only", default="", help="comma-separated variants to time besides the fp32 and bf16 "
                        f"anchors (of {','.join(LABELS)}); default all")
    parser.add_argument("--cpu-gemm", choices=["auto", "bf16", "fp32", "both"], default=None,
                        help="CPU GEMM path of the FP8 rows; default (= both): a table for the path that runs here "
                        "($DBR_QUANT_CPU_GEMM, else auto), then a table with the other path forced")
    parser.add_argument("--sentences", default="1,8,32", help="comma-separated batch sizes (sentences); 8 is "
                        "`make demo`'s 'forward time, 8 sentences'")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice); 1 is "
                        "steadier on a loaded machine, where a straggling OpenMP thread stalls every op")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    paths = gemm_paths(args.cpu_gemm)
    torch.manual_seed(0)
    m = minilm()
    model, tok, prepared, converted = m.model, m.tokenizer, m.prepared, m.converted
    bf16 = copy.deepcopy(model).to(torch.bfloat16)
    graph = rewrite(converted)
    models = {"fp32": model, "bf16": bf16, "calib": prepared}
    gemm = {}  # FP8 variant "name@path" → its CPU GEMM path
    for path in paths:
        for k, m in fp8_models(converted, graph, path, not args.no_compile).items():
            models[f"{k}@{path}"], gemm[f"{k}@{path}"] = m, path
    if not args.no_compile:
        models["bf16+frozen"] = FrozenCompiled(copy.deepcopy(bf16))
        models["fp32+frozen"] = FrozenCompiled(copy.deepcopy(model))
    models = {k: models[k] for k in sorted(models, key=lambda k: list(LABELS).index(k.split("@")[0]))}

    if args.only:
        keep = {"fp32", "bf16", *args.only.split(",")}
        models = {k: m for k, m in models.items() if k.split("@")[0] in keep}
    print(f"dbr_quant benchmark: all-MiniLM-L6-v2 on CPU, {torch.get_num_threads()} threads, "
          f"torch {torch.__version__}, {args.rounds} interleaved rounds; ratio = median over rounds of the two "
          "times measured in the same round; compiled rows are timed in their own rotation with the fp32 and bf16 "
          "anchors; every path's FP8 rows are timed in the same rotation")
    print(cpu.describe())
    print(f"FP8 rows run: {' then '.join(paths)} GEMMs" + (" (a table each)" if len(paths) > 1 else ""))
    sizes = [int(n) for n in args.sentences.split(",")]
    batches = {(f"{n} sentences" if n > 1 else "batch 1"): encode(tok, EVAL_SENTENCES[:n]) for n in sizes}
    # Two interleaved groups, each with the fp32 and bf16 anchors: eager variants, then compiled ones.
    # Mixed into one rotation, the compiled variants disturbed the eager rows (converted/fp32 read 1.00
    # mixed vs 0.88 alone in back-to-back runs), so each row is paired only with anchors of its own group.
    compiled = [k for k in models if "+" in k]
    groups = {"eager": [k for k in models if k not in compiled], "compiled": ["fp32", "bf16", *compiled]}
    times = {(label, name): time_interleaved({k: (lambda m=models[k], b=b: m(**b)) for k in group},
                                             rounds=args.rounds)
             for label, b in batches.items() for name, group in groups.items() if len(group) > 2}

    def group_times(label: str, k: str) -> dict[str, list[float]]:
        group = "compiled" if k in compiled or (label, "eager") not in times else "eager"  # anchors: either
        return times[(label, group)]

    tiny = {} if args.no_tiny else {path: tiny_stack.measure_in_fresh_process(path, rounds=max(args.rounds, 15))
                                    for path in paths}
    for i, path in enumerate(paths):
        how = "the path that runs here" if i == 0 else "forced"
        print(f"\n[{path} GEMMs, {how}]")
        print_table([k for k in models if gemm.get(k, path) == path], batches, group_times, gemm)
        if {f"fx@{path}", f"fp8@{path}"} <= set(models):
            print("rewritten (FX) / converted eager: " + ", ".join(
                f"{label} {paired_ratio(group_times(label, f'fx@{path}'), f'fx@{path}', f'fp8@{path}'):.2f}"
                for label in batches))
        if f"fp8@{path}" in models and "8 sentences" in batches:
            print("`make demo` 'forward time, 8 sentences' fp8 / fp32: "
                  f"{paired_ratio(group_times('8 sentences', f'fp8@{path}'), f'fp8@{path}', 'fp32'):.2f} (goal <= 1.0)")
        fp8_compiled = [k for k in (f"fx+compile@{path}", f"fx+frozen@{path}") if k in models]
        # the compiled goal: the best FP8 compiled <= 1.1 x the faster of bf16 / fp32 compiled on that CPU;
        # the fp32 table stands in for a CPU without BF16 dot products, whose faster one is fp32 compiled
        hp_compiled = [k for k in (("bf16+frozen", "fp32+frozen") if path == "bf16" else ("fp32+frozen",))
                       if k in models]
        if fp8_compiled and hp_compiled:
            print(f"best FP8 compiled / faster of {' and '.join(hp_compiled)}: " + ", ".join(
                f"{label} {best_ratio(group_times(label, fp8_compiled[0]), fp8_compiled, hp_compiled):.2f}"
                for label in batches) + " (goal <= 1.1)")
        if path in tiny:
            print(tiny_stack.format_row(path, tiny[path]))
        with use_cpu_gemm(path):
            print("embedding cosine vs fp32 (held-out sentences): " + ", ".join(
                f"{label} {(sentence_embeddings(model, b) * sentence_embeddings(converted, b)).sum(-1).mean():.4f}"
                for label, b in batches.items()))
    if len(paths) == 2 and {"fp8@fp32", "fp8@bf16"} <= set(models):
        print("\nconverted eager, fp32 GEMMs / bf16 GEMMs: " + ", ".join(
            f"{label} {paired_ratio(group_times(label, 'fp8@fp32'), 'fp8@fp32', 'fp8@bf16'):.2f}" for label in batches))
    wb, wq = linear_weight_bytes(model), linear_weight_bytes(converted)
    sb, sq = state_dict_bytes(model), state_dict_bytes(converted)
    print(f"linear weight bytes: fp32 {wb / 2**20:.2f} MiB -> fp8 {wq / 2**20:.2f} MiB "
          f"(ratio {wq / wb:.3f}, goal <= 0.27)")
    print(f"whole state_dict:    fp32 {sb / 2**20:.2f} MiB -> fp8 {sq / 2**20:.2f} MiB (ratio {sq / sb:.3f}; "
          "embeddings, norms and biases stay fp32)")
    if not args.no_accuracy:
        print_granularity_accuracy(model, tok)


def best_ratio(times: dict[str, list[float]], num: list[str], den: list[str]) -> float:
    """Paired ratio of the fastest (median) of ``num`` to the fastest of ``den``, all timed in one rotation."""
    fastest = lambda keys: min(keys, key=lambda k: median(times[k]))  # noqa: E731
    return paired_ratio(times, fastest(num), fastest(den))


def print_table(keys: list[str], batches: dict, group_times, gemm: dict[str, str]) -> None:
    """One row per variant: ratio to fp32 eager and to bf16 eager, and fp32 ms, per batch size."""
    head = f"{'variant':<32}{'GEMM':>5}" + "".join(f"{label + ' /fp32':>20}{'/bf16':>7}{'ms':>8}" for label in batches)
    print(head + f"   goal\n{'-' * (len(head) + 40)}")
    for k in keys:
        row = f"{LABELS[k.split('@')[0]]:<32}{gemm.get(k, '-'):>5}"
        for label in batches:
            t = group_times(label, k)
            row += f"{paired_ratio(t, k, 'fp32'):>20.2f}{paired_ratio(t, k, 'bf16'):>7.2f}{median(t[k]) * 1e3:>8.1f}"
        print(row + f"   {GOALS.get(k.split('@')[0], '')}")


def print_granularity_accuracy(model, tok) -> None:
    """Block-scaled FP8 (the DeepSeek-V3 / Qwen3-FP8 layout) next to per-tensor and per-channel/per-token FP8:
    embedding cosine and SQNR vs fp32 on the held-out sentences (benchmarks/block_accuracy.py has more)."""
    schemes = {k: v for k, v in SCHEMES.items() if "32x32" not in k}
    print("\naccuracy by scale granularity (32 held-out sentences, each variant converted on its own):")
    print(format_rows(minilm_rows(model, tok, schemes)))


if __name__ == "__main__":
    main()
