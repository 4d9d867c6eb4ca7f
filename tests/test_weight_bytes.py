"""What an FP8 weight reports to code that sizes or copies tensors: ``element_size()`` / ``nbytes`` (Hugging Face's
``get_memory_footprint``, its device-map planner), a copy into a plain tensor, the layout the dispatch fallback
gives a transposed weight, and the meta rebuild accelerate's ``init_empty_weights`` makes."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn.utils import prune

from dbr_quant.quantize.weights import FP8Weight, attach_fp8_weight, displaced_fp8_weight


def _weight(out: int, inp: int, granularity: str, transposed: bool, seed: int = 0) -> FP8Weight:
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(out, inp, generator=g) * 50).to(torch.float8_e4m3fn)
    if granularity == "tensor":
        return FP8Weight(q, torch.tensor(0.5), torch.float32, transposed)
    if granularity == "channel":
        return FP8Weight(q, torch.rand(out, generator=g) + 0.5, torch.float32, transposed)
    block = (2, 4)
    scale = torch.rand(-(-out // block[0]), -(-inp // block[1]), generator=g) + 0.5
    return FP8Weight(q, scale, torch.float32, transposed, block)


GRANULARITIES = ["tensor", "channel", "block"]


@settings(max_examples=60, deadline=None)
@given(out=st.integers(1, 300), inp=st.integers(1, 300), granularity=st.sampled_from(GRANULARITIES),
       transposed=st.booleans())
def test_numel_times_element_size_is_the_stored_bytes(out, inp, granularity, transposed):
    """``numel() * element_size()`` (either order) is exactly the FP8 data + scale bytes, an int; ``nbytes``
    the same; ``element_size()`` itself their ratio (the 4 bytes of the reported fp32 before)."""
    w = _weight(out, inp, granularity, transposed)
    stored = w.qdata.numel() * w.qdata.element_size() + w.scale.numel() * w.scale.element_size()
    for product in (w.numel() * w.element_size(), w.element_size() * w.numel(), w.nelement() * w.element_size()):
        assert type(product) is int and product == stored
    assert w.nbytes == stored
    assert math.isclose(w.element_size(), stored / w.numel())
    assert w.element_size() > w.qdata.element_size()  # the scales' share is counted


def test_element_size_of_a_parameter_and_of_a_cast():
    """The parameter convert attaches and its ``.to(bfloat16)`` report the same stored bytes."""
    linear = nn.Linear(8, 6)
    w = _weight(6, 8, "channel", False)
    attach_fp8_weight(linear, w.qdata, w.scale, torch.float32)
    stored = 6 * 8 + 6 * 4
    assert linear.weight.numel() * linear.weight.element_size() == stored
    assert linear.to(torch.bfloat16).weight.nbytes == stored


@pytest.mark.parametrize("granularity", GRANULARITIES)
@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_copy_into_a_plain_tensor_gives_the_dequantized_values(granularity, transposed, dtype):
    """``plain.copy_(fp8_weight)`` (resize_token_embeddings copying a converted lm_head's rows) raised
    AttributeError: the copy handler took the destination to be an FP8 weight."""
    w = _weight(6, 8, granularity, transposed)
    target = torch.zeros(w.shape, dtype=dtype)
    target.copy_(w)
    assert torch.equal(target, w.dequantize(dtype))
    rows = torch.zeros(4, w.shape[1], dtype=dtype)
    rows[:] = w[:4] if not transposed else w.dequantize(dtype)[:4]
    assert torch.equal(rows, w.dequantize(dtype)[:4])


@pytest.mark.parametrize("granularity", GRANULARITIES)
def test_fallback_ops_see_the_reported_contiguous_layout(granularity):
    """A transposed (Conv1D) weight dequantizes to a transposed view of its [out, in] bytes; ops that depend on the
    layout (``view(-1)`` in ``parameters_to_vector``) raised on it, where the fp32 weight works."""
    w = _weight(6, 8, granularity, transposed=True)
    assert w.is_contiguous()
    values = w.dequantize()
    assert torch.equal(w.view(-1), values.reshape(-1))
    assert torch.equal(nn.utils.parameters_to_vector([nn.Parameter(w, requires_grad=False)]), values.reshape(-1))


def test_unknown_keywords_are_refused():
    w = _weight(4, 4, "channel", False)
    with pytest.raises(TypeError, match="unexpected keyword arguments.*'transpose'"):
        FP8Weight(w.qdata, w.scale, torch.float32, transpose=True)


def test_rebuilt_from_a_weight_with_its_own_attributes_keeps_its_state():
    """``type(param)(param.to('meta'), **param.__dict__)`` (accelerate's init_empty_weights): the moved weight
    is taken as it is; the attributes passed beside it are its own and ignored."""
    w = nn.Parameter(_weight(6, 8, "block", True), requires_grad=False)
    moved = w.to("meta")
    rebuilt = FP8Weight(moved, **w.__dict__, requires_grad=False)
    assert isinstance(rebuilt, nn.Parameter) and rebuilt.qdata.device.type == "meta"
    assert (rebuilt.shape, rebuilt.transposed, rebuilt.block, rebuilt.scale.shape) == (
        w.shape, w.transposed, w.block, w.scale.shape)
    with pytest.raises(RuntimeError, match="frozen"):
        FP8Weight(moved, **w.__dict__, requires_grad=True)


def test_displaced_fp8_weight_names_where_prune_moved_it():
    linear = nn.Linear(8, 6)
    assert displaced_fp8_weight(linear) is None
    w = _weight(6, 8, "channel", False)
    attach_fp8_weight(linear, w.qdata, w.scale, torch.float32)
    assert displaced_fp8_weight(linear) is None
    prune.random_unstructured(linear, "weight", amount=0.5)
    assert displaced_fp8_weight(linear) == "weight_orig"
