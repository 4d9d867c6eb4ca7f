"""Ahead-of-time compile every Triton kernel configuration the dispatcher can pick, for a GPU we do not have.

    python -m dbr_quant.kernels.aot --arch 90      (Hopper; --arch 89 for Ada)

For each configuration in the kernel modules' ``AOT_CONFIGS`` (by default a subset covering every option
value of every kernel; ``--all`` for the full product): ``triton.compile`` for
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

MODULES = ("triton_quantize", "triton_norm", "triton_gemm", "triton_attention", "triton_grouped_gemm",
           "triton_group_quantize", "triton_block_gemm")
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


def launch_options(mod, entry: tuple) -> dict[str, int]:
    """num_warps / num_stages of a configuration, as the wrapper launches it (from the module, or the
    ``warps=``/``stages=`` in the description)."""
    if hasattr(mod, "aot_options"):
        return mod.aot_options(entry)
    options = {}
    for key, option in (("warps", "num_warps"), ("stages", "num_stages")):
        found = re.search(rf"\b{key}=(\d+)", entry[1])
        if found:
            options[option] = int(found.group(1))
    if "num_stages" not in options and hasattr(mod, "NUM_STAGES"):
        options["num_stages"] = mod.NUM_STAGES
    return options


def compile_one(mod, entry: tuple, arch: int) -> Result:
    import triton
    from triton.backends.compiler import GPUTarget

    name, config, kernel, signature, constexprs = entry
    result = Result(name, config)
    try:
        attrs = mod.aot_attrs(entry) if hasattr(mod, "aot_attrs") else None
        src = triton.compiler.ASTSource(fn=kernel.jit, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=launch_options(mod, entry))
        ptx = compiled.asm["ptx"]
        result.shared_bytes = compiled.metadata.shared
        result.fp8_mma = fp8_mma_count(ptx, arch)
        result.registers, result.spill_bytes = ptxas_stats(ptx, arch)
    except Exception as e:  # report every failure in the table, do not stop at the first
        result.error = f"{type(e).__name__}: {str(e).splitlines()[0][:100] if str(e) else ''}"
    return result


def all_configs(only: str | None = None) -> list[tuple]:
    """(module, entry) for every configuration the wrappers can launch."""
    entries = []
    for mod_name in MODULES:
        mod = importlib.import_module(f"dbr_quant.kernels.{mod_name}")
        entries += [(mod, e) for e in mod.AOT_CONFIGS if only is None or only in e[0]]
    return entries


def covering_subset(entries: list[tuple]) -> list[tuple]:
    """The fewest configurations (greedy) in which every kernel meets every value of every option in the
    descriptions at least once (each block config, format, activation, bias, residual, output kind, …).
    The GEMM alone has thousands of combinations (hours to compile); options change code locally, so
    this subset, plus the heaviest epilogue of each block config, is what the default run checks."""
    def tokens(entry):
        return {(entry[0], t) for t in re.split(r"[\s|]+", entry[1]) if t}

    heaviest = {}
    for mod, e in entries:  # per kernel and block config (first token): the description with most features
        key = (e[0], e[1].split()[0])
        score = sum(t not in ("act=None", "bias=0", "residual=None", "mask=none") for t in e[1].split())
        if key not in heaviest or score > heaviest[key][0]:
            heaviest[key] = (score, (mod, e))
    chosen = [me for _, me in heaviest.values()]
    missing = set().union(*(tokens(e) for _, e in entries)) - set().union(*(tokens(e) for _, e in chosen))
    while missing:
        best = max(entries, key=lambda me: len(tokens(me[1]) & missing))
        chosen.append(best)
        missing -= tokens(best[1])
    return chosen


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dbr_quant.kernels.aot", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, choices=(89, 90), default=90)
    parser.add_argument("--only", help="only kernels whose name contains this")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--all", action="store_true",
                        help="every configuration (thousands: hours) instead of the covering subset")
    args = parser.parse_args(argv)
    # entries tuned for one architecture say so ("sm_89"): compile them only for it
    every = [(m, e) for m, e in all_configs(args.only)
             if not re.search(r"\bsm_\d+", e[1]) or f"sm_{args.arch}" in e[1]]
    entries = every if args.all else covering_subset(every)
    print(f"{len(entries)} of {len(every)} launchable configurations"
          + ("" if args.all else " (covering subset: every option value of every kernel, and the heaviest "
                                 "epilogue per block config; --all for all)"))
    with ThreadPoolExecutor(args.jobs) as pool:
        results = list(pool.map(lambda me: compile_one(me[0], me[1], args.arch), entries))
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
