"""Ahead-of-time compile every Triton kernel configuration the dispatcher can pick, for a GPU we do not have.

    python -m dbr_quant.kernels.triton.aot --arch 90      (Hopper; --arch 89 for Ada)
    python -m dbr_quant.kernels.triton.aot --arch 100     (Blackwell: the kernels tagged sm_100, MXFP8)
    python -m dbr_quant.kernels.triton.aot --arch 80      (Ampere: the kernels tagged sm_80, weight-only FP8)

For each configuration in the kernel modules' ``AOT_CONFIGS`` (by default a subset covering every option
value of every kernel; ``--all`` for the full product): ``triton.compile`` for
``GPUTarget("cuda", ARCH, 32)``, then ``ptxas -v`` on the PTX for registers, spills and shared memory,
and a search of the PTX for FP8 tensor-core instructions (``wgmma … e4m3``/``e5m2`` on sm_90,
``mma … e4m3``/``e5m2`` on sm_89, ``tcgen05.mma … kind::mxf8f6f4`` / ``kind::f8f6f4`` on sm_100); on sm_80, which
has none, the bf16/fp16 ``mma.sync`` the weight-only kernel decodes FP8 into; and for TMA copies
(``cp.async.bulk.tensor``, the ``tma`` column; the sm_90 summary says how many GEMM configurations use them).
Exits non-zero if a kernel fails to compile, spills registers, a GEMM/attention kernel lacks those tensor-core
instructions, or a TMA kernel (``tma`` in its name) lacks TMA copies. Configurations whose description names an
architecture ("sm_80", "sm_90", "sm_100") compile only for it; the others for sm_89 and sm_90.

The kernel modules are every ``dbr_quant/kernels/triton/*.py`` with an ``AOT_CONFIGS`` table (a new
module is picked up by defining one). Compiles run in worker processes started with "spawn", one compile
at a time per process, sharing nothing with the calling process (e.g. a long pytest run) nor with each
other. Compiling in threads of one process failed now and then: Triton's front end calls ``ast.parse``
for the kernel and every @jit function it calls, and CPython before 3.11.8 / 3.12.2 (python/cpython#106905)
keeps one recursion counter per interpreter for turning the parsed tree into Python objects; when a
garbage collection during that runs Python finalizers, the other thread's ``ast.parse`` moves the
counter and one of them fails with "SystemError: AST constructor recursion depth mismatch" (reported
as "CompilationError: at <line>:<col>" when it hits a called function). Finalizers are plentiful after
hundreds of tests, rare in a fresh process, hence failures only inside the test suite.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import multiprocessing
import pkgutil
import re
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from types import ModuleType

from dbr_quant.kernels import triton as triton_kernels

# kernels that multiply matrices must use FP8 tensor cores; elementwise ones have nothing to find
NEEDS_FP8_MMA = ("gemm", "linear", "matmul", "attention", "attn")
GEMM_WORDS = ("gemm", "linear", "matmul")  # the GEMM kernels, whose TMA use the sm_90 summary counts


@dataclass
class Result:
    kernel: str
    config: str
    registers: int | None = None
    spill_bytes: int | None = None
    shared_bytes: int | None = None
    fp8_mma: int = 0
    error: str = ""
    tma: int = 0  # TMA copies (cp.async.bulk.tensor) in the PTX

    @property
    def needs_mma(self) -> bool:
        return any(word in self.kernel for word in NEEDS_FP8_MMA)

    @property
    def is_gemm(self) -> bool:
        return any(word in self.kernel for word in GEMM_WORDS)

    @property
    def needs_tma(self) -> bool:
        """TMA kernels are listed for sm_90 only (their descriptions say so, see :func:`for_arch`)."""
        return "tma" in self.kernel

    @property
    def ok(self) -> bool:
        return (not self.error and self.spill_bytes == 0 and (self.fp8_mma > 0 or not self.needs_mma)
                and (self.tma > 0 or not self.needs_tma))


def fp8_mma_count(ptx: str, arch: int) -> int:
    """FP8 tensor-core instructions in the PTX: warpgroup MMA on Hopper, warp MMA on Ada, tcgen05 MMA of an FP8
    kind (block-scaled MX or plain) on Blackwell; on Ampere (no FP8 MMA) the bf16/fp16 warp MMA that the
    weight-only kernel feeds with decoded FP8."""
    if arch >= 100:
        return len(re.findall(r"tcgen05\.mma[^\n;]*kind::(mx)?f8f6f4", ptx))
    if arch < 89:
        return len(re.findall(r"\bmma\.sync[^\n;]*\.(bf16|f16)\.(bf16|f16)", ptx))
    op = r"wgmma\.mma_async" if arch >= 90 else r"\bmma\.sync"
    return len(re.findall(op + r"[^\n;]*\.e(4m3|5m2)", ptx))


def tma_count(ptx: str) -> int:
    """TMA copies in the PTX: ``cp.async.bulk.tensor`` loads (and stores, prefetches) of a tensor map."""
    return len(re.findall(r"\bcp\.async\.bulk\.tensor\.", ptx))


def tma_summary(results: list[Result]) -> str:
    """``tma: N of M GEMM configurations``: how many compiled GEMM configurations copy tiles with TMA."""
    gemms = [r for r in results if r.is_gemm]
    return f"tma: {sum(r.tma > 0 for r in gemms)} of {len(gemms)} GEMM configurations"


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
    used = re.search(r"Used (\d+) registers", out)
    if used is None:
        raise RuntimeError(f"ptxas -v printed no register count for sm_{arch}: {out[-500:]}")
    registers = int(used.group(1))
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


def compile_one(mod: ModuleType, entry: tuple, arch: int) -> Result:
    """Compile one AOT_CONFIGS entry for sm_``arch`` in this process and measure it."""
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
        result.tma = tma_count(ptx)
        result.registers, result.spill_bytes = ptxas_stats(ptx, arch)
    except Exception as e:  # report every failure in the table, do not stop at the first
        result.error = error_chain(e)
    return result


def error_chain(e: BaseException) -> str:
    """Every exception in the chain, outermost first. Triton wraps an error inside a called @jit function
    in a CompilationError that only names the call site ("at 77:14"); the cause says what failed."""
    parts: list[str] = []
    link: BaseException | None = e
    while link is not None and len(parts) < 8:
        text = str(link).strip()
        first = text.splitlines()[0][:160] if text else ""
        parts.append(f"{type(link).__name__}: {first}")
        link = link.__cause__ or link.__context__
    return " <- ".join(parts)


@dataclass(frozen=True)
class Config:
    """One AOT_CONFIGS entry, by module and position: small and picklable, for the worker processes."""

    module: str
    index: int
    kernel: str
    description: str

    def entry(self) -> tuple:
        entry = importlib.import_module(f"dbr_quant.kernels.triton.{self.module}").AOT_CONFIGS[self.index]
        if entry[:2] != (self.kernel, self.description):  # tables are built deterministically at import
            raise RuntimeError(f"{self.module}.AOT_CONFIGS[{self.index}] is {entry[:2]}, expected "
                               f"{(self.kernel, self.description)}: the table changed between processes")
        return entry


def kernel_modules() -> list[str]:
    """The modules of dbr_quant.kernels.triton that define ``AOT_CONFIGS``, sorted by name."""
    names = sorted(m.name for m in pkgutil.iter_modules(triton_kernels.__path__) if m.name not in ("aot", "backend"))
    return [n for n in names if hasattr(importlib.import_module(f"dbr_quant.kernels.triton.{n}"), "AOT_CONFIGS")]


def all_configs(only: str | None = None) -> list[Config]:
    """Every configuration the wrappers can launch (kernel name containing ``only``, if given)."""
    configs = []
    for name in kernel_modules():
        table = importlib.import_module(f"dbr_quant.kernels.triton.{name}").AOT_CONFIGS
        configs += [Config(name, i, e[0], e[1]) for i, e in enumerate(table) if only is None or only in e[0]]
    return configs


def compile_config(config: Config, arch: int) -> Result:
    """Worker-process entry point: import the config's module and compile the entry."""
    mod = importlib.import_module(f"dbr_quant.kernels.triton.{config.module}")
    return compile_one(mod, config.entry(), arch)


def compile_all(configs: list[Config], arch: int, jobs: int = 2) -> list[Result]:
    """Compile in ``jobs`` fresh "spawn" worker processes (never in this process, never two compiles in
    one process at once); results in the order of ``configs``."""
    if not configs:
        return []
    context = multiprocessing.get_context("spawn")
    results = []
    with ProcessPoolExecutor(max_workers=max(1, min(jobs, len(configs))), mp_context=context) as pool:
        futures = [pool.submit(compile_config, c, arch) for c in configs]
        for config, future in zip(configs, futures):
            try:
                results.append(future.result())
            except Exception as e:  # a worker that died (BrokenProcessPool) fails its configs, not the table
                results.append(Result(config.kernel, config.description, error=error_chain(e)))
    return results


def covering_subset(configs: list[Config]) -> list[Config]:
    """The fewest configurations (greedy) in which every kernel meets every value of every option in the
    descriptions at least once (each block config, format, activation, bias, residual, output kind, …).
    The GEMM alone has thousands of combinations (hours to compile); options change code locally, so
    this subset, plus the heaviest epilogue of each block config, is what the default run checks."""
    def tokens(c: Config) -> set[tuple[str, str]]:
        return {(c.kernel, t) for t in re.split(r"[\s|]+", c.description) if t}

    heaviest: dict[tuple[str, str], tuple[int, Config]] = {}
    for c in configs:  # per kernel and block config (first token): the description with most features
        key = (c.kernel, c.description.split()[0])
        score = sum(t not in ("act=None", "bias=0", "residual=None", "mask=none") for t in c.description.split())
        if key not in heaviest or score > heaviest[key][0]:
            heaviest[key] = (score, c)
    chosen = [c for _, c in heaviest.values()]
    missing = set().union(*(tokens(c) for c in configs)) - set().union(*(tokens(c) for c in chosen))
    while missing:
        best = max(configs, key=lambda c: len(tokens(c) & missing))
        chosen.append(best)
        missing -= tokens(best)
    return chosen


DEFAULT_ARCHES = (89, 90)  # untagged configurations: the FP8 tensor-core GPUs the dispatcher runs Triton on


def for_arch(configs: list[Config], arch: int) -> list[Config]:
    """Entries tuned for one architecture say so ("sm_89", "sm_100"): keep those only for it; untagged entries
    are for the default architectures (sm_89, sm_90)."""
    return [c for c in configs if f"sm_{arch}" in c.description.split()
            or (not re.search(r"\bsm_\d+", c.description) and arch in DEFAULT_ARCHES)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dbr_quant.kernels.triton.aot", description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, choices=(80, 89, 90, 100), default=90)
    parser.add_argument("--only", help="only kernels whose name contains this")
    parser.add_argument("--jobs", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--all", action="store_true",
                        help="every configuration (thousands: hours) instead of the covering subset")
    parser.add_argument("--allow-spill-bytes", type=int, default=0, metavar="N",
                        help="count a configuration spilling at most N bytes as ok, listed as 'spill N' (default 0)")
    args = parser.parse_args(argv)
    import triton

    every = for_arch(all_configs(args.only), args.arch)
    configs = every if args.all else covering_subset(every)
    print(f"{len(configs)} of {len(every)} launchable configurations"
          + ("" if args.all else " (covering subset: every option value of every kernel, and the heaviest "
                                 "epilogue per block config; --all for all)"))
    start = time.perf_counter()
    results = compile_all(configs, args.arch, args.jobs)
    seconds = time.perf_counter() - start
    width = max([len(r.config) for r in results] + [6])
    print(f"AOT compile for sm_{args.arch} with triton {triton.__version__} ({len(results)} configurations): "
          "registers and spills from ptxas -v")
    mma = "fp8 mma" if args.arch >= 89 else "mma"  # sm_80: the bf16/fp16 MMA of decoded FP8 weights
    print(f"{'kernel':<22} {'config':<{width}} {'regs':>5} {'spill B':>8} {'smem B':>8} {mma:>8} {'tma':>4}  status")
    def tolerated(r: Result) -> bool:
        """Not ok only for a spill within --allow-spill-bytes."""
        return (not r.ok and not r.error and 0 < (r.spill_bytes or 0) <= args.allow_spill_bytes
                and dataclasses.replace(r, spill_bytes=0).ok)

    for r in results:
        status = ("ok" if r.ok else f"spill {r.spill_bytes} (allowed)" if tolerated(r)
                  else r.error.split(" <- ")[0] if r.error else "SPILLS" if r.spill_bytes
                  else "NO FP8 MMA" if r.needs_mma and not r.fp8_mma else "NO TMA")
        spill, smem = ("-" if v is None else v for v in (r.spill_bytes, r.shared_bytes))
        print(f"{r.kernel:<22} {r.config:<{width}} {r.registers or '-':>5} {spill:>8} {smem:>8} {r.fp8_mma:>8} "
              f"{r.tma:>4}  {status}")
    failed = [r for r in results if not r.ok and not tolerated(r)]
    for r in failed:
        if r.error:
            print(f"error in {r.kernel} {r.config}: {r.error}")
    most = max(results, key=lambda r: r.registers or 0, default=None)
    print(f"{len(results) - len(failed)} ok, {len(failed)} failed in {seconds:.0f} s (sm_{args.arch}, triton "
          f"{triton.__version__}; most registers: {most.registers if most else '-'}, "
          f"most spill bytes: {max((r.spill_bytes or 0 for r in results), default=0)}"
          + (f"; {tma_summary(results)})" if args.arch >= 90 else ")"))
    return 1 if failed else 0


if __name__ == "__main__":
    # run the imported module's main, so that what the workers pickle (Config, Result, compile_config)
    # names dbr_quant.kernels.triton.aot, not __main__ (spawned workers import it under another name)
    from dbr_quant.kernels.triton import aot

    sys.exit(aot.main())
