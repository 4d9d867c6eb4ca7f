"""An intermediate of a would-be fused subgraph that the caller can still reach after the forward — returned
inside a dataclass, stored on the module, appended to a list argument or to a global — must hold real values,
not the empty placeholder a fused subgraph hands out for its inner steps."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from outside_models import D, lin
from outside_pipeline import REL_L2, rel_l2
from torch import nn

import dbr_quant as dq
from dbr_quant.quantize.weights import FP8Weight

SINK: list[torch.Tensor] = []


class KeepsFeatures(nn.Module):
    """a → relu → b, an MLP fusion unless relu's output is kept somewhere."""

    def __init__(self, where: str) -> None:
        super().__init__()
        self.a, self.b = lin(), lin()
        self.where = where

    def forward(self, x, feats: list | None = None):
        h = F.relu(self.a(x))
        if self.where == "attribute":
            self.saved = h
        elif self.where == "list_argument":
            feats.append(h)
        elif self.where == "global":
            SINK.append(h)
        return self.b(h)

    def kept(self, feats: list) -> torch.Tensor:
        return {"attribute": lambda: self.saved, "list_argument": lambda: feats[-1], "global": lambda: SINK[-1]}[
            self.where]()


@pytest.mark.parametrize("where", ["attribute", "list_argument", "global"])
def test_kept_intermediate_is_real(where):
    model, x = KeepsFeatures(where).eval(), torch.randn(4, D)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        prepared = dq.prepare(model, (x,), example_kwargs={"feats": []})
        with torch.no_grad():
            for _ in range(3):
                prepared(torch.randn(4, D), feats=[])
        converted = dq.convert(prepared)
    SINK.clear()
    with torch.no_grad():
        theirs, ours = [], []
        want, got = model(x, feats=theirs), converted(x, feats=ours)
        want_kept, got_kept = model.kept(theirs), converted.kept(ours)
    assert got_kept.shape == want_kept.shape, f"the kept intermediate is a {tuple(got_kept.shape)} placeholder"
    assert rel_l2(got_kept, want_kept) < REL_L2 and rel_l2(got, want) < REL_L2
    assert all(isinstance(m.weight, FP8Weight) for m in (converted.a, converted.b))
    fused = {r["fqn"]: r["fusion"] for r in dq.report(converted)}
    assert fused["b"] != "mlp", "b's input is kept by the model: it cannot be fused away"
