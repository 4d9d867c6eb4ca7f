"""dbr_quant on a CUDA GPU (issue #23): one run, tables of times, TFLOP/s and ratios measured side by side.

    python benchmarks/gpu.py [--quick]

1. GEMM: our Triton ``fp8_linear`` (as dispatched, and each kernel forced: pointer loads / TMA persistent)
   vs ``torch._scaled_mm`` (cuBLASLt FP8, per-tensor scales, no fast accumulation) vs bf16 ``torch.matmul``
   on Llama-3-8B and -70B layer shapes at decode (M = 1, 16) and prefill (M = 512 … 8192) sizes, plus the
   8192×8192×4096 anchor of triton-lang/triton#5461.
2. Fused vs unfused: a Llama-3-8B MLP converted with ``fuse=True`` vs ``fuse=False`` vs the bf16 module;
   FP8 flash attention vs the unfused reference ops (plain torch on the GPU) vs bf16 SDPA.
3. End to end: a MiniLM-shaped BERT (random weights: the real checkpoint is not on the GPU image) and a bf16
   Llama (Llama-3-8B layer sizes, 2 layers), FP8 eager and ``rewrite`` + ``torch.compile`` vs the bf16 model
   eager and compiled.
4. Host time per decode-size call: entry point (as dispatched by default, and under ``use_backend``), Triton
   wrapper, Triton's launch, cuBLASLt, the weight-only and grouped weight-only entry points; a profile.
5. MoE experts at Mixtral-8x7B shapes (E = 8, top_k = 2, hidden 4096, ffn 14336; 16 and 4096 tokens): the grouped
   FP8 (W8A8, static scales), weight-only FP8 (W8A16), MXFP8 and 128×128 block-scaled expert computations vs a
   bf16 per-expert loop (as transformers' eager experts) and bf16 ``torch._grouped_mm``.
6. Decode under CUDA graphs: a bf16 Llama (Llama-3-8B layer sizes, 2 layers) at one token, FP8 ``rewrite`` +
   ``torch.compile(mode="reduce-overhead")`` vs the bf16 model under the same mode, and both eager.
Times are medians of CUDA-event runs after warm-up. Prints the device, driver, torch, triton and CUDA versions.
Sections run in the order of ``--order`` (the never-measured ones first), each under a time limit of its own and
within ``--budget-s`` in all: a section that fails or runs out of time prints why, and the others still run.
Sections 5 and 6 live in gpu_moe.py, the timing helpers in gpu_common.py.
``--dry`` runs sections 5 and 6 on the CPU at toy sizes (Triton interpreter, wall-clock timing): a check that
their code runs, not a measurement. Needs CUDA otherwise (prints why not).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import subprocess
import sys
import time
import traceback
from collections.abc import Callable

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))
from gpu_common import convert, table, timed  # noqa: E402
from gpu_moe import MIXTRAL, TOY_MOE, Target, graphs_section, moe_section  # noqa: E402

# (model, name, N, K) of Llama-3 linears: qkv, o, gate+up, down
SHAPES = [("8B", "qkv", 6144, 4096), ("8B", "o", 4096, 4096), ("8B", "gate_up", 28672, 4096),
          ("8B", "down", 4096, 14336), ("70B", "qkv", 10240, 8192), ("70B", "o", 8192, 8192),
          ("70B", "gate_up", 57344, 8192), ("70B", "down", 8192, 28672), ("anchor", "#5461", 8192, 4096)]
MS = [1, 16, 512, 2048, 8192]


def gemm_section(quick: bool) -> None:
    from dbr_quant import kernels
    from dbr_quant.formats import FP8Format
    from dbr_quant.kernels.triton import gemm

    # a candidate large-M pointer tile timed beside the dispatched one: BLOCK_K 128 promotes the FP8 tensor cores'
    # partial sums half as often; 3 stages = 96 KB of shared memory
    large_k128 = gemm.GemmConfig("large-k128", 128, 128, 128, GROUP_M=8, num_warps=8, num_stages=3)
    print("\n## 1. GEMM, bf16 output, x and W per-tensor FP8 (what _scaled_mm takes for both)")
    rows = []
    for model, name, n, k in SHAPES:
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
        w_q, w_s = kernels.dynamic_quantize(w, FP8Format.E4M3)
        w_t = w_q.t()
        for m in ([4096] if model == "anchor" else MS[::2] if quick else MS):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            x_q, x_s = kernels.dynamic_quantize(x, FP8Format.E4M3)
            with kernels.use_backend("triton"):
                ours = timed(kernels.fp8_linear, x_q, x_s, w_q, w_s, out_dtype=torch.bfloat16)
                classic, tma = (timed(gemm.fp8_linear, x_q, x_s, w_q, w_s, out_dtype=torch.bfloat16, kernel=kind)
                                for kind in ("classic", "tma"))
                k128 = (timed(gemm.fp8_linear, x_q, x_s, w_q, w_s, out_dtype=torch.bfloat16, kernel="classic",
                              config=large_k128) if m > 128 else float("nan"))
                unpromoted = timed(gemm.fp8_linear, x_q, x_s, w_q, w_s, out_dtype=torch.bfloat16, kernel="classic",
                                   config=dataclasses.replace(gemm.pick_config(m), promote=False))
            cublas_fast = timed(torch._scaled_mm, x_q, w_t, scale_a=x_s, scale_b=w_s, out_dtype=torch.bfloat16,
                                use_fast_accum=True)
            cublas = timed(torch._scaled_mm, x_q, w_t, scale_a=x_s, scale_b=w_s, out_dtype=torch.bfloat16)
            bf16 = timed(torch.matmul, x, w.t())
            tf = [2 * m * n * k / t / 1e9 for t in (ours, classic, tma, cublas, bf16)]
            rows.append([f"{model} {name}", m, n, k, f"{bf16:.4f}", f"{cublas:.4f}", f"{classic:.4f}", f"{tma:.4f}",
                         f"{k128:.4f}", f"{ours:.4f}", *(f"{t:.0f}" for t in tf), f"{cublas / ours:.2f}",
                         f"{bf16 / ours:.2f}", f"{classic / unpromoted:.2f}", f"{cublas / cublas_fast:.2f}"])
    table(["shape", "M", "N", "K", "bf16 ms", "cuBLAS fp8", "pointer", "TMA", "pointer K128", "ours (auto)",
           "TFLOP/s ours", "pointer", "TMA", "cuBLAS", "bf16", "ours/cuBLAS", "ours/bf16", "unpromoted gain",
           "cuBLAS fast-accum gain"], rows)
    print("pointer K128 = a candidate large-M tile (128x128, BLOCK_K 128, 3 stages: promotion every 128 K, not 64; "
          "measured mixed per layer on 2026-11-26, never per shape). TMA = the 128x128x128 tile for these ungated "
          "linears (tma_gemm.tma_config).")
    print("ours (auto) = kernels.fp8_linear as dispatched (the pointer kernel unless tma_gemm.AUTO_TMA); every "
          "kernel promotes each K step to fp32. ours/cuBLAS, ours/bf16: speed-ups (> 1: ours faster). Anchor "
          "(triton#5461, H100 SXM, fast accumulation): cuBLAS FP8 1278 TFLOP/s, Triton TMA-persistent FP8 1347 "
          "TFLOP/s on 8192x8192x4096.")
    print("unpromoted gain = pointer ÷ the same tile with GemmConfig(promote=False) (the whole K sum in the tensor "
          "core: what promotion costs us); cuBLAS fast-accum gain = cuBLASLt ÷ cuBLASLt with use_fast_accum=True.")


class _Mlp(nn.Module):
    """Llama's MLP: down(silu(gate(x)) · up(x))."""

    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))


def fused_section() -> None:
    from dbr_quant import kernels
    from dbr_quant.formats import FP8Format
    from dbr_quant.kernels.reference import dense as reference
    from dbr_quant.kernels.triton import attention as triton_attention

    print("\n## 2. Fused vs unfused")
    rows = []
    mlp = _Mlp(4096, 14336).to("cuda", torch.bfloat16).eval()
    for m in (16, 2048):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        fused, unfused = convert(mlp, {"x": x}, True), convert(mlp, {"x": x}, False)
        with torch.no_grad():
            t = [timed(mod, x) for mod in (mlp, unfused, fused)]
        rows.append(["Llama-3-8B MLP", f"M={m}", f"{t[0]:.4f}", f"{t[1]:.4f}", f"{t[2]:.4f}", f"{t[1] / t[2]:.2f}",
                     f"{t[0] / t[2]:.2f}"])
    for b, h, seq, d in ((1, 32, 2048, 128), (8, 12, 128, 32)):
        q, k, v = (torch.randn(b, h, seq, d, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        (qq, qs), (kq, ks), (vq, vs) = (kernels.dynamic_quantize(t, FP8Format.E4M3) for t in (q, k, v))
        with kernels.use_backend("triton"):
            ours = timed(kernels.fp8_attention, qq, qs, kq, ks, vq, vs, is_causal=True)
        measured = timed(triton_attention.fp8_attention, qq, qs, kq, ks, vq, vs, is_causal=True,
                         tile=triton_attention.measured_tile(seq, d))
        ref = timed(reference.fp8_attention, qq, qs, kq, ks, vq, vs, is_causal=True)
        sdpa = timed(nn.functional.scaled_dot_product_attention, q, k, v, is_causal=True)
        rows.append(["attention causal", f"{b}x{h}x{seq}x{d}", f"{sdpa:.4f}", f"{ref:.4f}", f"{ours:.4f}",
                     f"{ref / ours:.2f}", f"{sdpa / ours:.2f}", f"{measured:.4f}"])
    table(["what", "size", "bf16 ms", "FP8 unfused ms", "FP8 fused ms", "unfused/fused", "bf16/fused",
           "H100-run tile ms"], rows)
    print("attention: unfused = the reference's plain torch ops (quantize, matmuls, softmax) on the GPU; "
          "bf16 = torch SDPA (flash); fused = the dispatched tile (attention.gpu_tile: 128 keys per step, native "
          "P cast on sm_90); H100-run tile = the tile the first H100 run measured (64x32, 8 warps, P rounded in fp32)")


def _e2e_row(name: str, model: nn.Module, inputs: dict[str, torch.Tensor]) -> list[object]:
    from dbr_quant.fx_rewriter import rewrite

    conv = convert(model, inputs)
    gm = rewrite(conv, example_kwargs=inputs)
    bf16_c = torch.compile(model)
    fp8_c = torch.compile(gm, fullgraph=True)
    with torch.no_grad():
        t = [timed(f, reps=15, **inputs) for f in (model, bf16_c, conv, fp8_c)]
    shape = "x".join(str(s) for s in next(iter(inputs.values())).shape)
    return [name, shape, *(f"{x:.3f}" for x in t), f"{t[0] / t[2]:.2f}", f"{t[1] / t[3]:.2f}"]


def e2e_section() -> None:
    from transformers import BertConfig, BertModel, LlamaConfig, LlamaForCausalLM

    print("\n## 3. End to end (random weights, bf16 models)")
    minilm = BertModel(BertConfig(hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                                  intermediate_size=1536, attn_implementation="sdpa"))
    minilm = minilm.to("cuda", torch.bfloat16).eval()
    llama = LlamaForCausalLM(LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=2,
                                         num_attention_heads=32, num_key_value_heads=8, vocab_size=32000))
    llama = llama.to("cuda", torch.bfloat16).eval()
    rows = []
    for name, model, shape in (("MiniLM-shaped BERT", minilm, (32, 128)), ("Llama-3-8B 2 layers", llama, (4, 512))):
        ids = torch.randint(0, 30000, shape, device="cuda")
        try:
            rows.append(_e2e_row(name, model, {"input_ids": ids}))
        except Exception as e:  # noqa: BLE001 - the table goes on; the error is printed
            print(f"{name} {shape}: {type(e).__name__}: {e}")
    table(["model", "input", "bf16 eager ms", "bf16 compiled", "FP8 eager", "FP8 compiled", "eager speed-up",
           "compiled speed-up"], rows)


def _host_us(fn: Callable[[], object], calls: int = 300) -> float:
    """Microseconds of host time per call: ``calls`` back-to-back calls, one synchronize at the end. When the
    GPU work is shorter than the host work (decode GEMMs) this is what a call costs."""
    import time

    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def host_section() -> None:
    """Where a decode-size call's time goes on the host: the entry point (op table + backend dispatch), the
    Triton wrapper (checks, operands), Triton's own launch, against cuBLASLt; then a profile of the entry point."""
    import cProfile
    import io
    import pstats

    from dbr_quant import kernels
    from dbr_quant.formats import FP8Format
    from dbr_quant.kernels.triton import gemm

    print("\n## 4. Host time per call, M = 1, N = K = 4096 (µs; 300 calls, one synchronize)")
    w_q, w_s = kernels.dynamic_quantize(torch.randn(4096, 4096, device="cuda"), FP8Format.E4M3)
    x_q, x_s = kernels.dynamic_quantize(torch.randn(1, 4096, device="cuda"), FP8Format.E4M3)
    out = torch.empty(1, 4096, device="cuda", dtype=torch.bfloat16)
    cfg = gemm.pick_config(1)
    xs, ws, w_t = x_s.reshape(1), w_s.reshape(1), w_q.t()

    # grid, output view and keyword arguments built once: the row times Triton's launch alone (triton.cdiv is a
    # constexpr function costing microseconds per host call, and a view is a tensor op)
    grid, out_u16 = (-(-4096 // cfg.BLOCK_N),), out.view(torch.uint16)
    launch_kw = dict(**cfg.constexprs(), ACTIVATION="none", GATED=False, HAS_BIAS=False, HAS_RESIDUAL=False,
                     OUT_KIND="bf16", FP8_MAX=448.0, MANTISSA_BITS=3, MIN_NORMAL=2.0**-6, EXP_BIAS=7,
                     num_warps=cfg.num_warps, num_stages=cfg.num_stages)

    def launch_only() -> None:
        gemm.LINEAR_KERNEL[grid](x_q, w_q, out_u16, xs, ws, xs, xs, xs, 1, 4096, 4096, 4096, 1, 4096, 1, 4096, 1, 0, 0,
                                 0, 0, **launch_kw)

    def entry() -> None:
        kernels.fp8_linear(x_q, x_s, w_q, w_s, out_dtype=torch.bfloat16)

    def cublas() -> None:
        torch._scaled_mm(x_q, w_t, scale_a=x_s, scale_b=w_s, out_dtype=torch.bfloat16)

    # as a model calls them: no use_backend, the entry point resolves the device's backend itself
    x_bf = torch.randn(1, 4096, device="cuda", dtype=torch.bfloat16)
    wo_q, wo_s = kernels.dynamic_quantize(torch.randn(4096, 4096, device="cuda"), FP8Format.E4M3, per_token=True)
    ge_q = wo_q.expand(8, -1, -1).contiguous()  # 8 experts' [4096, 4096] weights (the same bytes: host time only)
    ge_s = wo_s.reshape(1, -1).expand(8, -1).contiguous()
    ids = torch.tensor([[1, 6]], device="cuda")
    routing = kernels.moe_route(ids, 8)
    wo_s = wo_s.reshape(-1)

    def weight_only() -> None:
        kernels.fp8_weight_only_linear(x_bf, wo_q, wo_s, out_dtype=torch.bfloat16)

    def grouped_weight_only() -> None:
        kernels.fp8_grouped_weight_only_linear(x_bf, ge_q, ge_s, routing, out_dtype=torch.bfloat16)

    rows = [["kernels.fp8_linear, default dispatch (no use_backend)", f"{_host_us(entry):.1f}"],
            ["kernels.fp8_weight_only_linear M=1, default dispatch", f"{_host_us(weight_only):.1f}"],
            ["kernels.moe_route, 1 token, top-2 of 8", f"{_host_us(lambda: kernels.moe_route(ids, 8)):.1f}"],
            ["kernels.fp8_grouped_weight_only_linear, 1 token, top-2 of 8", f"{_host_us(grouped_weight_only):.1f}"]]
    with kernels.use_backend("triton"):
        rows += [["kernels.fp8_linear under use_backend('triton')", f"{_host_us(entry):.1f}"],
                 ["kernels.triton.gemm.fp8_linear (wrapper)",
                  f"{_host_us(lambda: gemm.fp8_linear(x_q, x_s, w_q, w_s, out_dtype=torch.bfloat16)):.1f}"],
                 ["Triton launch alone (JITFunction[grid])", f"{_host_us(launch_only):.1f}"]]
    rows += [["torch._scaled_mm", f"{_host_us(cublas):.1f}"],
             ["torch.empty (floor)", f"{_host_us(lambda: torch.empty(1, 4096, device='cuda')):.1f}"]]
    table(["call", "µs"], rows)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(300):
        entry()
    prof.disable()
    stream = io.StringIO()
    pstats.Stats(prof, stream=stream).sort_stats("tottime").print_stats(14)
    print("profile of 300 entry-point calls (default dispatch), by own time:")
    print("\n".join(line for line in stream.getvalue().splitlines()[4:] if line.strip()))


# Section → the most wall-clock seconds it may take. Estimates: no GPU run has timed the sections yet (each now
# prints its time); e2e and graphs compile with inductor from a cold cache. The default order runs first what no
# GPU has measured and what decides a default: fused (the sm_90 attention tile against the measured one), host
# (the wrapper cost after the host-path cuts), moe, graphs, then the GEMM table (its unpromoted, TMA-wide and K128
# columns); a short budget cuts the end, e2e, whose table already is in the README.
SECTION_LIMITS_S = {"moe": 90, "host": 45, "graphs": 150, "gemm": 200, "fused": 90, "e2e": 200}
DEFAULT_ORDER = "fused,host,moe,graphs,gemm,e2e"


class SectionTimeout(BaseException):
    """A section ran past its time limit (raised by SIGALRM between Python bytecodes). Not an Exception, so the
    sections' own ``except Exception`` (one table row failing) cannot swallow it and run on past the limit."""


def _out_of_time(signum: int, frame: object) -> None:
    raise SectionTimeout


def run_sections(sections: dict[str, Callable[[], None]], order: list[str], budget_s: float) -> bool:
    """Each section in ``order`` under min(its limit, what is left of ``budget_s``); a failure or a timeout prints
    its traceback and the next one runs. Returns whether all ran to the end."""
    ok = True
    start = time.monotonic()
    signal.signal(signal.SIGALRM, _out_of_time)
    for name in order:
        left = budget_s - (time.monotonic() - start)
        limit = int(min(SECTION_LIMITS_S[name], left))
        if left < 10:
            print(f"\n## section {name}: skipped, {left:.0f} s of the {budget_s:.0f} s budget left")
            ok = False
            continue
        began = time.monotonic()
        signal.alarm(limit)
        try:
            sections[name]()
        except SectionTimeout:
            ok = False
            print(f"\n## section {name}: stopped at its limit of {limit} s")
            traceback.print_exc(limit=4)
        except Exception:  # noqa: BLE001 - one broken section must not hide the others' figures
            ok = False
            traceback.print_exc()
        finally:
            signal.alarm(0)
        print(f"(section {name}: {time.monotonic() - began:.1f} s)", flush=True)
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="fewer GEMM sizes")
    parser.add_argument("--only", choices=list(SECTION_LIMITS_S), help="one section")
    parser.add_argument("--order", default=DEFAULT_ORDER, help=f"sections to run, in order (default {DEFAULT_ORDER})")
    parser.add_argument("--budget-s", type=float, default=540.0,
                        help="wall-clock seconds for all sections (make gpu-check passes what its call has left)")
    parser.add_argument("--dry", action="store_true",
                        help="sections 5 and 6 on the CPU, toy sizes, Triton interpreter (checks that the code runs)")
    args = parser.parse_args()
    order = [args.only] if args.only else [name.strip() for name in args.order.split(",") if name.strip()]
    unknown = [name for name in order if name not in SECTION_LIMITS_S]
    if unknown:
        parser.error(f"unknown section(s) {unknown}; choose from {list(SECTION_LIMITS_S)}")
    torch.manual_seed(0)
    if args.dry:
        target = Target("cpu", "triton-interpret", dry=True)
        dry = {"moe": lambda: moe_section(target, TOY_MOE), "graphs": lambda: graphs_section(target)}
        sys.exit(0 if run_sections(dry, [n for n in order if n in dry], args.budget_s) else 1)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py: no CUDA device here; run it on a GPU machine (make gpu-check), or --dry")
        return
    import triton

    driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                            capture_output=True, text=True).stdout.strip() or "?"
    print(f"device {torch.cuda.get_device_name()}, driver {driver}, torch {torch.__version__}, "
          f"triton {triton.__version__}, CUDA {torch.version.cuda}, Python {sys.version.split()[0]}")
    target = Target("cuda", "triton", dry=False)
    sections: dict[str, Callable[[], None]] = {
        "gemm": lambda: gemm_section(args.quick), "fused": fused_section, "e2e": e2e_section, "host": host_section,
        "moe": lambda: moe_section(target, MIXTRAL), "graphs": lambda: graphs_section(target)}
    print(f"sections in this order: {', '.join(order)}; budget {args.budget_s:.0f} s")
    sys.exit(0 if run_sections(sections, order, args.budget_s) else 1)


if __name__ == "__main__":
    main()
