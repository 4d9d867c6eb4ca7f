"""Sections 5 and 6 of benchmarks/gpu.py (run them through it: ``python benchmarks/gpu.py --only moe|graphs``).

5. MoE experts at Mixtral-8x7B shapes: each scheme's experts computation as a converted model runs it, against a
   bf16 per-expert loop and bf16 ``torch._grouped_mm``.
6. One decode step of a bf16 Llama with Llama-3-8B layers under CUDA graphs (``torch.compile(mode="reduce-overhead")``),
   FP8 via ``rewrite`` against the bf16 model, and both eager.

Both take a :class:`Target`: CUDA with the compiled Triton kernels, or (``--dry``) the CPU, the interpreter and toy
sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from gpu_common import convert, table, timed
from torch import nn


@dataclass(frozen=True)
class Target:
    """Where sections 5 and 6 run: CUDA and the compiled Triton kernels, or (``--dry``) the CPU, the Triton
    interpreter and toy sizes."""

    device: str
    backend: str
    dry: bool


@dataclass(frozen=True)
class MoeShape:
    """An MoE layer: E experts, top_k per token, gate_up [E, 2·inter, hidden] (swiglu), down [E, hidden, inter]."""

    name: str
    experts: int
    top_k: int
    hidden: int
    inter: int
    tokens: tuple[int, ...]


BLOCK = (128, 128)  # DeepSeek-V3's weight blocks (activations: dynamic 1×128 groups)
MIXTRAL = MoeShape("Mixtral-8x7B", 8, 2, 4096, 14336, (16, 4096))
TOY_MOE = MoeShape("toy", 4, 2, 64, 128, (3, 24))


def _bf16_experts_loop(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                       w2: torch.Tensor) -> torch.Tensor:
    """The bf16 baseline as transformers' eager experts run it: per expert hit, gather its tokens, gate_up,
    silu(gate)·up, down, weighted index_add (a host sync per expert for the token lists)."""
    out = torch.zeros_like(x)
    inter = w2.shape[-1]
    for e in range(w13.shape[0]):
        token, slot = torch.where(ids == e)
        if token.numel():
            h = x[token] @ w13[e].t()
            y = (nn.functional.silu(h[:, :inter]) * h[:, inter:]) @ w2[e].t()
            out.index_add_(0, token, y * weights[token, slot, None])
    return out


def _bf16_grouped_mm(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13_t: torch.Tensor,
                     w2_t: torch.Tensor) -> torch.Tensor:
    """bf16 experts on ``torch._grouped_mm`` (cuBLAS/CUTLASS grouped GEMM; w13_t [E, hidden, 2·inter] and w2_t
    [E, inter, hidden] column-major views): rows sorted by expert, two grouped GEMMs, weighted index_add."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    offs = torch.cumsum(torch.bincount(flat, minlength=w13_t.shape[0]), 0).to(torch.int32)
    token = order // ids.shape[1]
    h = torch._grouped_mm(x[token], w13_t, offs=offs)
    inter = w2_t.shape[1]
    y = torch._grouped_mm(nn.functional.silu(h[:, :inter]) * h[:, inter:], w2_t, offs=offs)
    return torch.zeros_like(x).index_add_(0, token, y * weights.reshape(-1)[order, None])


def _moe_weights(shape: MoeShape, device: str) -> dict[str, torch.Tensor]:
    """bf16 expert weights (std 0.02) and their FP8 forms: per-channel E4M3 (W8A8 and W8A16), MXFP8 codes and
    128×128 blocks, quantized expert by expert on the device."""
    from dbr_quant import kernels
    from dbr_quant.formats import FP8Format

    e, h, i = shape.experts, shape.hidden, shape.inter
    out: dict[str, torch.Tensor] = {"w13": torch.empty(e, 2 * i, h, device=device, dtype=torch.bfloat16),
                                    "w2": torch.empty(e, h, i, device=device, dtype=torch.bfloat16)}
    for name in ("w13", "w2"):
        w = out[name]
        w.normal_(0, 0.02)
        q, s = zip(*(kernels.dynamic_quantize(w[j], FP8Format.E4M3, per_token=True) for j in range(e)), strict=True)
        out[f"{name}_q"], out[f"{name}_s"] = torch.stack(q), torch.stack(s).reshape(e, -1)
        mq, codes = zip(*(kernels.mx_quantize(w[j]) for j in range(e)), strict=True)
        out[f"{name}_mx"], out[f"{name}_codes"] = torch.stack(mq), torch.stack(codes)
        bq, bs = zip(*(kernels.block_quantize_weight(w[j], BLOCK) for j in range(e)), strict=True)
        out[f"{name}_bq"], out[f"{name}_bs"] = torch.stack(bq), torch.stack(bs)
    return out


def _moe_schemes(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, wts: dict[str, torch.Tensor],
                 x_scale: torch.Tensor, h_scale: torch.Tensor) -> dict[str, Callable[[], object]]:
    """Each row of section 5: a call of one experts computation on (x, ids, weights)."""
    from dbr_quant.formats import FP8Format
    from dbr_quant.moe.compute import fp8_experts_compute

    kw = {"bias13": None, "bias2": None, "activation": "swiglu", "fmt": FP8Format.E4M3, "per_token": False,
          "out_dtype": torch.bfloat16}
    fp8 = (wts["w13_q"], wts["w13_s"], wts["w2_q"], wts["w2_s"])
    mx = (wts["w13_mx"], wts["w13_codes"], wts["w2_mx"], wts["w2_codes"])
    blocked = (wts["w13_bq"], wts["w13_bs"], wts["w2_bq"], wts["w2_bs"])
    w13_t, w2_t = wts["w13"].transpose(1, 2), wts["w2"].transpose(1, 2)
    return {"bf16 per-expert loop": lambda: _bf16_experts_loop(x, ids, weights, wts["w13"], wts["w2"]),
            "bf16 torch._grouped_mm": lambda: _bf16_grouped_mm(x, ids, weights, w13_t, w2_t),
            "FP8 W8A8 static": lambda: fp8_experts_compute(x, ids, weights, *fp8, x_scale, h_scale, **kw),
            "FP8 weight-only W8A16": lambda: fp8_experts_compute(x, ids, weights, *fp8, None, None, **kw,
                                                                 weight_only=True),
            "MXFP8": lambda: fp8_experts_compute(x, ids, weights, *mx, None, None, **kw, mx=True),
            "FP8 blocks 128x128, dynamic groups": lambda: fp8_experts_compute(
                x, ids, weights, *blocked, None, None, **kw, block=BLOCK, group=True)}


def _moe_rows(target: Target, shape: MoeShape, wts: dict[str, torch.Tensor], tokens: int,
              rows: list[list[object]]) -> None:
    """Section 5's rows for ``tokens`` tokens, appended to ``rows`` as each is measured."""
    from dbr_quant import kernels

    gen = torch.Generator().manual_seed(tokens)
    dev = target.device
    x = torch.randn(tokens, shape.hidden, generator=gen).to(dev, torch.bfloat16)
    ids = torch.stack([torch.randperm(shape.experts, generator=gen)[:shape.top_k] for _ in range(tokens)]).to(dev)
    weights = torch.rand(tokens, shape.top_k, generator=gen).to(dev, torch.bfloat16)
    # static per-tensor scales, as calibration gives them: x's amax, and twice the swiglu output's amax of expert 0
    x_scale = (x.abs().amax().float() / 448).reshape(())
    h_first = x @ wts["w13"][0].t()
    h_scale = ((nn.functional.silu(h_first[:, :shape.inter]) * h_first[:, shape.inter:]).abs().amax().float()
               / 448 * 2).reshape(())
    flops = 6 * tokens * shape.top_k * shape.hidden * shape.inter
    reps = 2 if target.dry else 10 if tokens > 256 else 25
    times: dict[str, float] = {}
    for name, fn in _moe_schemes(x, ids, weights, wts, x_scale, h_scale).items():
        if target.dry and "_grouped_mm" in name:
            continue  # CUDA only
        try:
            with kernels.use_backend(target.backend), kernels.count_launches() as launches:
                fn()
            with kernels.use_backend(target.backend):
                times[name] = timed(fn, reps=reps)
        except Exception as e:  # noqa: BLE001 - the other schemes' rows still print
            print(f"{tokens} tokens, {name}: {type(e).__name__}: {e}")
            continue
        loop, grouped = times.get("bf16 per-expert loop"), times.get("bf16 torch._grouped_mm")
        t = times[name]
        rows.append([tokens, name, f"{t:.4f}", f"{flops / t / 1e9:.0f}", sum(launches.values()) or "",
                     f"{loop / t:.2f}" if loop else "", f"{grouped / t:.2f}" if grouped else ""])


def moe_section(target: Target, shape: MoeShape) -> None:
    """Section 5: one MoE layer's experts, each scheme as a converted model runs it (moe.compute's
    ``fp8_experts_compute``: routing plan, quantize where the scheme does, gate_up, down + combine)."""
    from dbr_quant import kernels

    print(f"\n## 5. MoE experts, {shape.name} (E={shape.experts}, top_k={shape.top_k}, hidden {shape.hidden}, "
          f"ffn {shape.inter}; swiglu; bf16 in and out)")
    with kernels.use_backend(target.backend):
        wts = _moe_weights(shape, target.device)
    rows: list[list[object]] = []
    try:
        for tokens in shape.tokens:
            _moe_rows(target, shape, wts, tokens, rows)
    finally:  # the rows measured so far, also when the section runs out of time
        table(["tokens", "experts computation", "ms", "TFLOP/s", "our launches", "bf16 loop / this",
               "bf16 grouped_mm / this"], rows)
    print("launches: dbr_quant kernel launches per call (routing plan not counted); > 1 in the ratio columns: this "
          "row is faster. The FP8 rows include quantizing the activations (W8A8: static per-tensor, MX: per 32, "
          "blocks: per 128).")


def _cudagraph_skips() -> int:
    """Inductor's count of graphs it ran without CUDA graphs (a reason is logged with each)."""
    from torch._dynamo.utils import counters

    return int(counters["inductor"]["cudagraph_skips"])


def graphs_section(target: Target) -> None:
    """Section 6: one decode step's forward (M = 1 GEMMs) of a bf16 Llama with Llama-3-8B layers, eager and under
    ``torch.compile(mode="reduce-overhead")`` (CUDA graphs: one replay per call, no per-op host cost), FP8 via
    ``rewrite`` against the bf16 model."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from dbr_quant import kernels
    from dbr_quant.fx_rewriter import rewrite

    print("\n## 6. Decode step under CUDA graphs (torch.compile mode='reduce-overhead'), bf16 Llama, 1 token")
    hidden, inter, heads, kv_heads, vocab = (64, 128, 4, 2, 256) if target.dry else (4096, 14336, 32, 8, 32000)
    # eager attention: with sdpa, rewrite() of a one-token example fails in transformers' sdpa_attention_forward
    # (its is_causal = q_len > 1 is a SymBool when export keeps the size-1 dims symbolic); at one token attention is
    # a few µs either way, and the bf16 model runs the same attention
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, vocab_size=vocab, num_hidden_layers=2,
                         attn_implementation="eager")
    with torch.device(target.device):  # initialised on the device: seconds, not a minute on the host
        llama = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    ids = torch.randint(0, vocab, (1, 1), device=target.device)
    calib = {"input_ids": torch.randint(0, vocab, (4, 64), device=target.device)}
    with kernels.use_backend(target.backend):
        conv = convert(llama, calib)
        try:
            gm = rewrite(conv, example_kwargs={"input_ids": ids})
        except Exception as e:  # noqa: BLE001 - a graph of a longer example may still take one token
            print(f"rewrite of a one-token example: {type(e).__name__}: {e}; the graph of the 4x64 example instead")
            gm = rewrite(conv, example_kwargs=calib)
        skips = _cudagraph_skips()
        # the graph runs without a KV cache (rewrite sets use_cache=False): so do the models
        plain = {"input_ids": ids, "use_cache": False}
        variants: dict[str, tuple[Callable[..., object], dict[str, object]]] = {
            "bf16 eager": (llama, plain), "FP8 eager": (conv, plain),
            "bf16 reduce-overhead": (torch.compile(llama, mode="reduce-overhead"), plain),
            "FP8 rewrite reduce-overhead": (torch.compile(gm, mode="reduce-overhead", fullgraph=True),
                                            {"input_ids": ids})}
        times: dict[str, float] = {}
        try:
            with torch.no_grad():
                for name, (model, kwargs) in variants.items():
                    try:
                        times[name] = timed(model, reps=5 if target.dry else 50, **kwargs)
                    except Exception as e:  # noqa: BLE001 - the other rows still print
                        print(f"{name}: {type(e).__name__}: {e}")
        finally:  # the rows measured so far, also when the section runs out of time
            rows = [[name, f"{t:.4f}", f"{times['bf16 eager'] / t:.2f}" if "bf16 eager" in times else ""]
                    for name, t in times.items()]
            table(["model (1 token)", "ms", "bf16 eager / this"], rows)
    ro = ("FP8 rewrite reduce-overhead", "bf16 reduce-overhead")
    if all(name in times for name in ro):
        print(f"FP8 vs bf16, both under CUDA graphs: {times[ro[1]] / times[ro[0]]:.2f}x (> 1: FP8 faster); "
              f"graphs skipped by inductor while compiling: {_cudagraph_skips() - skips} (0: both ran as graphs)")


# Section → the most wall-clock seconds it may take. Estimates: no GPU run has timed the sections yet (each now
# prints its time); e2e and graphs compile with inductor from a cold cache. The default order runs what no GPU
# has measured yet first, so a short budget cuts the tables that already are in the README.
