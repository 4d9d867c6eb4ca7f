"""The ahead-of-time compilation tables of the GEMM kernels: pointer types, signatures, descriptions and the
epilogue variants each linear kernel's ``AOT_CONFIGS`` lists (read by :mod:`kernels.triton.aot`). Host-side
only, nothing here runs per call."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence

from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference.dense import ACTIVATIONS, GATED
from dbr_quant.kernels.triton.common import AotEntry, Kernel
from dbr_quant.kernels.triton.gemm_core import GemmConfig, epilogue_constexprs

PTR = {FP8Format.E4M3: "*fp8e4nv", FP8Format.E5M2: "*fp8e5"}
OUT_PTR = {"fp32": "*fp32", "bf16": "*u16", "fp16": "*fp16", "fp8": "*u8"}
# every output a linear kernel can give: an OUT_KIND name, or the FP8 format of an FP8 output
LINEAR_OUTS: tuple[str | FP8Format, ...] = ("fp32", "bf16", "fp16", *FP8Format)
RESIDUAL_DTYPES = (None, "fp32", "bf16", "fp16")


def linear_variants() -> Iterable[tuple]:
    """Every (A format, W format, activation, bias, residual dtype, output) a linear wrapper can launch: the
    epilogue variants of each tile config in a linear kernel's AOT_CONFIGS."""
    fmts = list(FP8Format)
    return itertools.product(fmts, fmts, (None,) + ACTIVATIONS + GATED, (False, True), RESIDUAL_DTYPES, LINEAR_OUTS)


def signature(kernel: Kernel, ptrs: dict[str, str],
              units: Iterable[str]) -> tuple[dict[str, str], dict[str, object]]:
    """Pointer types as given, unit strides as constexpr 1 (as the JIT specializes them), other ints i32."""
    units = tuple(units)
    sig = {p.name: ptrs.get(p.name, "constexpr" if p.is_constexpr or p.name in units else "i32")
           for p in kernel.jit.params}
    return sig, dict.fromkeys(units, 1)


def describe(c: GemmConfig) -> str:
    return f"{c.name} {c.BLOCK_M}x{c.BLOCK_N}x{c.BLOCK_K} warps={c.num_warps} stages={c.num_stages}"


def out_name(out: str | FP8Format) -> str:
    """How a description names an output: its OUT_KIND, or fp8 and the format."""
    return f"fp8{out.value}" if isinstance(out, FP8Format) else out



def linear_aot_entry(kernel_name: str, kernel: Kernel, cfg: GemmConfig, fmt_a: FP8Format, fmt_w: FP8Format,
                     activation: str | None, has_bias: bool, res_dtype: str | None, out: str | FP8Format,
                     scales: dict[str, object], scales_desc: str = "") -> AotEntry:
    """One AOT_CONFIGS row of a linear kernel (dense or block-scaled: ``scales`` are its extra constexprs,
    ``scales_desc`` their words in the description)."""
    epilogue = epilogue_constexprs(activation, has_bias, out)
    cfg = cfg.gated() if epilogue["GATED"] else cfg
    ptrs = {"a_ptr": PTR[fmt_a], "w_ptr": PTR[fmt_w], "out_ptr": OUT_PTR[str(epilogue["OUT_KIND"])],
            "x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "bias_ptr": "*fp32", "res_ptr": "*" + (res_dtype or "fp32"),
            "out_scale_ptr": "*fp32"}
    units = ("stride_ak", "stride_wk", "stride_on") + (("stride_rn",) if res_dtype else ())
    sig, consts = signature(kernel, ptrs, units)
    consts.update(cfg.constexprs(), **scales, **epilogue, HAS_RESIDUAL=res_dtype is not None)
    desc = (f"{describe(cfg)} | {scales_desc}{fmt_a.value}x{fmt_w.value} act={activation} bias={int(has_bias)}"
            f" residual={res_dtype} out={out_name(out)}")
    return (kernel_name, desc, kernel, sig, consts)


def aligned_attrs(entry: AotEntry, aligned: Sequence[str]) -> dict:
    """ASTSource ``attrs`` for the common aligned case: pointers and the ``aligned`` ints (sizes, leading
    strides) divisible by 16, as the JIT finds for aligned shapes. Without them loads are neither
    vectorized nor cp.async-pipelined."""
    return {(i,): [["tt.divisibility", 16]] for i, (name, ty) in enumerate(entry[3].items())
            if ty.startswith("*") or (ty == "i32" and name in aligned)}


def config_options(configs: dict[str, GemmConfig], entry: AotEntry) -> dict[str, int]:
    """``num_warps``/``num_stages`` of an AOT_CONFIGS entry (launch options: pass as triton.compile options);
    descriptions start with the config's name."""
    cfg = configs[entry[1].split()[0].removesuffix("-gated")]
    return {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
