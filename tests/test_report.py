"""``report()`` and the "stay high precision" warnings account for every weight (parameter of 2+ dims): a row
per weight that stays high precision with its true reason, and counts / MiB computed here from the model's own
parameters, independently of dbr_quant."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dbr_quant as dq
from dbr_quant.quantize.weights import FP8Weight


class Block(nn.Module):
    def __init__(self, c: int) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.relu(self.bn1(self.conv1(x)))
        return F.relu(x + self.bn2(self.conv2(y)))


class ResNet(nn.Module):
    """Hand-written: 5 convs hold ~98 % of the weights, one fc."""

    def __init__(self, c: int = 48, classes: int = 10) -> None:
        super().__init__()
        self.stem, self.bn = nn.Conv2d(3, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
        self.layer1, self.layer2 = Block(c), Block(c)
        self.fc = nn.Linear(c, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.relu(self.bn(self.stem(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(F.adaptive_avg_pool2d(x, 1).flatten(1))


def _run(model: nn.Module, example: tuple, batches: list, qconfig: dq.QConfig | None = None):
    """prepare → calibrate → convert, with dbr_quant's warnings of each step."""
    with warnings.catch_warnings(record=True) as at_prepare:
        warnings.simplefilter("always")
        prepared = dq.prepare(model, example, qconfig)
    dq.calibrate(prepared, batches, progress=False)
    with warnings.catch_warnings(record=True) as at_convert:
        warnings.simplefilter("always")
        converted = dq.convert(prepared)

    def ours(caught):
        return [str(w.message) for w in caught if str(w.message).startswith("dbr_quant")]
    return converted, ours(at_prepare), ours(at_convert)


def _weights(model: nn.Module) -> dict[int, tuple[str, nn.Parameter]]:
    return {id(p): (n, p) for n, p in model.named_parameters() if p.dim() >= 2}


def _mib(params) -> str:
    return f"{sum(p.numel() * p.element_size() for p in params) / 2**20:.2f} MiB"


def _assert_rows_cover_every_weight(converted: nn.Module, rows: list[dict]) -> None:
    """Every parameter of 2+ dims is the weight of a row; FP8 rows' weights are stored in FP8, the others not."""
    fp8 = {id(converted.get_parameter(r["weight"])) for r in rows if r["fp8"] and r["weight"]}
    high = {id(converted.get_parameter(r["weight"])) for r in rows if not r["fp8"] and r["weight"]}
    weights = _weights(converted)
    missing = [n for i, (n, _) in weights.items() if i not in fp8 | high]
    assert not missing, f"weights without a report row: {missing}\n{dq.format_report(rows)}"
    assert all(type(weights[i][1]) is FP8Weight for i in fp8)
    assert all(type(weights[i][1]) is not FP8Weight for i in high - fp8)


def test_resnet_convs_get_rows_and_count_in_both_warnings():
    torch.manual_seed(0)
    model = ResNet().eval()
    x = torch.randn(2, 3, 8, 8)
    converted, at_prepare, at_convert = _run(model, (x,), [torch.randn(4, 3, 8, 8)])
    convs = [(n, m) for n, m in model.named_modules() if isinstance(m, nn.Conv2d)]
    assert len(convs) == 5
    share = sum(m.weight.numel() for _, m in convs) / sum(p.numel() for p in model.parameters() if p.dim() >= 2)
    assert share > 0.97
    expected = f"5 weight(s) stay high precision ({_mib(m.weight for _, m in convs)}, {share:.0%} of"
    for fn, caught in (("prepare", at_prepare), ("convert", at_convert)):
        assert len(caught) == 1 and caught[0].startswith(f"dbr_quant.{fn}(): {expected}"), caught
        assert "stem: Conv2d: no FP8 convolution kernel" in caught[0]
    rows = dq.report(converted)
    by_fqn = {r["fqn"]: r for r in rows}
    for name, _ in convs:
        assert not by_fqn[name]["fp8"] and by_fqn[name]["reason"] == "Conv2d: no FP8 convolution kernel in this release"
    assert by_fqn["fc"]["fp8"]
    table = dq.format_report(rows)
    assert all(re.search(rf"^{re.escape(name)}\s+weight\s+high\b", table, re.M) for name, _ in convs), table
    _assert_rows_cover_every_weight(converted, rows)


class Tagger(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(50, 32)
        self.bag = nn.EmbeddingBag(20, 32, mode="mean")
        self.head = nn.Linear(32, 5)

    def forward(self, ids: torch.Tensor, tags: torch.Tensor) -> torch.Tensor:
        return self.head(self.tok(ids) + self.bag(tags)[:, None])


def test_embeddings_are_listed_but_do_not_warn_alone():
    torch.manual_seed(0)
    ids, tags = torch.randint(0, 50, (2, 6)), torch.randint(0, 20, (2, 3))
    converted, at_prepare, at_convert = _run(Tagger().eval(), (ids, tags), [(ids, tags)])
    assert at_prepare == at_convert == []  # lookup tables stay high precision by design
    rows = {r["fqn"]: r for r in dq.report(converted)}
    assert rows["tok"]["reason"] == "Embedding: a lookup table, stays high precision (as serving engines keep it)"
    assert rows["bag"]["reason"].startswith("EmbeddingBag: a lookup table") and not rows["bag"]["fp8"]
    assert rows["head"]["fp8"]
    _assert_rows_cover_every_weight(converted, dq.report(converted))


class Bare(nn.Module):
    """Weights outside nn.Linear: a position table added, a LoRA written as matmuls, torch's MHA, a table
    never used."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(50, 32)
        self.pos = nn.Parameter(torch.randn(1, 6, 32))
        self.lora_a, self.lora_b = nn.Parameter(torch.randn(4, 32) * 0.1), nn.Parameter(torch.randn(32, 4) * 0.1)
        self.mha = nn.MultiheadAttention(32, 4, batch_first=True)
        self.unused = nn.Parameter(torch.randn(8, 8))
        self.head = nn.Linear(32, 5)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.tok(ids) + self.pos
        x = x + x @ self.lora_a.t() @ self.lora_b.t()
        return self.head(self.mha(x, x, x, need_weights=False)[0])


def test_bare_parameters_get_rows_and_count():
    torch.manual_seed(0)
    ids = torch.randint(0, 50, (2, 6))
    model = Bare().eval()
    converted, at_prepare, at_convert = _run(model, (ids,), [ids])
    rows = dq.report(converted)
    _assert_rows_cover_every_weight(converted, rows)
    reasons = {r["weight"]: r["reason"] for r in rows if not r["fp8"] and r["weight"]}
    assert reasons["unused"].startswith("never used during prepare()'s trace")
    assert reasons["pos"].startswith("read by add: no FP8 kernel")
    high = [p for n, p in model.named_parameters() if p.dim() >= 2 and f"{n}" in reasons]
    # torch's MHA projections and the LoRA matmuls are linears on parameters: stored in FP8 (issue #20 point 2)
    fp8 = {"head.weight", "mha.in_proj_weight", "mha.out_proj.weight", "lora_a", "lora_b"}
    assert {n for n, p in model.named_parameters() if p.dim() >= 2} - set(reasons) == fp8
    assert all(type(converted.get_parameter(n)) is FP8Weight for n in fp8)
    for caught in (at_prepare, at_convert):
        assert len(caught) == 1 and f"{len(high)} weight(s) stay high precision ({_mib(high)}" in caught[0], caught
    # whatever runs the attention (the tracer may learn to quantize it), no weight is "never called" while used
    for name in ("mha.in_proj_weight", "mha.out_proj.weight", "lora_a", "lora_b"):
        assert "never" not in reasons.get(name, ""), (name, reasons.get(name))


def test_a_skip_override_is_named_and_counted():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    x = torch.randn(4, 64)
    override = dq.Override(pattern=r"^0$", skip=True)
    converted, at_prepare, at_convert = _run(model, (x,), [x], dq.QConfig(overrides=(override,)))
    rows = {r["fqn"]: r for r in dq.report(converted)}
    assert not rows["0"]["fp8"] and rows["0"]["reason"] == "skipped by Override(pattern='^0$', skip=True)"
    for caught in (at_prepare, at_convert):
        assert len(caught) == 1 and f"1 weight(s) stay high precision ({_mib([model[0].weight])}" in caught[0]
        assert "0: skipped by Override(pattern='^0$', skip=True)" in caught[0]
    _assert_rows_cover_every_weight(converted, list(rows.values()))


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
def test_everything_fp8_has_no_high_precision_row(granularity):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 4)).eval()
    x = torch.randn(3, 16)
    converted, at_prepare, at_convert = _run(model, (x,), [x], dq.QConfig(
        weight=dq.TensorQConfig(granularity=granularity)))
    assert at_prepare == at_convert == []
    rows = dq.report(converted)
    assert all(r["fp8"] for r in rows if r["weight"]) and {r["weight"] for r in rows} == {"0.weight", "2.weight"}
