"""The Triton FP8 GEMMs in the CPU interpreter against the reference (exact), and compiled ahead of time
for Hopper (wgmma) and Ada (mma.sync) without a GPU.

Shapes are small but the test config uses 16×16×32 tiles, so every case has several tiles and ragged
edges on M, N and K. The fp32 dot accumulates in a different order than torch, so high-precision outputs
are compared with a tolerance relative to the accumulator's magnitude; FP8 outputs byte for byte, allowing
a rare neighbour (a value that sits on a rounding boundary).
"""

import re

import pytest
import torch
import torch.nn.functional as F
import triton
from hypothesis import given, settings
from hypothesis import strategies as st
from triton.backends.compiler import GPUTarget
from triton.runtime.jit import mangle_type

from dbr_quant.formats import FP8Format
from dbr_quant.kernels import use_backend
from dbr_quant.kernels.reference import dense as R
from dbr_quant.kernels.triton import gemm as G

SMALL = G.GemmConfig("test", 16, 16, 32, GROUP_M=2)
FORMATS = list(FP8Format)
ACTS = [None, *R.ACTIVATIONS, *R.GATED]
REL = 1e-5  # of the accumulator's magnitude
MAX_ERR: dict[str, float] = {}  # worst error / tolerance seen, per case kind (printed with -s)


def _fp8(shape, fmt, gen, scale=4.0):
    return (torch.randn(shape, generator=gen) * scale).clamp(-fmt.max, fmt.max).to(fmt.dtype)


def _fp8_ordinal(q: torch.Tensor) -> torch.Tensor:
    """FP8 codes as integers ordered like their values (±0 → 0), so neighbours differ by exactly 1."""
    b = q.view(torch.uint8).to(torch.int32)
    return torch.where(b >= 128, -(b - 128), b)


def _assert_fp8_close(got: torch.Tensor, want: torch.Tensor, kind: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape
    diff = (_fp8_ordinal(got) - _fp8_ordinal(want)).abs()
    mismatched = int((diff != 0).sum())
    assert diff.max().item() <= 1, "FP8 outputs more than one step apart"
    assert mismatched <= max(1, int(0.01 * got.numel())), f"{mismatched}/{got.numel()} FP8 bytes differ"
    MAX_ERR[kind] = max(MAX_ERR.get(kind, 0.0), mismatched / max(1, got.numel()))


def _tolerance(x_q, xs, w_q, ws, bias, activation, ref):
    """REL × the magnitude the fp32 accumulation order can perturb: the scaled accumulator (for gated
    activations: gate × up magnitudes), plus the output itself (residual add, activation rounding)."""
    pre = F.linear(x_q.double(), w_q.double()) * (xs.double() * ws.double())
    if bias is not None:
        pre = pre + bias.double()
    if activation in R.GATED:
        gate, up = pre.chunk(2, dim=-1)
        mag = gate.abs().max() * up.abs().max() + gate.abs().max() + up.abs().max()
    else:
        mag = pre.abs().max()
    return REL * (mag.item() + ref.abs().max().item()) + 1e-30


@settings(max_examples=80, deadline=None)
@given(
    m=st.sampled_from([1, 2, 5, 16, 17, 33]),
    n=st.integers(1, 48),
    k=st.sampled_from([1, 3, 31, 32, 33, 64, 77, 80]),
    lead=st.sampled_from([(), (1,), (3,)]),
    fmt_x=st.sampled_from(FORMATS),
    fmt_w=st.sampled_from(FORMATS),
    per_row=st.booleans(),
    per_channel=st.booleans(),
    has_bias=st.booleans(),
    activation=st.sampled_from(ACTS),
    residual=st.sampled_from([None, torch.float32, torch.bfloat16, torch.float16]),
    out=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, FP8Format.E4M3, FP8Format.E5M2]),
    seed=st.integers(0, 2**16),
)
def test_fp8_linear_matches_reference(m, n, k, lead, fmt_x, fmt_w, per_row, per_channel, has_bias, activation,
                                      residual, out, seed):
    gen = torch.Generator().manual_seed(seed)
    n_w = 2 * n if activation in R.GATED else n
    rows = (*lead, m) if lead else (m,)
    x_q = _fp8((*rows, k), fmt_x, gen)
    w_q = _fp8((n_w, k), fmt_w, gen)
    xs = torch.rand((*rows, 1) if per_row else (), generator=gen) * 0.1 + 1e-3
    ws = torch.rand((n_w,) if per_channel else (), generator=gen) * 0.1 + 1e-3
    bias = torch.randn(n_w, generator=gen) if has_bias else None
    res = None if residual is None else torch.randn((*rows, n), generator=gen).to(residual)
    ref = R.fp8_linear(x_q, xs, w_q, ws, bias=bias, activation=activation, residual=res)
    kwargs = dict(bias=bias, activation=activation, residual=res, config=SMALL)
    with use_backend("triton-interpret"):
        if isinstance(out, FP8Format):
            out_scale = R.amax(ref) / out.max * (0.5 + torch.rand((), generator=gen)) + 1e-6  # some saturate
            got = G.fp8_linear(x_q, xs, w_q, ws, out_scale=out_scale, out_fmt=out, **kwargs)
        else:
            got = G.fp8_linear(x_q, xs, w_q, ws, out_dtype=out, **kwargs)
    assert got.shape == (*rows, n)
    if isinstance(out, FP8Format):
        _assert_fp8_close(got, R.quantize(ref, out_scale, out), f"fp8 out {out.value}")
        return
    assert got.dtype == out
    tol = _tolerance(x_q, xs, w_q, ws, bias, activation, ref)
    # a low-precision output may round the other way when the fp32 values differ: allow that rounding step
    step = 0.0 if out == torch.float32 else ref.abs() * 2.0 ** -(8 if out == torch.bfloat16 else 11)
    err = (got.float() - ref).abs()
    assert torch.all(err <= tol + step), f"max error {err.max().item():.3g} > tolerance {tol:.3g}"
    kind = f"{activation} {str(out).removeprefix('torch.')}"
    MAX_ERR[kind] = max(MAX_ERR.get(kind, 0.0), ((err - step).clamp(min=0).max() / tol).item())


@pytest.mark.parametrize("activation", [None, "gelu", "swiglu", "geglu_tanh"])
def test_decode_and_default_configs(activation):
    """M = 1 (decode) through the config the wrapper picks itself (one 64-row tile, mostly masked)."""
    gen = torch.Generator().manual_seed(1)
    for m in (1, 20):
        n, k = 40, 77
        n_w = 2 * n if activation in R.GATED else n
        x_q, w_q = _fp8((m, k), FP8Format.E4M3, gen), _fp8((n_w, k), FP8Format.E4M3, gen)
        xs, ws = torch.tensor(0.02), torch.rand(n_w, generator=gen) * 0.1
        ref = R.fp8_linear(x_q, xs, w_q, ws, activation=activation)
        with use_backend("triton-interpret"):
            got = G.fp8_linear(x_q, xs, w_q, ws, activation=activation)
        assert (got - ref).abs().max() <= _tolerance(x_q, xs, w_q, ws, None, activation, ref)


def test_fc1_act_fc2_chain_passes_fp8():
    """fc1 (+gelu, FP8 out with fc2's input scale) → fc2 equals the reference chain that quantizes."""
    gen = torch.Generator().manual_seed(2)
    fmt = FP8Format.E4M3
    x_q, w1, w2 = _fp8((9, 40), fmt, gen), _fp8((48, 40), fmt, gen), _fp8((24, 48), fmt, gen)
    s1, s2, ws = torch.tensor(0.05), torch.tensor(0.03), torch.tensor(0.01)
    with use_backend("triton-interpret"):
        h_q = G.fp8_linear(x_q, s1, w1, ws, activation="gelu", out_scale=s2, config=SMALL)
        y = G.fp8_linear(h_q, s2, w2, ws, config=SMALL)
    h_ref = R.quantize(R.fp8_linear(x_q, s1, w1, ws, activation="gelu"), s2, fmt)
    _assert_fp8_close(h_q, h_ref, "chain fc1")
    y_ref = R.fp8_linear(h_ref, s2, w2, ws)
    assert torch.equal(h_q.view(torch.uint8), h_ref.view(torch.uint8)) and (y - y_ref).abs().max() <= 1e-5


def test_non_contiguous_operands_and_broadcast_residual():
    gen = torch.Generator().manual_seed(3)
    x_q = _fp8((2, 5, 33), FP8Format.E4M3, gen).transpose(0, 1)  # 5×2×33, non-contiguous leading dims
    w_q = _fp8((33, 20), FP8Format.E4M3, gen).t()  # 20×33 transposed view: copied to K-contiguous
    res = torch.randn(20, generator=gen)  # broadcast over all rows
    xs = torch.rand(5, 2, 1, generator=gen) * 0.1
    ref = R.fp8_linear(x_q, xs, w_q, torch.tensor(0.1), residual=res, activation="relu")
    with use_backend("triton-interpret"):
        got = G.fp8_linear(x_q, xs, w_q, torch.tensor(0.1), residual=res, activation="relu", config=SMALL)
    assert (got - ref).abs().max() <= 1e-5 * ref.abs().max()


@pytest.mark.parametrize(
    "a_shape, b_shape, a_scale_shape, b_scale_shape, transposed_b",
    [
        ((2, 1, 17, 33), (3, 33, 20), (2, 1, 17, 1), (), False),  # broadcast batch dims both ways, per-row a
        ((2, 3, 20, 16), (2, 1, 16, 33), (), (2, 1, 1, 33), True),  # Kᵀ view, per-column b (per-token K)
        ((17, 33), (33, 1), (), (), False),  # no batch, N = 1
        ((4, 1, 48), (4, 48, 5), (4, 1, 1), (), False),  # M = 1
    ],
)
def test_fp8_matmul_matches_reference(a_shape, b_shape, a_scale_shape, b_scale_shape, transposed_b):
    gen = torch.Generator().manual_seed(4)
    a_q = _fp8(a_shape, FP8Format.E4M3, gen)
    if transposed_b:
        b_q = _fp8((*b_shape[:-2], b_shape[-1], b_shape[-2]), FP8Format.E5M2, gen).transpose(-1, -2)
    else:
        b_q = _fp8(b_shape, FP8Format.E5M2, gen)
    sa = torch.rand(a_scale_shape, generator=gen) + 0.01
    sb = torch.rand(b_scale_shape, generator=gen) + 0.01
    ref = R.fp8_matmul(a_q, sa, b_q, sb)
    with use_backend("triton-interpret"):
        got = G.fp8_matmul(a_q, sa, b_q, sb, config=SMALL)
    acc = torch.matmul(a_q.double(), b_q.double()).abs().max() * (sa.max() * sb.max()).item()
    assert got.shape == ref.shape and got.dtype == torch.float32
    err = (got - ref).abs().max().item()
    assert err <= REL * acc.item()
    MAX_ERR["matmul"] = max(MAX_ERR.get("matmul", 0.0), err / (REL * acc.item()))


def test_rejects_bad_arguments():
    x_q = torch.zeros(3, 8, dtype=torch.float8_e4m3fn)
    with use_backend("triton-interpret"):
        with pytest.raises(ValueError, match="gated"):
            G.fp8_linear(x_q, torch.tensor(1.0), torch.zeros(5, 8, dtype=torch.float8_e4m3fn), torch.tensor(1.0),
                         activation="swiglu")
        with pytest.raises(TypeError):
            G.fp8_linear(x_q.float(), torch.tensor(1.0), x_q, torch.tensor(1.0))
        with pytest.raises(ValueError, match="activation"):
            G.fp8_linear(x_q, torch.tensor(1.0), x_q, torch.tensor(1.0), activation="tanh")


# ---------------------------------------------------------------------------------------------------
# AOT table: it lists what the wrappers launch, and it compiles to FP8 tensor-core instructions


class _Recorder:
    """Stands in for a kernel: records the arguments of each launch instead of running it."""

    def __init__(self, kernel):
        self.kernel, self.launches = kernel, []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((args, kwargs))


def _jit_signature(kernel, args, kwargs):
    """(signature, constexprs) the JIT would compile for a launch (ints == 1 become constexpr 1)."""
    params = kernel.jit.params
    sig, consts = {}, {}
    for p, value in zip(params, list(args) + [kwargs[p.name] for p in params[len(args):]]):
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", value
        elif isinstance(value, int) and value == 1 and not p.do_not_specialize:
            sig[p.name], consts[p.name] = "constexpr", 1
        else:
            sig[p.name] = mangle_type(value)
    return sig, consts


def test_aot_configs_cover_wrapper_launches(monkeypatch):
    rec_linear, rec_matmul = _Recorder(G.LINEAR_KERNEL), _Recorder(G.MATMUL_KERNEL)
    monkeypatch.setattr(G, "LINEAR_KERNEL", rec_linear)
    monkeypatch.setattr(G, "MATMUL_KERNEL", rec_matmul)
    gen = torch.Generator().manual_seed(5)
    with use_backend("triton-interpret"):
        for m, act, fmt, out, res in [(1, None, FP8Format.E4M3, torch.float32, None),
                                      (40, "swiglu", FP8Format.E5M2, FP8Format.E4M3, torch.bfloat16),
                                      (300, "gelu_tanh", FP8Format.E4M3, torch.float16, torch.float32),
                                      (7, "geglu", FP8Format.E4M3, FP8Format.E5M2, torch.float16)]:
            n_w = 64 if act in R.GATED else 32
            kwargs = {"out_scale": torch.tensor(0.5), "out_fmt": out} if isinstance(out, FP8Format) else {
                "out_dtype": out}
            G.fp8_linear(_fp8((m, 48), fmt, gen), torch.rand(m, 1), _fp8((n_w, 48), FP8Format.E4M3, gen),
                         torch.rand(n_w), bias=torch.randn(n_w), activation=act,
                         residual=None if res is None else torch.randn(m, 32).to(res), **kwargs)
        a = _fp8((2, 4, 33, 16), FP8Format.E4M3, gen)
        G.fp8_matmul(a, torch.tensor(1.0), a.transpose(-1, -2), torch.tensor(1.0))
        G.fp8_matmul(a, torch.rand(2, 4, 33, 1), _fp8((4, 16, 8), FP8Format.E5M2, gen), torch.tensor(1.0))
    table = [(e[2], e[3], e[4]) for e in G.AOT_CONFIGS]
    for rec in (rec_linear, rec_matmul):
        assert rec.launches
        for args, kwargs in rec.launches:
            kwargs = {k: v for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
            sig, consts = _jit_signature(rec.kernel, args, kwargs)
            assert (rec.kernel, sig, consts) in table, f"launch not in AOT_CONFIGS: {sig} {consts}"


def _compile(entry, arch):
    src = triton.compiler.ASTSource(fn=entry[2].jit, signature=entry[3], constexprs=entry[4], attrs=G.aot_attrs(entry))
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=G.aot_options(entry))


def _check_ptx(entry, arch):
    compiled = _compile(entry, arch)
    ptx = compiled.asm["ptx"]
    fmts = re.search(r"\| (\w+)x(\w+)", entry[1]).groups()
    instr = "wgmma.mma_async" if arch == 90 else "mma.sync"
    found = re.findall(rf"{re.escape(instr)}[\w.]*", ptx)
    assert found, f"no {instr} in PTX of {entry[1]}"
    assert all(f".{fmts[0]}.{fmts[1]}" in i for i in found), found  # e4m3/e5m2 operands, no upcast
    assert arch != 89 or "wgmma" not in ptx
    assert compiled.metadata.shared <= 99 * 1024  # Ada's per-block limit (Hopper: 227 KB)


def _representative():
    """Cold compiles take 1-4 s each, so the fast test takes 5 entries per arch: the heaviest linear
    epilogue of each block config (gated, bias, residual, FP8 out), all-E5M2 operands with E5M2 output,
    and a mixed-format matmul on a transposed B. The slow test below compiles 108 more."""
    want = [f"{cfg}-gated .* e4m3xe4m3 act=swiglu bias=1 residual=bf16 out=fp8e4m3$" for cfg in G.CONFIGS]
    want += ["decode-gated .* e5m2xe5m2 act=geglu bias=0 residual=fp16 out=fp8e5m2$", "large .* e4m3xe5m2 b=nk$"]
    picked = [e for e in G.AOT_CONFIGS if any(re.match(w, e[1]) for w in want)]
    assert len(picked) == len(want)
    return picked


@pytest.mark.parametrize("arch", [90, 89])
@pytest.mark.parametrize("entry", _representative(), ids=lambda e: e[1].replace(" ", ""))
def test_aot_representative_compile_to_fp8_mma(entry, arch):
    _check_ptx(entry, arch)


def test_aot_table_is_complete_and_unique():
    keys = [(e[0], tuple(sorted(e[3].items())), tuple(sorted((k, str(v)) for k, v in e[4].items())))
            for e in G.AOT_CONFIGS]
    assert len(set(keys)) == len(keys)
    assert len({e[1] for e in G.AOT_CONFIGS}) == len(G.AOT_CONFIGS)
    linear = [e for e in G.AOT_CONFIGS if e[0] == "_fp8_linear_kernel"]
    assert len(linear) == len(G.CONFIGS) * 4 * len(ACTS) * 2 * 4 * 5


def test_report_max_errors():
    """Runs last in this file (pytest keeps definition order): prints the worst errors seen (-s)."""
    for kind, worst in sorted(MAX_ERR.items()):
        print(f"{kind:>24}: {worst:.3g}")


def _sm90_ptx(entry, promote: bool) -> str:
    consts = {**entry[4], "PROMOTE": promote}
    src = triton.compiler.ASTSource(fn=entry[2].jit, signature=entry[3], constexprs=consts, attrs=G.aot_attrs(entry))
    cfg = G.CONFIGS[entry[1].split()[0]]
    options = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options).asm["ptx"]


def test_promotion_compiles_to_a_fresh_partial_sum_added_in_fp32():
    """GemmConfig.promote (the default): each K step's wgmma starts from zero (scale-d 0) and its partial tile is
    added to the fp32 accumulator; promote=False (benchmarks/gpu.py's "fast accumulation" column) chains the
    accumulator through every wgmma, as Triton's sm_90 default does. tests/gpu shows what that costs in bits."""
    [entry] = [e for e in G.AOT_CONFIGS if e[1].startswith("large ") and "e4m3xe4m3 act=None bias=0 residual=None "
               "out=bf16" in e[1]]
    promoted, chained = _sm90_ptx(entry, True), _sm90_ptx(entry, False)
    first_wgmma = next(line for line in promoted.splitlines() if "wgmma.mma_async" in line)
    assert first_wgmma.rstrip(";").split(",")[-3].strip() == "0"  # scale-d 0: D = A·B, not D + A·B
    per_thread = G.CONFIGS["large"].BLOCK_M * G.CONFIGS["large"].BLOCK_N // (32 * G.CONFIGS["large"].num_warps)
    assert promoted.count("add.f32") >= per_thread and chained.count("add.f32") < per_thread
    assert "PROMOTE" in entry[4] and entry[4]["PROMOTE"] is True  # the AOT table holds the promoted kernels
