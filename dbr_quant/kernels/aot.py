"""Ahead-of-time compile every Triton kernel configuration the dispatcher can pick, for a GPU we do not have.

    python -m dbr_quant.kernels.aot --arch 90      (Hopper; --arch 89 for Ada)

For each configuration in the kernel modules' ``AOT_CONFIGS``: ``triton.compile`` for
``GPUTarget("cuda", ARCH, 32)``, then ``ptxas -v`` on the PTX for registers, spills and shared memory,
and a search of the PTX for FP8 tensor-core instructions (``wgmma … e4m3``/``e5m2`` on sm_90,
``mma … e4m3``/``e5m2`` on sm_89). Exits non-zero if a kernel fails to compile, spills registers, or a
GEMM/attention kernel lacks FP8 tensor-core instructions.
"""

from __future__ import annotations

import argparse
import importlib
import re
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

MODULES = ("triton_quantize", "triton_norm", "triton_gemm", "triton_attention")
# kernels that multiply matrices must use FP8 tensor cores; elementwise ones have nothing to find
NEEDS_FP8_MMA = ("gemm", "linear", "matmul", "attention")


@dataclass
class Result:
    kernel: str
    config: str
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None
    fp8_mma: int = 0
    error: str = ""

    @property
    def needs_mma(self) -> bool:
        return any(word in self.kernel for word in NEEDS_FP8_MMA)

    @property
    def ok(self) -> bool:
        return not self.error and self.spill_bytes == 0 and (self.fp8_mma > 0 or not self.needs_mma)


def fp8_mma_count(ptx: str, arch: int) -> int:
    """FP8 tensor-core instructions in the PTX: warpgroup MMA on Hopper, warp MMA on Ada."""
    op = r"wgmma\.mma_async" if arch >= 90 else r"\bmma\.sync"
    return len(re.findall(op + r"[^\n;]*\.e(4m3|5m2)", ptx))


def ptxas_stats(ptx: str, arch: int) -> tuple[int, int]:
    """(registers, spill store bytes) from ``ptxas -v`` (the ptxas bundled with Triton)."""
    from triton.backends.nvidia.compiler import get_ptxas

    suffix = "a" if arch >= 90 else ""
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/k.ptx"
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}{suffix}", path, "-o", f"{tmp}/k.o"],
                             capture_output=True, text=True, check=True).stderr
    registers = int(re.search(r"Used (\d+) registers", out).group(1))
    spills = re.search(r"(\d+) bytes spill stores", out)
    return registers, int(spills.group(1)) if spills else 0


def compile_one(entry: tuple, arch: int) -> Result:
    import triton
    from triton.backends.compiler import GPUTarget

    name, config, kernel, signature, constexprs = entry
    result = Result(name, config)
    try:
        src = triton.compiler.ASTSource(fn=kernel.jit, signature=signature, constexprs=constexprs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
        ptx = compiled.asm["ptx"]
        result.shared_bytes = compiled.metadata.shared
        result.fp8_mma = fp8_mma_count(ptx, arch)
        result.registers, result.spill_bytes = ptxas_stats(ptx, arch)
    except Exception as e:  # report every failure in the table, do not stop at the first
        result.error = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    return result


def all_configs(only: str | None = None) -> list[tuple]:
    entries = []
    for mod_name in MODULES:
        mod = importlib.import_module(f"dbr_quant.kernels.{mod_name}")
        entries += [e for e in mod.AOT_CONFIGS if only is None or only in e[0]]
    return entries


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dbr_quant.kernels.aot", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, choices=(89, 90), default=90)
    parser.add_argument("--only", help="only kernels whose name contains this")
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args(argv)
    entries = all_configs(args.only)
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda e: compile_one(e, args.arch), entries))
    width = max([len(r.config) for r in results] + [6])
    print(f"AOT compile for sm_{args.arch} ({len(results)} configurations): registers and spills from ptxas -v")
    print(f"{'kernel':<22} {'config':<{width}} {'regs':>5} {'spill B':>8} {'smem B':>8} {'fp8 mma':>8}  status")
    for r in results:
        status = "ok" if r.ok else (r.error or ("SPILLS" if r.spill_bytes else "NO FP8 MMA"))
        spill, smem = ("-" if v is None else v for v in (r.spill_bytes, r.shared_bytes))
        print(f"{r.kernel:<22} {r.config:<{width}} {r.registers or '-':>5} {spill:>8} {smem:>8} {r.fp8_mma:>8}  "
              f"{status}")
    failed = [r for r in results if not r.ok]
    print(f"{len(results) - len(failed)} ok, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
