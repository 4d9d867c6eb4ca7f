"""FP8 on this CPU against the faster high-precision dtype here (issue #25): decode and MiniLM, side by side.

    PYTHONPATH=. .venv/bin/python benchmarks/cpu_speed.py [--rounds 5] [--tokens 6]      (make bench)
    PYTHONPATH=. taskset -c 1 .venv/bin/python benchmarks/cpu_speed.py --cpu-time        (a loaded machine)

Prints the CPU features and the CPU GEMM path that runs here, then for torch's default thread count and for 1
thread, one table per CPU GEMM path (the one that runs here first, then the other one forced):

* batch-1 greedy decode, tokens/s, of a random Llama (hidden 1024, 16 layers, ~246 M params): the fp32 model,
  the bf16 model, and dbr_quant FP8 converted from the bf16 model (``lm_head`` skipped: high precision);
* the real all-MiniLM-L6-v2, eager, at 1 / 8 / 32 sentences, ms: fp32, bf16, FP8 static (calibrated per-tensor
  activation scales) and FP8 dynamic (per-token activation scales computed at run time).

Every variant of one figure runs in the same rotation, round by round, so load on a shared machine hits all of
them alike; "FP8 / best" is the median over rounds of the FP8 time over the time, in the same round, of whichever
of fp32 / bf16 is faster (by median) at that figure. Decode: each sample times ``--tokens`` greedy steps after an
untimed 8-token prefill (fresh KV cache per sample). The last lines: FP8 linear weight bytes / fp32.

``--cpu-time`` times each sample in CPU time of the one thread that runs it (``time.thread_time``) instead of wall
time, at 1 thread only (other threads' work would go uncounted): on a machine other processes load, a sample then
does not count the time it waited for a core, so the ratios move less (cache and SMT sharing still do). Pin the
process to one core (``taskset -c N``) so the thread is not moved.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import time
import warnings
from collections.abc import Callable

import torch

sys.path.insert(0, os.path.dirname(__file__))
from harness import linear_weight_bytes, median, minilm, paired_ratio, time_interleaved  # noqa: E402

import dbr_quant as dq  # noqa: E402
from dbr_quant.examples.minilm import EVAL_SENTENCES, encode  # noqa: E402
from dbr_quant.kernels import use_cpu_gemm  # noqa: E402
from dbr_quant.kernels.cpu import features as cpu  # noqa: E402

LLAMA = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=16, num_attention_heads=16,
             num_key_value_heads=4, vocab_size=32000, max_position_embeddings=256, tie_word_embeddings=False)
PROMPT = 8
GOALS = {"decode": ">= 1.3 x best (tokens/s)", "static": "<= 1.2 / 1.0 / 1.0 x best (1 / 8 / 32)",
         "dynamic": "<= 1.1 x static"}


def llama_models() -> dict[str, torch.nn.Module]:
    """fp32 and bf16 copies of one random Llama, and FP8 converted from the bf16 one (``lm_head`` high precision)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(0)
    fp32 = LlamaForCausalLM(LlamaConfig(**LLAMA)).eval()
    bf16 = copy.deepcopy(fp32).to(torch.bfloat16)
    qconfig = dq.QConfig(overrides=(dq.Override(pattern="lm_head", skip=True),))
    prepared = dq.prepare(bf16, example_kwargs={"input_ids": torch.randint(0, LLAMA["vocab_size"], (1, PROMPT))},
                          qconfig=qconfig)
    dq.calibrate(prepared, [{"input_ids": torch.randint(0, LLAMA["vocab_size"], (1, 16))}], progress=False)
    return {"fp32": fp32, "bf16": bf16, "fp8": dq.convert(prepared)}


def decoder(model: torch.nn.Module, tokens: int, path: str | None,
            clock: Callable[[], float] = time.perf_counter) -> Callable[[], float]:
    """One sample: ``tokens`` greedy batch-1 steps after an untimed prefill; returns their time on ``clock``."""
    prompt = torch.randint(0, LLAMA["vocab_size"], (1, PROMPT), generator=torch.Generator().manual_seed(1))

    def run() -> float:
        with use_cpu_gemm(path or "auto"), torch.no_grad():
            out = model(input_ids=prompt, use_cache=True)
            t0 = clock()
            for _ in range(tokens):
                out = model(input_ids=out.logits[:, -1:].argmax(-1), past_key_values=out.past_key_values,
                            use_cache=True)
            return clock() - t0
    return run


def time_steps(variants: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    """Like harness.time_interleaved, for variants that time themselves (the decode steps, not the prefill)."""
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():
        fn()  # warm-up
    for _ in range(rounds):
        for k, fn in variants.items():
            samples[k].append(fn())
    return samples


def best_of(times: dict[str, list[float]], label: str) -> str:
    return min(("fp32", "bf16"), key=lambda k: median(times[k]))


def minilm_models() -> tuple[dict[str, torch.nn.Module], object, dict[str, torch.nn.Module]]:
    m = minilm()
    prepared = dq.prepare(m.model, example_kwargs=m.calibration[0],
                          qconfig=dq.QConfig(activation=dq.TensorQConfig(granularity="token"), dynamic=True))
    dq.calibrate(prepared, m.calibration[:1], progress=False)
    hp = {"fp32": m.model, "bf16": copy.deepcopy(m.model).to(torch.bfloat16)}
    return hp, m.tokenizer, {"static": m.converted, "dynamic": dq.convert(prepared)}


def run_tables(args: argparse.Namespace, paths: list[str], llama: dict | None, mini: tuple | None) -> None:
    rows: dict[str, list[str]] = {p: [] for p in paths}
    if llama is not None:
        variants = {k: decoder(llama[k], args.tokens, None, args.clock) for k in ("fp32", "bf16")}
        variants.update({f"fp8@{p}": decoder(llama["fp8"], args.tokens, p, args.clock) for p in paths})
        t = time_steps(variants, args.rounds)
        best = best_of(t, "decode")
        tps = {k: args.tokens / median(v) for k, v in t.items()}
        for p in paths:
            # tokens/s ratio = best's time / FP8's time, paired per round
            ratio = 1 / paired_ratio(t, f"fp8@{p}", best)
            rows[p].append(f"| batch-1 greedy decode, Llama {args.params:.0f} M, tokens/s | {tps['fp32']:.1f} | "
                           f"{tps['bf16']:.1f} | {tps[f'fp8@{p}']:.1f} | {ratio:.2f} x {best} | {GOALS['decode']} |")
    if mini is not None:
        hp, tok, fp8 = mini
        for n in args.sentences:
            batch = encode(tok, EVAL_SENTENCES[:n])
            variants = {k: (lambda m=m, b=batch: m(**b)) for k, m in hp.items()}
            for p in paths:
                for kind, m in fp8.items():
                    variants[f"{kind}@{p}"] = lambda m=m, p=p, b=batch: _pinned(m, p, b)
            t = time_interleaved(variants, rounds=args.rounds, warmup=2, clock=args.clock)
            best = best_of(t, "minilm")
            ms = {k: median(v) * 1e3 for k, v in t.items()}
            for p in paths:
                s, d = f"static@{p}", f"dynamic@{p}"
                rows[p].append(f"| MiniLM eager, {n} sentence{'s' if n > 1 else ''}, ms | {ms['fp32']:.1f} | "
                               f"{ms['bf16']:.1f} | {ms[s]:.1f} static, {ms[d]:.1f} dynamic | "
                               f"{paired_ratio(t, s, best):.2f} / {paired_ratio(t, d, best):.2f} x {best}; "
                               f"dynamic / static {paired_ratio(t, d, s):.2f} | {GOALS['static']}; "
                               f"{GOALS['dynamic']} |")
    for i, p in enumerate(paths):
        how = "the path that runs here" if i == 0 else "forced"
        print(f"\n[{torch.get_num_threads()} thread(s), FP8 on {p} GEMMs, {how}]")
        print("| figure | fp32 | bf16 | dbr_quant FP8 | FP8 / best | goal |\n| --- | --- | --- | --- | --- | --- |")
        print("\n".join(rows[p]))


def _pinned(model: torch.nn.Module, path: str, batch: dict) -> object:
    with use_cpu_gemm(path):
        return model(**batch)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=6, help="greedy decode steps per sample")
    parser.add_argument("--sentences", default="1,8,32")
    parser.add_argument("--threads", default="default,1", help="comma-separated: 'default' (torch's) and/or counts")
    parser.add_argument("--no-llama", action="store_true")
    parser.add_argument("--no-minilm", action="store_true")
    parser.add_argument("--cpu-time", action="store_true",
                        help="time in the running thread's CPU time (time.thread_time), at 1 thread only")
    args = parser.parse_args()
    if args.cpu_time and args.threads != "default,1" and args.threads != "1":
        parser.error("--cpu-time counts one thread's CPU time: run it with --threads 1 (the default becomes 1)")
    if args.cpu_time:
        args.threads = "1"
    args.clock = time.thread_time if args.cpu_time else time.perf_counter
    args.sentences = [int(n) for n in args.sentences.split(",")]
    warnings.simplefilter("ignore")
    default_threads = torch.get_num_threads()
    first = cpu.current_gemm_path()
    paths = [first, *(p for p in cpu.GEMM_PATHS if p != first)]
    clock = "CPU time of the running thread" if args.cpu_time else "wall time"
    print(f"dbr_quant CPU speed (issue #25): torch {torch.__version__}, {args.rounds} interleaved rounds, {clock}, "
          "medians and paired ratios; a shared machine's load moves the ms, less the ratios")
    print(cpu.describe())
    llama = None if args.no_llama else llama_models()
    if llama is not None:
        args.params = sum(p.numel() for p in llama["fp32"].parameters()) / 1e6
    mini = None if args.no_minilm else minilm_models()
    for threads in args.threads.split(","):
        torch.set_num_threads(default_threads if threads == "default" else int(threads))
        run_tables(args, paths, llama, mini)
    torch.set_num_threads(default_threads)
    if mini is not None:
        hp, _, fp8 = mini
        wb, wq = linear_weight_bytes(hp["fp32"]), linear_weight_bytes(fp8["static"])
        print(f"\nMiniLM FP8 linear weight bytes / fp32: {wq / wb:.3f} (goal <= 0.27)")
    if llama is not None:
        skip = {"lm_head"}
        wb = sum(m.weight.numel() * 4 for n, m in llama["fp32"].named_modules()
                 if isinstance(m, torch.nn.Linear) and n not in skip)
        wq = linear_weight_bytes(llama["fp8"]) - llama["fp8"].lm_head.weight.numel() * 2
        print(f"Llama FP8 linear weight bytes / fp32 (lm_head, kept bf16, left out): {wq / wb:.3f} (goal <= 0.27)")


if __name__ == "__main__":
    main()
