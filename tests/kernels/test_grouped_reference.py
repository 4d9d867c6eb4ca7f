"""The reference grouped FP8 GEMM (MoE experts) and the CPU backend's against an independent fp64 loop over
(token, choice) pairs.

The oracle never sorts: for token t's j-th choice e = topk_ids[t, j] it computes act(x·W[e]ᵀ·sx·sw[e] + b[e])
in fp64 from the FP8 values, so it checks the routing plan, the per-expert scale indexing and the
scatter-add together. Shapes are tiny; experts without tokens, top_k > 1 and single-token decode are
drawn on purpose.
"""

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dbr_quant import kernels as K
from dbr_quant.formats import FP8Format, safe_scale
from dbr_quant.kernels.cpu import backend as cpu_backend
from dbr_quant.kernels.reference import dense as R
from dbr_quant.kernels.reference import grouped as RG
from dbr_quant.kernels.routing import moe_route

E4M3 = FP8Format.E4M3
ACTS = [None, *R.ACTIVATIONS, *R.GATED]


def random_topk(gen, tokens, experts, top_k, empty=()):
    """Distinct experts per token, never one of ``empty`` (which then receives no tokens)."""
    allowed = torch.tensor([e for e in range(experts) if e not in empty])
    rows = [allowed[torch.randperm(len(allowed), generator=gen)[:top_k]] for _ in range(tokens)]
    return torch.stack(rows) if rows else torch.zeros(0, top_k, dtype=torch.long)


def fp8(shape, gen, fmt=E4M3, scale=4.0):
    return (torch.randn(shape, generator=gen) * scale).clamp(-fmt.max, fmt.max).to(fmt.dtype)


def act64(y, activation):
    if activation in R.GATED:
        gate, up = y.chunk(2, dim=-1)
        gated = {"swiglu": F.silu, "geglu": F.gelu, "geglu_tanh": lambda v: F.gelu(v, approximate="tanh")}
        return gated[activation](gate) * up
    return {None: lambda v: v, "relu": F.relu, "gelu": F.gelu, "silu": F.silu,
            "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}[activation](y)


def oracle_slots(x_slot, xs_slot, w_q, ws, bias, activation, ids):
    """fp64 result per slot s = t·top_k + j ([T·top_k, N]): x_slot[s] is the FP8 row that slot reads,
    xs_slot[s] its activation scale; expert ids[t, j]'s weight, scales and bias."""
    out = []
    for s, e in enumerate(ids.reshape(-1).tolist()):
        w_scale = ws if ws.dim() == 0 else ws[e].reshape(-1) if ws[e].numel() > 1 else ws[e].reshape(())
        y = (x_slot[s].double() @ w_q[e].double().T) * xs_slot[s].double() * w_scale.double()
        if bias is not None:
            y = y + bias[e].double()
        out.append(act64(y, activation))
    return torch.stack(out)


def magnitude(x_slot, xs_slot, w_q, ws, bias, activation, ids):
    """What the fp32/bf16 accumulation can perturb: |pre-activation| (gate·up products for gated)."""
    pre = oracle_slots(x_slot, xs_slot, w_q, ws, bias, None, ids)
    if activation in R.GATED:
        gate, up = pre.chunk(2, dim=-1)
        return (gate.abs() * up.abs() + gate.abs() + up.abs()).max().item()
    return pre.abs().max().item()


def test_routing_plan_sorts_rows_by_expert_stably_and_leaves_unpicked_experts_empty():
    ids = torch.tensor([[3, 0], [0, 2], [3, 2], [0, 3]])
    r = moe_route(ids, 5)
    assert r.expert_offsets.tolist() == [0, 3, 3, 5, 8, 8]  # experts 1 and 4: no rows
    assert r.slots.tolist() == [1, 2, 6, 3, 5, 0, 4, 7]  # expert 0: slots 1, 2, 6 (token order), …
    assert r.tokens.tolist() == [0, 1, 3, 1, 2, 0, 2, 3]
    assert r.row_experts.tolist() == [0, 0, 0, 2, 2, 3, 3, 3]
    w = torch.arange(8.0).reshape(4, 2)
    assert r.row_weights(w).tolist() == [1.0, 2.0, 6.0, 3.0, 5.0, 0.0, 4.0, 7.0]


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(0, 20), experts=st.integers(1, 9), top_k=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_routing_plan_properties(tokens, experts, top_k, seed):
    top_k = min(top_k, experts)
    ids = random_topk(torch.Generator().manual_seed(seed), tokens, experts, top_k)
    r = moe_route(ids, experts)
    assert sorted(r.slots.tolist()) == list(range(tokens * top_k))  # a permutation of the slots
    assert torch.equal(ids.reshape(-1)[r.slots.long()], r.row_experts)  # row r belongs to its slot's expert
    assert torch.equal(r.counts, torch.bincount(ids.reshape(-1), minlength=experts))
    for e in range(experts):  # stable: an expert's rows in slot order
        lo, hi = r.expert_offsets[e].item(), r.expert_offsets[e + 1].item()
        assert r.slots[lo:hi].tolist() == sorted(r.slots[lo:hi].tolist())


def _case(gen, tokens, experts, top_k, k, n, activation, x_kind, w_kind, has_bias, x_sorted, empty,
          fmt_x=E4M3, fmt_w=E4M3):
    """A random grouped-GEMM problem: (ids, routing, x as passed, x_scale as passed, FP8 row per slot,
    scale per slot, w_q, w_scale, bias)."""
    ids = random_topk(gen, tokens, experts, top_k, empty)
    r = moe_route(ids, experts)
    n_w = 2 * n if activation in R.GATED else n
    rows = r.num_rows
    x_slot = fp8((rows, k), gen, fmt_x)
    w_q = fp8((experts, n_w, k), gen, fmt_w)
    if x_kind == "tensor":
        xs = torch.rand((), generator=gen) * 0.1 + 1e-3
        xs_slot = xs.expand(rows)
    elif x_kind == "expert":
        xs = torch.rand(experts, generator=gen) * 0.1 + 1e-3
        xs_slot = xs[ids.reshape(-1)]
    elif x_sorted:  # one scale per sorted row
        xs_slot = torch.rand(rows, generator=gen) * 0.1 + 1e-3
        xs = xs_slot[r.slots.long()][:, None]
    else:  # one scale per token (dynamic per-token quantization)
        xs_tok = torch.rand(tokens, generator=gen) * 0.1 + 1e-3
        xs, xs_slot = xs_tok[:, None], xs_tok.repeat_interleave(top_k)
    if not x_sorted:  # token-order input: every slot of token t reads row t
        x_tok = fp8((tokens, k), gen, fmt_x)
        x_in, x_slot = x_tok, x_tok.repeat_interleave(top_k, dim=0)
    else:
        x_in = x_slot[r.slots.long()]
    ws = {"tensor": torch.tensor(0.02), "expert": torch.rand(experts, generator=gen) * 0.1 + 1e-3,
          "channel": torch.rand(experts, n_w, generator=gen) * 0.1 + 1e-3}[w_kind]
    bias = torch.randn(experts, n_w, generator=gen) if has_bias else None
    return ids, r, x_in, xs, x_slot, xs_slot, w_q, ws, bias


@settings(max_examples=60, deadline=None)
@given(tokens=st.sampled_from([1, 2, 5, 13]), experts=st.integers(1, 6), top_k=st.integers(1, 3),
       k=st.sampled_from([1, 16, 33]), n=st.integers(1, 20), activation=st.sampled_from(ACTS),
       x_kind=st.sampled_from(["tensor", "expert", "row"]), w_kind=st.sampled_from(["tensor", "expert", "channel"]),
       has_bias=st.booleans(), x_sorted=st.booleans(), exact=st.booleans(), n_empty=st.integers(0, 2),
       seed=st.integers(0, 2**16))
def test_grouped_linear_matches_fp64_loop(tokens, experts, top_k, k, n, activation, x_kind, w_kind, has_bias,
                                          x_sorted, exact, n_empty, seed):
    gen = torch.Generator().manual_seed(seed)
    top_k = min(top_k, experts)
    empty = tuple(range(min(n_empty, experts - top_k)))
    ids, r, x_in, xs, x_slot, xs_slot, w_q, ws, bias = _case(gen, tokens, experts, top_k, k, n, activation, x_kind,
                                                             w_kind, has_bias, x_sorted, empty)
    grouped_linear = RG.fp8_grouped_linear if exact else cpu_backend.fp8_grouped_linear
    got = grouped_linear(x_in, xs, w_q, ws, r, x_sorted=x_sorted, bias=bias, activation=activation)
    want = oracle_slots(x_slot, xs_slot, w_q, ws, bias, activation, ids)[r.slots.long()]  # sorted row order
    assert got.shape == (r.num_rows, n) and got.dtype == torch.float32
    # the reference: fp32 accumulation order only; the CPU backend: the bf16-rounded accumulator (≤ 2⁻⁹ relative,
    # ×2 margin)
    rel = 1e-5 if exact else 2.0**-8
    tol = rel * (magnitude(x_slot, xs_slot, w_q, ws, bias, activation, ids) + want.abs().max().item()) + 1e-30
    assert (got.double() - want).abs().max().item() <= tol


@settings(max_examples=30, deadline=None)
@given(tokens=st.sampled_from([1, 4, 11]), experts=st.integers(2, 6), top_k=st.integers(1, 3),
       per_expert_out=st.booleans(), fmt=st.sampled_from(list(FP8Format)), seed=st.integers(0, 2**16))
def test_gated_fp8_output_is_the_fp64_result_quantized_with_each_experts_scale(tokens, experts, top_k,
                                                                               per_expert_out, fmt, seed):
    gen = torch.Generator().manual_seed(seed)
    top_k = min(top_k, experts)
    ids, r, x_in, xs, x_slot, xs_slot, w_q, ws, bias = _case(gen, tokens, experts, top_k, 48, 24, "swiglu", "row",
                                                             "channel", False, False, (0,) if experts > top_k else ())
    want = oracle_slots(x_slot, xs_slot, w_q, ws, bias, "swiglu", ids)
    amax = want.abs().amax().float()
    h_scale = (amax / fmt.max * (0.5 + torch.rand(experts, generator=gen)) if per_expert_out
               else amax / fmt.max * 0.7)  # some values saturate
    got = RG.fp8_grouped_linear(x_in, xs, w_q, ws, r, activation="swiglu", out_scale=h_scale, out_fmt=fmt)
    slot_scale = h_scale[ids.reshape(-1)] if per_expert_out else h_scale.expand(r.num_rows)
    want_q = (want * torch.reciprocal(slot_scale.float()).double()[:, None]).clamp(-fmt.max, fmt.max).float()
    want_q = want_q.to(fmt.dtype)[r.slots.long()]
    assert got.dtype == fmt.dtype
    differ = got.view(torch.uint8) != want_q.view(torch.uint8)
    assert int(differ.sum()) <= max(1, got.numel() // 100)  # only values on a rounding boundary may differ
    assert torch.allclose(got.float()[differ], want_q.float()[differ], rtol=2.0**-fmt.mantissa_bits)


@settings(max_examples=40, deadline=None)
@given(tokens=st.sampled_from([1, 3, 9]), experts=st.integers(1, 6), top_k=st.integers(1, 3),
       w_kind=st.sampled_from(["expert", "channel"]), x_kind=st.sampled_from(["tensor", "expert"]),
       has_bias=st.booleans(), out_dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 2**16))
def test_down_projection_scatter_adds_routing_weighted_rows_into_tokens(tokens, experts, top_k, w_kind, x_kind,
                                                                        has_bias, out_dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    top_k = min(top_k, experts)
    ids, r, x_in, xs, x_slot, xs_slot, w_q, ws, bias = _case(gen, tokens, experts, top_k, 40, 16, None, x_kind,
                                                             w_kind, has_bias, True, ())
    weights = torch.rand(tokens, top_k, generator=gen)
    got = RG.fp8_grouped_linear(x_in, xs, w_q, ws, r, x_sorted=True, bias=bias, topk_weights=weights,
                                out_dtype=out_dtype)
    rows = oracle_slots(x_slot, xs_slot, w_q, ws, bias, None, ids).reshape(tokens, top_k, -1)
    want = (rows * weights.double()[:, :, None]).sum(1)
    assert got.shape == (tokens, 16) and got.dtype == out_dtype
    step = 2.0**-8 * want.abs() if out_dtype == torch.bfloat16 else 0.0
    tol = 1e-5 * top_k * (rows.abs().max().item() + 1e-30)
    assert torch.all((got.double() - want).abs() <= tol + step)


def _block_oracle(x, ids, weights, w13, ws13, w2, ws2, h_scale, x_scale, fmt):
    """fp64 MoE block per (token, choice), quantizing x and h exactly as the contract says."""
    out = torch.zeros(x.shape[0], w2.shape[1], dtype=torch.float64)
    for t in range(x.shape[0]):
        for j, e in enumerate(ids[t].tolist()):
            sx = (safe_scale(x[t].abs().amax(), fmt) if x_scale is None
                  else x_scale if x_scale.numel() == 1 else x_scale[e])
            xq = (x[t] * torch.reciprocal(sx)).clamp(-fmt.max, fmt.max).to(fmt.dtype)
            h = act64((xq.double() @ w13[e].double().T) * sx.double() * ws13[e].double(), "swiglu")
            sh = h_scale if h_scale.numel() == 1 else h_scale[e]
            hq = (h * torch.reciprocal(sh).double()).clamp(-fmt.max, fmt.max).float().to(fmt.dtype)
            y = (hq.double() @ w2[e].double().T) * sh.double() * ws2[e].double()
            out[t] += weights[t, j].double() * y
    return out


def moe_weights(gen, experts, hidden, inter, fmt=E4M3):
    w13, w2 = torch.randn(experts, 2 * inter, hidden, generator=gen), torch.randn(experts, hidden, inter, generator=gen)
    ws13, ws2 = safe_scale(w13.abs().amax(-1), fmt), safe_scale(w2.abs().amax(-1), fmt)
    return R.quantize(w13, ws13[..., None], fmt), ws13, R.quantize(w2, ws2[..., None], fmt), ws2


@pytest.mark.parametrize("x_scale_kind", ["dynamic", "tensor", "expert"])
@pytest.mark.parametrize("tokens,top_k", [(1, 2), (16, 2), (9, 3)])
def test_moe_block_is_three_launches_and_matches_fp64(x_scale_kind, tokens, top_k):
    gen = torch.Generator().manual_seed(tokens * 10 + top_k)
    experts, hidden, inter = 6, 32, 24
    x = torch.randn(tokens, hidden, generator=gen)
    ids = random_topk(gen, tokens, experts, top_k, empty=(5,))
    weights = torch.softmax(torch.randn(tokens, top_k, generator=gen), -1)
    w13, ws13, w2, ws2 = moe_weights(gen, experts, hidden, inter)
    x_scale = {"dynamic": None, "tensor": safe_scale(x.abs().amax(), E4M3),
               "expert": safe_scale(x.abs().amax(), E4M3) * (0.6 + torch.rand(experts, generator=gen))}[x_scale_kind]
    h_scale = 0.03 + 0.04 * torch.rand(experts, generator=gen) if x_scale_kind == "expert" else torch.tensor(0.05)
    r = moe_route(ids, experts)
    with K.count_launches() as launches:
        got = K.fp8_moe_block(x, r, weights, w13, ws13, w2, ws2, h_scale, x_scale=x_scale)
    assert sum(launches.values()) == 3 and launches["fp8_grouped_linear"] == 2
    assert launches[{"dynamic": "dynamic_quantize", "tensor": "quantize", "expert": "moe_quantize"}[x_scale_kind]] == 1
    want = _block_oracle(x, ids, weights, w13, ws13, w2, ws2, h_scale, x_scale, E4M3)
    # The bf16 fast path moves an intermediate FP8 value h by one step (2⁻⁴..2⁻³ relative) where h sits
    # within the accumulator's rounding (2⁻⁹) of a rounding boundary: ~4 % of h, ≈ 1 % of the output here.
    # (The exact path meets the oracle to ~6e-8; the Triton block test checks that tightly.) A wrong expert,
    # routing weight or per-expert scale costs ≥ 8 % on these cases (measured by rolling h_scale by one expert).
    err = (got.double() - want).norm() / want.norm()
    assert err < 2.0**-5, f"relative error {err:.3g}"
    assert got.shape == (tokens, hidden)


def test_moe_quantize_quantizes_each_row_with_its_experts_scale():
    gen = torch.Generator().manual_seed(3)
    ids = random_topk(gen, 7, 5, 2, empty=(1,))
    r = moe_route(ids, 5)
    x, scale = torch.randn(7, 20, generator=gen) * 3, torch.rand(5, generator=gen) * 0.02 + 1e-3
    got = RG.moe_quantize(x, scale, r, E4M3)
    for row, (slot, e) in enumerate(zip(r.slots.tolist(), r.row_experts.tolist())):
        want = (x[slot // 2] * torch.reciprocal(scale[e])).clamp(-448, 448).to(torch.float8_e4m3fn)
        assert torch.equal(got[row].view(torch.uint8), want.view(torch.uint8))


def test_errors_name_the_op_and_the_argument():
    r = moe_route(torch.tensor([[0, 1]]), 2)
    x_q, w_q = torch.zeros(1, 8, dtype=torch.float8_e4m3fn), torch.zeros(2, 6, 8, dtype=torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    with pytest.raises(ValueError, match="fp8_grouped_linear: w_q must be"):
        RG.fp8_grouped_linear(x_q, one, w_q[:1], one, r)
    with pytest.raises(ValueError, match="one row per sorted rows"):
        RG.fp8_grouped_linear(x_q, one, w_q, one, r, x_sorted=True)
    with pytest.raises(ValueError, match="x_scale must be"):
        RG.fp8_grouped_linear(x_q, torch.ones(3), w_q, one, r)
    with pytest.raises(ValueError, match="w_scale must be"):
        RG.fp8_grouped_linear(x_q, one, w_q, torch.ones(2, 5), r)
    with pytest.raises(ValueError, match="out_scale must be"):
        RG.fp8_grouped_linear(x_q, one, w_q, one, r, out_scale=torch.ones(1, 1, 3))
    with pytest.raises(ValueError, match="exclude each other"):
        RG.fp8_grouped_linear(x_q, one, w_q, one, r, out_scale=one, topk_weights=torch.ones(1, 2))
    with pytest.raises(ValueError, match="expert ids must lie"):
        moe_route(torch.tensor([[0, 2]]), 2)
