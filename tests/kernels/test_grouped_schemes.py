"""The grouped MoE GEMMs of the other schemes — weight-only FP8 (W8A16) and MXFP8 — against the dense linear of
the same scheme run expert by expert on the rows routed to it, and against an oracle that never sorts.

* ``fp8_grouped_weight_only_linear``: x stays high precision. Bit for bit equal to ``kernels.fp8_weight_only_linear``
  of each expert's routed tokens with its weight (each backend against itself), and within fp32 rounding of an
  fp64 ``F.linear`` per (token, choice) slot on the dequantized weights (which never sorts).
* ``fp8_grouped_mx_linear``: bit for bit equal to ``kernels.fp8_mx_linear`` of each expert's routed rows and
  codes with its weight and codes (each backend against itself).

The combine (``topk_weights``) is checked against the fp64 weighted sum of the per-slot results.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from test_grouped_reference import ACTS, random_topk  # tests/kernels is on sys.path

from dbr_quant import kernels as K
from dbr_quant.formats import FP8Format
from dbr_quant.kernels.reference import dense as R
from dbr_quant.kernels.routing import moe_route

E4M3 = FP8Format.E4M3
BACKENDS = ("reference", "cpu")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _weights(gen, num_e, n_w, k, per_channel):
    """Per-expert FP8 weights quantized from random fp32 weights, and their scales ([E, N] or [E])."""
    w = torch.randn(num_e, n_w, k, generator=gen) * torch.exp(torch.randn(num_e, n_w, 1, generator=gen))
    amax = w.abs().amax(-1) if per_channel else w.abs().flatten(1).amax(-1)
    scale = amax / E4M3.max
    w_q = (w / (scale[..., None] if per_channel else scale[:, None, None])).to(torch.float8_e4m3fn)
    return w_q, scale


def _slot_rows(routing):
    """Each sorted row's slot (t·top_k + j)."""
    return routing.slots.long()


def _assert_combined(got, rows, routing, topk_w):
    """``got`` [T, N] is the routing-weighted sum of the sorted ``rows`` into token order: equal to the fp64 sum up to
    the fp32 rounding of each term and addition (a few ulps of Σ|terms| per token, whatever the cancellation)."""
    terms = rows.double() * routing.row_weights(topk_w).double()[:, None]
    want = torch.zeros(got.shape, dtype=torch.float64).index_add_(0, routing.tokens, terms)
    magnitude = torch.zeros(got.shape, dtype=torch.float64).index_add_(0, routing.tokens, terms.abs())
    assert bool(((got.double() - want).abs() <= magnitude * 2.0**-21 + 1e-30).all())


def _per_expert(routing, sorted_rows, n, dtype, dense):
    """Sorted rows [T·top_k, n]: ``dense(e, rows)`` on each expert's routed rows, in one call per expert (as the
    dense layer would see them: torch's elementwise ops may round a lone row's tail differently)."""
    out = torch.zeros(routing.num_rows, n, dtype=dtype)
    offsets = routing.expert_offsets.tolist()
    for e in range(routing.num_experts):
        lo, hi = offsets[e], offsets[e + 1]
        if lo < hi:
            out[lo:hi] = dense(e, torch.arange(lo, hi) if sorted_rows else routing.tokens[lo:hi])
    return out


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(0, 9), num_e=st.integers(1, 5), top_k=st.integers(1, 3), k=st.integers(1, 40),
       n=st.integers(1, 12), activation=st.sampled_from(ACTS), per_channel=st.booleans(), has_bias=st.booleans(),
       dtype=st.sampled_from(DTYPES), backend=st.sampled_from(BACKENDS), combine=st.booleans(),
       seed=st.integers(0, 2**16))
def test_weight_only_experts_equal_the_dense_weight_only_linear_per_expert(tokens, num_e, top_k, k, n, activation,
                                                                           per_channel, has_bias, dtype, backend,
                                                                           combine, seed):
    top_k = min(top_k, num_e)
    gen = torch.Generator().manual_seed(seed)
    n_w = 2 * n if activation in R.GATED else n
    w_q, w_scale = _weights(gen, num_e, n_w, k, per_channel)
    bias = torch.randn(num_e, n_w, generator=gen) if has_bias else None
    x = (torch.randn(tokens, k, generator=gen) * 3).to(dtype)
    ids = random_topk(gen, tokens, num_e, top_k, empty=(num_e - 1,) if num_e > top_k else ())
    topk_w = torch.rand(tokens, top_k, generator=gen)
    routing = moe_route(ids, num_e)
    with K.use_backend(backend):
        y = K.fp8_grouped_weight_only_linear(x, w_q, w_scale, routing, bias=bias, activation=activation,
                                             out_dtype=torch.float32 if combine else dtype,
                                             topk_weights=topk_w if combine else None)
        dense = _per_expert(routing, False, n, torch.float32 if combine else dtype, lambda e, src: (
            K.fp8_weight_only_linear(x[src], w_q[e], w_scale[e] if per_channel else w_scale[e].reshape(()),
                                     bias=None if bias is None else bias[e], activation=activation,
                                     out_dtype=torch.float32 if combine else dtype)))
    if not combine:
        assert y.dtype == dtype and y.shape == (tokens * top_k, n)
        assert torch.equal(y, dense)
        # and within fp32 rounding of F.linear on the dequantized weights (fp64), for the pre-activation
        if activation is None and tokens:
            w_dq = w_q.double() * (w_scale.double()[..., None] if per_channel else w_scale.double()[:, None, None])
            ref = torch.stack([F.linear(x[t].double(), w_dq[int(ids[t, j])],
                                        None if bias is None else bias[int(ids[t, j])].double())
                               for t in range(tokens) for j in range(top_k)])
            tol = 1e-5 if dtype == torch.float32 else 1e-2
            torch.testing.assert_close(y.double(), ref[_slot_rows(routing)].to(dtype).double(), rtol=tol, atol=tol)
    else:
        assert y.shape == (tokens, n)
        _assert_combined(y, dense, routing, topk_w)


@settings(max_examples=25, deadline=None)
@given(tokens=st.integers(0, 9), num_e=st.integers(1, 5), top_k=st.integers(1, 3), k=st.integers(1, 80),
       n=st.integers(1, 12), activation=st.sampled_from(ACTS), has_bias=st.booleans(), round_up=st.booleans(),
       backend=st.sampled_from(BACKENDS), sorted_rows=st.booleans(), seed=st.integers(0, 2**16))
def test_mx_experts_equal_the_dense_mx_linear_per_expert_bit_for_bit(tokens, num_e, top_k, k, n, activation,
                                                                     has_bias, round_up, backend, sorted_rows, seed):
    top_k = min(top_k, num_e)
    gen = torch.Generator().manual_seed(seed)
    n_w = 2 * n if activation in R.GATED else n
    w = torch.randn(num_e, n_w, k, generator=gen) * torch.exp(torch.randn(num_e, 1, k, generator=gen))
    bias = torch.randn(num_e, n_w, generator=gen) if has_bias else None
    ids = random_topk(gen, tokens, num_e, top_k, empty=(0,) if num_e > top_k else ())
    routing = moe_route(ids, num_e)
    x = torch.randn(tokens * top_k if sorted_rows else tokens, k, generator=gen) * 5
    with K.use_backend(backend):
        w_q, w_codes = K.mx_quantize(w, E4M3, round_up)
        x_q, x_codes = K.mx_quantize(x, E4M3, round_up)
        y = K.fp8_grouped_mx_linear(x_q, x_codes, w_q, w_codes, routing, x_sorted=sorted_rows, bias=bias,
                                    activation=activation)
        dense = _per_expert(routing, sorted_rows, n, torch.float32, lambda e, src: K.fp8_mx_linear(
            x_q[src], x_codes[src], w_q[e], w_codes[e], bias=None if bias is None else bias[e], activation=activation))
    assert y.shape == (tokens * top_k, n)
    assert torch.equal(y, dense)
    if not sorted_rows:  # the combine: the fp64 weighted sum of the rows
        topk_w = torch.rand(tokens, top_k, generator=gen)
        with K.use_backend(backend):
            combined = K.fp8_grouped_mx_linear(x_q, x_codes, w_q, w_codes, routing, bias=bias, activation=activation,
                                               topk_weights=topk_w)
        _assert_combined(combined, y, routing, topk_w)


def test_wrong_operands_are_refused_with_the_op_and_tensor_named():
    routing = moe_route(torch.tensor([[0], [1]]), 2)
    w_q = torch.zeros(2, 4, 32, dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="fp8_grouped_weight_only_linear: w_scale"):
        K.fp8_grouped_weight_only_linear(torch.zeros(2, 32), w_q, torch.ones(3), routing)
    with pytest.raises(TypeError, match="fp8_grouped_mx_linear: w_scale must hold E8M0"):
        K.fp8_grouped_mx_linear(torch.zeros(2, 32, dtype=torch.float8_e4m3fn), torch.zeros(2, 1, dtype=torch.uint8),
                                w_q, torch.ones(2, 4, 1), routing)
    with pytest.raises(ValueError, match=r"fp8_grouped_mx_linear: x_scale must be \[2, 1\]"):
        K.fp8_grouped_mx_linear(torch.zeros(2, 32, dtype=torch.float8_e4m3fn), torch.zeros(2, 2, dtype=torch.uint8),
                                w_q, torch.zeros(2, 4, 1, dtype=torch.uint8), routing)
