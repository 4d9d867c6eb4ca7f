"""rewrite() of an example with a size-1 batch or sequence: torch.export neither specializes the dimension to 1
(a graph that rejects batch 3) nor prints ``0/1 specialized; Dim.AUTO …`` for it (#20, point 11)."""

import logging

import pytest
import torch
from test_rewrite import Block
from torch import nn

import dbr_quant as dq
from dbr_quant.fx_rewriter import rewrite

NOISE = ("specialized", "Dim.AUTO")


@pytest.fixture
def torch_log(caplog):
    """Records of the loggers torch.export's shape warnings come from (torch's own handler writes to stderr and
    does not propagate to pytest's, so caplog's handler is attached to them directly)."""
    loggers = [logging.getLogger(n) for n in ("torch._export", "torch.export", "torch.fx.experimental.symbolic_shapes")]
    for lg in loggers:
        lg.addHandler(caplog.handler)
    yield caplog
    for lg in loggers:
        lg.removeHandler(caplog.handler)


def _converted(model: nn.Module, example: torch.Tensor, shape: tuple[int, ...]) -> nn.Module:
    prepared = dq.prepare(model.eval(), (example,))
    dq.calibrate(prepared, [torch.randn(shape) for _ in range(3)], progress=False)
    return dq.convert(prepared)


@pytest.mark.parametrize("example_shape", [(1, 5, 32), (2, 1, 32), (1, 1, 32)], ids=["batch1", "seq1", "both1"])
def test_size_one_example_is_quiet_and_stays_dynamic(example_shape, torch_log, capfd):
    converted = _converted(Block(), torch.randn(example_shape), example_shape)
    gm = rewrite(converted)
    printed = capfd.readouterr()
    said = [r.getMessage() for r in torch_log.records] + (printed.out + printed.err).splitlines()
    assert not [line for line in said if any(w in line for w in NOISE)], said
    for shape in [example_shape, (3, 7, 32), (1, 4, 32)]:  # other sizes than the example's, and its own
        x = torch.randn(shape)
        with torch.no_grad():
            want = converted(x)
        got = gm(x)
        assert torch.equal(got["out"], want["out"]) and got["shape"] == want["shape"] == shape[1]


class BranchesOnBatchOne(nn.Module):
    """Python that takes another path for a single row: the graph must keep the path its example took."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return y * 2 if x.shape[0] == 1 else y


def test_size_one_branch_is_guarded():
    converted = _converted(BranchesOnBatchOne(), torch.randn(1, 8), (1, 8))
    gm = rewrite(converted)
    x = torch.randn(1, 8)
    with torch.no_grad():
        assert torch.equal(gm(x), converted(x))
    with pytest.raises(AssertionError, match="Guard failed"):  # not the batch-1 path run silently on 3 rows
        gm(torch.randn(3, 8))


def test_one_token_example_of_a_transformers_sdpa_model_gives_a_decode_graph():
    """transformers' SDPA attention computes ``is_causal = q_length > 1 and …`` and passes it to
    scaled_dot_product_attention, whose argument parser refuses the SymBool a size-1 sequence kept symbolic gives.
    rewrite() captures such a model again with the size-1 dimensions fixed (a decode graph) and says so."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=100, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 100, (2, 8))
    prepared = dq.prepare(model, example_kwargs={"input_ids": ids})
    dq.calibrate(prepared, [{"input_ids": ids}], progress=False)
    converted = dq.convert(prepared)
    one = ids[:1, :1]
    with pytest.warns(UserWarning, match="is_causal.*2 tokens or more"):
        gm = rewrite(converted, example_kwargs={"input_ids": one})
    with torch.no_grad():
        want = converted(input_ids=one).logits
    assert torch.equal(gm(input_ids=one).logits, want)
    with pytest.raises(Exception, match="size"):  # the graph's guard: one token only
        gm(input_ids=ids[:1, :2])
