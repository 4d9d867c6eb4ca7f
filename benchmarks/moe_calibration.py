"""MEASURED: how MoE activation scales should be grouped, and what an expert without calibration data gets.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/moe_calibration.py [--seeds 3]

Model: a small ``MixtralForCausalLM`` (hidden 64, FFN 128, 2 layers, 8 experts, top-2, random weights,
initializer_range 0.05), in three flavours: "homogeneous" (experts as initialised, statistically alike),
"hetero 4" and "hetero 32" (expert e's gate_up rows ×a_e and down ×1/a_e², a_e log-uniform in [1/4, 4] or
[1/32, 32]: the same function, but the down projection's input range differs between experts by up to
~256× or ~10⁶×, as trained experts' intermediate ranges differ). Only the experts run in FP8 (every other
op is skipped by an override), so the error is the experts' alone.

Metrics on held-out batches (8 × [4, 32] random token ids; calibration: 8 other such batches):
* ``logits rel. err``: ‖logits_fp8 − logits_fp32‖ / ‖logits_fp32‖ (mean over batches);
* ``block SQNR``: per MoE experts call, 10·log10(‖y‖² / ‖y_fp8 − y‖²) against the fp32 experts on the same
  input (inputs captured with a forward hook), averaged over calls, in dB.

Table 1 compares groupings of the static scales (gate_up input ``x``, down input ``h``) with dynamic
scaling. Table 2 calibrates on one short batch ([1, 4] tokens: 8 rows per layer for 8 experts, so several
experts see nothing) and compares what those experts get: the max / mean / min over the calibrated
experts, against an oracle (their scales from the full calibration set).
"""

from __future__ import annotations

import argparse
import math
import warnings

import torch
from transformers import MixtralConfig, MixtralForCausalLM
from transformers.utils import logging as hf_logging

import dbr_quant as dq
from dbr_quant.moe.experts import MoeState, has_data
from dbr_quant.qconfig import Override, QConfig, TensorQConfig

hf_logging.set_verbosity_error()
VOCAB = 256


def build(seed: int, spread: float) -> MixtralForCausalLM:
    torch.manual_seed(seed)
    cfg = MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2,
                        max_position_embeddings=128, initializer_range=0.05, experts_implementation="grouped_mm")
    m = MixtralForCausalLM(cfg).eval()
    if spread > 1:
        with torch.no_grad():
            for layer in m.model.layers:
                ex = layer.mlp.experts
                a = torch.exp(torch.empty(ex.num_experts).uniform_(-math.log(spread), math.log(spread)))
                ex.gate_up_proj.mul_(a[:, None, None])
                ex.down_proj.div_(a[:, None, None] ** 2)
    return m


def batches(n: int, shape: tuple[int, int], seed: int) -> list[dict]:
    g = torch.Generator().manual_seed(seed)
    return [{"input_ids": torch.randint(0, VOCAB, shape, generator=g)} for _ in range(n)]


EXPERTS_ONLY = (Override(pattern=r"^(?!.*\.experts\.)", skip=True),)


def convert(model, cal, dynamic=False, per_token=False, x_amax=None):
    """Prepare, calibrate, convert; ``x_amax`` (a dict) collects each experts module's per-expert amax of
    its gate_up input rows during calibration (dbr_quant itself keeps one for all experts)."""
    qc = QConfig(overrides=EXPERTS_ONLY, dynamic=dynamic,
                 activation=TensorQConfig(granularity="token" if per_token else "tensor"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = dq.prepare(model, example_kwargs=cal[0], qconfig=qc)
        handles = []
        if x_amax is not None:
            for name, mod in p.named_modules():
                if name.endswith("mlp.experts"):
                    handles.append(mod.register_forward_pre_hook(_collect(name, mod.num_experts, x_amax)))
        if not dynamic:
            dq.calibrate(p, cal, progress=False)
        for h in handles:
            h.remove()
        return dq.convert(p)


def _collect(name: str, num_experts: int, x_amax: dict):
    def hook(mod, args):
        x, ids = args[0], args[1]
        amax = x_amax.setdefault(name, torch.full((num_experts,), float("nan")))
        for e in range(num_experts):
            rows = (ids == e).any(-1)
            if rows.any():
                amax[e] = torch.fmax(amax[e], x[rows].abs().max())
    return hook


def states(model) -> list[MoeState]:
    return [st for st in model.__dict__["_dbr_record"].states if isinstance(st, MoeState)]


def down_scales(st: MoeState) -> tuple[torch.Tensor, torch.Tensor]:
    """(each expert's own down-input scale, NaN where it had no data; has-data mask)."""
    obs = [st.observers[f"1_input_e{e}"] for e in range(st.spec.num_experts)]
    ok = torch.tensor([has_data(o) and bool(st.rows[e] > 0) for e, o in enumerate(obs)])
    s = torch.stack([o.scale().reshape(()) if ok[e] else torch.tensor(float("nan")) for e, o in enumerate(obs)])
    return s, ok


def set_scales(model, x_scale, h_scale) -> None:
    """Replace the frozen scales: x_scale(state) -> 0-d or [E]; h_scale(own [E], mask) -> [E]."""
    for st in states(model):
        st._buffers["scale_0_input"] = x_scale(st)
        st._buffers["scale_1_input"] = h_scale(*down_scales(st))


def evaluate(fp32, fp8, evals) -> tuple[float, float]:
    """(mean logits relative error, mean experts-block SQNR dB)."""
    ref_experts = {name: mod for name, mod in fp32.named_modules() if name.endswith("mlp.experts")}
    sqnr: list[float] = []

    def hook(name):
        def fn(mod, args, out):
            with torch.no_grad():
                y = ref_experts[name](*[a.clone() for a in args])
            sqnr.append(10 * math.log10(float(y.pow(2).sum()) / max(float((out - y).pow(2).sum()), 1e-30)))
        return fn

    handles = [mod.register_forward_hook(hook(name)) for name, mod in fp8.named_modules()
               if name.endswith("mlp.experts")]
    errs = []
    with torch.no_grad():
        for b in evals:
            ref = fp32(**b).logits
            errs.append(float((fp8(**b).logits - ref).norm() / ref.norm()))
    for h in handles:
        h.remove()
    return sum(errs) / len(errs), sum(sqnr) / len(sqnr)


def _grouping_variants(m, cal, ev) -> dict[str, tuple[float, float]]:
    x_amax: dict = {}
    c = convert(m, cal, x_amax=x_amax)
    shared_x = {st.fqn: st.frozen_scale(st.seen_ops[0], "input").clone() for st in states(c)}

    def x_per_expert(st):  # experts whose rows never came: the max over the others (as for h)
        a = x_amax[st.fqn]
        return torch.where(torch.isnan(a), a.nan_to_num(0).max(), a) / 448.0

    def own_h(s, ok):
        return torch.where(ok, s, s[ok].max())

    def max_h(s, ok):
        return s[ok].max().expand_as(s).clone()

    variants = {
        "shared x, per-expert h (dbr_quant default)": (lambda st: shared_x[st.fqn], own_h),
        "per-expert x and h": (x_per_expert, own_h),
        "shared x and h (max over experts)": (lambda st: shared_x[st.fqn], max_h),
    }
    out = {}
    for name, (xs, hs) in variants.items():
        set_scales(c, xs, hs)
        out[name] = evaluate(m, c, ev)
    for name, per_token in (("dynamic per-token x and h", True), ("dynamic per-tensor x and h", False)):
        out[name] = evaluate(m, convert(m, cal, True, per_token), ev)
    return out


def _print(label: str, results: dict[str, list[tuple[float, float]]], extra: str = "") -> None:
    for name, rs in results.items():
        err = sum(r[0] for r in rs) / len(rs)
        snr = sum(r[1] for r in rs) / len(rs)
        print(f"{label}{name:<44} {err:>16.5f} {snr:>14.2f}{extra}")


def table1(seeds: int) -> None:
    print("Table 1: grouping of static activation scales (full calibration: 8 x [4, 32])")
    print(f"{'model':<12} {'scales (x: gate_up input, h: down input)':<44} {'logits rel. err':>16} "
          f"{'block SQNR dB':>14}")
    for spread, label in ((1, "homogeneous"), (4, "hetero 4"), (32, "hetero 32")):
        results: dict[str, list[tuple[float, float]]] = {}
        for seed in range(seeds):
            m = build(seed, spread)
            per = _grouping_variants(m, batches(8, (4, 32), 100 + seed), batches(8, (4, 32), 200 + seed))
            for name, r in per.items():
                results.setdefault(name, []).append(r)
        _print(f"{label:<12} ", results)


def _fallback_variants(m, full, few_cal, ev) -> tuple[dict[str, tuple[float, float]], int]:
    oracle = {st.fqn: st.frozen_scale(st.seen_ops[1], "input").clone() for st in states(convert(m, full))}
    c = convert(m, few_cal)
    few = {st.fqn: st.rows < 8 for st in states(c)}
    rules = {
        "max over calibrated (dbr_quant default)": lambda st, s, ok: torch.where(ok, s, s[ok].max()),
        "mean over calibrated": lambda st, s, ok: torch.where(ok, s, s[ok].mean()),
        "min over calibrated": lambda st, s, ok: torch.where(ok, s, s[ok].min()),
        "max, also for experts with < 8 rows": lambda st, s, ok: torch.where(ok & ~few[st.fqn], s, s[ok].max()),
        "oracle (own scale from full calibration)": lambda st, s, ok: torch.where(ok, s, oracle[st.fqn]),
    }
    out = {}
    for name, rule in rules.items():
        for st in states(c):
            st._buffers["scale_1_input"] = rule(st, *down_scales(st))
        out[name] = evaluate(m, c, ev)
    return out, sum(int((st.rows == 0).sum()) for st in states(c))


def table2(seeds: int) -> None:
    print("\nTable 2: experts without calibration tokens (calibration: 1 x [1, 4] tokens; hetero 4)")
    print(f"{'down-input scale of experts without data':<44} {'logits rel. err':>16} {'block SQNR dB':>14}")
    results: dict[str, list[tuple[float, float]]] = {}
    missing = []
    for seed in range(seeds):
        m = build(seed, 4)
        per, n = _fallback_variants(m, batches(8, (4, 32), 100 + seed), batches(1, (1, 4), 300 + seed),
                                    batches(8, (4, 32), 200 + seed))
        missing.append(n)
        for name, r in per.items():
            results.setdefault(name, []).append(r)
    _print("", results)
    print(f"(experts without calibration rows: {sum(missing) / len(missing):.1f} of 16 per model, mean over seeds)")


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args()
    table1(args.seeds)
    table2(args.seeds)
