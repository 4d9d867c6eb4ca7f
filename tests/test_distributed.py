"""Data-parallel calibration over torch.distributed (gloo, 3 processes on this machine).

Each rank calibrates every third batch and converts; the scales must equal those of one process calibrating
all batches (bitwise for RunningMax and AmaxHistory, rtol 1e-5 for Percentile and MSE, within the spread of
the per-batch amaxes for MovingAverage), and be bitwise identical on all ranks. Failure cases (an op some
rank never saw, a rank with no batch at all, a rank with another model, calibrating after a sync) must raise
SyncError on every rank.

One spawn runs every scenario (process start-up dominates the time); each rank writes what it saw to a file
that the test compares with a single-process run.
"""

from __future__ import annotations

import itertools
import os
import traceback

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

import dbr_quant as dq
from dbr_quant.quantize.weights import fp8_weight_of
from dbr_quant.runtime.hessians import gptq_report

WORLD = 3
DIM = 16
OBSERVERS = {
    "running_max": dq.RunningMax(),
    "history_max": dq.AmaxHistory(history_len=4, algo="max"),
    "history_recent": dq.AmaxHistory(history_len=4, algo="most_recent"),
    "percentile": dq.Percentile(99.0),
    "mse": dq.MSE(num_candidates=8),
    "moving_average": dq.MovingAverage(momentum=0.2),
}


class Toy(nn.Module):
    """Linears, attention (quantized: activation × activation) and an op only long sequences reach."""

    def __init__(self, extra: bool = False) -> None:
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.fc1 = nn.Linear(DIM, 2 * DIM)
        self.fc2 = nn.Linear(2 * DIM, DIM)
        self.long = nn.Linear(DIM, DIM)
        self.extra = nn.Linear(DIM, DIM) if extra else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        h = x + F.scaled_dot_product_attention(q, k, v)
        if x.shape[1] >= 8:
            h = h + self.long(h)
        if self.extra is not None:
            h = self.extra(h)
        return self.fc2(F.relu(self.fc1(h)))


def _model(extra: bool = False) -> nn.Module:
    torch.manual_seed(0)
    return Toy(extra).eval()


def _batches(n: int = 8, seq: int = 9, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, seq, DIM, generator=g) * (0.5 + i) for i in range(n)]


def _qconfig(kind: str) -> dq.QConfig:
    return dq.QConfig(activation=dq.TensorQConfig(observer=OBSERVERS[kind]), quantize_attention=True)


def _prepared(kind: str, extra: bool = False) -> nn.Module:
    return dq.prepare(_model(extra), torch.randn(2, 9, DIM), _qconfig(kind))


def _scales(converted: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in converted.state_dict().items() if ".scale_" in k or k.startswith("scale_")}


def _shard(batches: list, rank: int, world: int) -> list:
    return batches[rank::world]


def _run_rank(rank: int, world: int, tmp: str) -> None:
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp}/rendezvous", rank=rank,
                                         world_size=world)
    out: dict = {}
    try:
        batches = _batches()
        probe = torch.randn(2, 9, DIM, generator=torch.Generator().manual_seed(7))
        for kind in OBSERVERS:
            p = dq.calibrate(_prepared(kind), _shard(batches, rank, world), progress=False)
            converted = dq.convert(p)  # merges across the ranks
            out[kind] = _scales(converted)
            out[kind + "/output"] = converted(probe)
        # sync_observers twice, then convert: the later ones find identical states and change nothing
        p = dq.calibrate(_prepared("percentile"), _shard(batches, rank, world), progress=False)
        dq.sync_observers(p)
        dq.sync_observers(p)
        out["synced_twice"] = _scales(dq.convert(p))
        # the last rank's batches are short: it never runs `long`
        short = [b[:, :4] for b in batches]
        mine = _shard(short if rank == world - 1 else batches, rank, world)
        p = dq.calibrate(_prepared("running_max"), mine, progress=False)
        out["missing_error"] = _error(lambda: dq.convert(p))
        dq.sync_observers(p, allow_missing=True)
        out["allow_missing"] = _scales(dq.convert(p))
        # the last rank got no batch at all (an uneven split): every op is missing there
        p = dq.calibrate(_prepared("running_max"), [] if rank == world - 1 else _shard(batches, rank, world),
                         progress=False)
        out["empty_rank_error"] = _error(lambda: dq.convert(p))
        dq.sync_observers(p, allow_missing=True)
        out["empty_rank_allow_missing"] = _scales(dq.convert(p))
        # rank 1 prepared a model with one more linear
        p = dq.calibrate(_prepared("running_max", extra=rank == 1), _shard(batches, rank, world), progress=False)
        out["layout_error"] = _error(lambda: dq.convert(p))
        # calibrating after a sync would count the synced batches once per rank
        p = dq.calibrate(_prepared("running_max"), _shard(batches, rank, world), progress=False)
        dq.sync_observers(p)
        dq.calibrate(p, [batches[rank] * 3], progress=False)
        out["resync_error"] = _error(lambda: dq.convert(p))
        # GPTQ rounding: the Hessians are summed across ranks, so every rank stores the same weights
        p = dq.calibrate(dq.prepare(_model(), torch.randn(2, 9, DIM), dq.QConfig(weight_rounding="gptq")),
                         _shard(batches, rank, world), progress=False)
        converted = dq.convert(p)
        out["gptq"] = {n: fp8_weight_of(m).qdata.view(torch.uint8).clone() for n, m in converted.named_modules()
                       if fp8_weight_of(m) is not None}
        out["gptq_tokens"] = {n: r.tokens for n, r in gptq_report(converted).items()}
        # sync=False: each rank keeps its own scales
        p = dq.calibrate(_prepared("running_max"), _shard(batches, rank, world), progress=False)
        out["unsynced"] = _scales(dq.convert(p, sync=False))
    except BaseException:
        out["crash"] = traceback.format_exc()
    finally:
        torch.save(out, os.path.join(tmp, f"rank{rank}.pt"))
        torch.distributed.destroy_process_group()


def _error(fn) -> str:
    try:
        fn()
    except dq.SyncError as e:
        return str(e)
    return "<no error>"


def _single(kind: str, batches: list) -> nn.Module:
    return dq.convert(dq.calibrate(_prepared(kind), batches, progress=False))


@pytest.fixture(scope="module")
def ranks(tmp_path_factory) -> list[dict]:
    tmp = str(tmp_path_factory.mktemp("dist"))
    mp.spawn(_run_rank, args=(WORLD, tmp), nprocs=WORLD, join=True)
    results = [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(WORLD)]
    for r, res in enumerate(results):
        assert "crash" not in res, f"rank {r} crashed:\n{res['crash']}"
    return results


def _round_robin(batches: list, world: int) -> list:
    shards = [_shard(batches, r, world) for r in range(world)]
    return [b for group in itertools.zip_longest(*shards) for b in group if b is not None]


def test_every_rank_gets_the_same_scales(ranks):
    for kind in OBSERVERS:
        for res in ranks[1:]:
            assert res[kind].keys() == ranks[0][kind].keys()
            for k in res[kind]:
                assert torch.equal(res[kind][k], ranks[0][kind][k]), (kind, k)
            assert torch.equal(res[kind + "/output"], ranks[0][kind + "/output"])


@pytest.mark.parametrize("kind", list(OBSERVERS))
def test_scales_equal_one_process_on_all_batches(ranks, kind):
    batches = _batches()
    single = _scales(_single(kind, _round_robin(batches, WORLD)))
    merged = ranks[0][kind]
    assert merged.keys() == single.keys() and len(single) == 7  # qkv; sdpa q, k, v; long; fc1; fc2
    if kind in ("running_max", "history_max", "history_recent"):
        for k in single:
            assert torch.equal(merged[k], single[k]), k
    elif kind in ("percentile", "mse"):
        for k in single:
            torch.testing.assert_close(merged[k], single[k], rtol=1e-5, atol=0)
    else:
        # EMA: both are convex combinations of per-batch amaxes → within their spread (scale = amax / 448)
        per_batch = [_scales(_single("running_max", [b])) for b in batches]
        for k in single:
            values = torch.stack([pb[k] for pb in per_batch])
            spread = values.max() - values.min()
            assert (merged[k] - single[k]).abs() <= spread * (1 + 1e-6), k
            assert values.min() * (1 - 1e-6) <= merged[k] <= values.max() * (1 + 1e-6), k


def test_data_parallel_is_not_one_rank_alone(ranks):
    """The merge matters: without it (sync=False) the ranks end with different scales."""
    differs = [any(not torch.equal(ranks[r]["unsynced"][k], ranks[0]["unsynced"][k]) for k in ranks[0]["unsynced"])
               for r in range(1, WORLD)]
    assert all(differs)
    assert ranks[0]["unsynced"] != ranks[0]["running_max"]


def test_sync_is_idempotent(ranks):
    single = _scales(_single("percentile", _round_robin(_batches(), WORLD)))
    for res in ranks:
        for k in single:
            torch.testing.assert_close(res["synced_twice"][k], single[k], rtol=1e-5, atol=0)


def test_op_missing_on_a_rank_is_an_error_on_every_rank(ranks):
    for res in ranks:
        msg = res["missing_error"]
        assert "saw no calibration batch on some ranks" in msg and "long" in msg and f"[{WORLD - 1}]" in msg, msg
        assert "allow_missing=True" in msg
    # allow_missing: `long` from the ranks that saw it, everything else from all ranks
    batches = _batches()
    shards = [_shard(batches, r, WORLD) for r in range(WORLD)]
    shards[-1] = [b[:, :4] for b in shards[-1]]
    single = _scales(_single("running_max", [b for g in itertools.zip_longest(*shards) for b in g if b is not None]))
    for res in ranks:
        assert res["allow_missing"].keys() == single.keys()
        for k in single:
            assert torch.equal(res["allow_missing"][k], single[k]), k


def test_rank_without_batches_is_an_error_on_every_rank(ranks):
    for res in ranks:
        msg = res["empty_rank_error"]
        assert "7 observed activation(s) saw no calibration batch on some ranks" in msg, msg
        assert f"no batch on rank(s) [{WORLD - 1}]" in msg, msg
    # allow_missing: the other ranks' batches (a running max: their order does not matter)
    batches = _batches()
    single = _scales(_single("running_max", [b for r in range(WORLD - 1) for b in _shard(batches, r, WORLD)]))
    for res in ranks:
        assert res["empty_rank_allow_missing"].keys() == single.keys()
        for k in single:
            assert torch.equal(res["empty_rank_allow_missing"][k], single[k]), k


def test_different_model_is_an_error_on_every_rank(ranks):
    for res in ranks:
        msg = res["layout_error"]
        assert "calibrated different models" in msg and "rank 1" in msg and "extra" in msg, msg


def test_calibrating_after_a_sync_is_an_error_on_every_rank(ranks):
    for res in ranks:
        assert "calibrated again after its observers were synced" in res["resync_error"], res["resync_error"]


def test_sync_without_torch_distributed_does_nothing():
    p = dq.calibrate(_prepared("running_max"), _batches(2), progress=False)
    before = {k: v.clone() for k, v in p.state_dict().items()}
    assert dq.sync_observers(p) is p
    assert all(torch.equal(before[k], v) for k, v in p.state_dict().items())


def test_gptq_hessians_are_summed_across_ranks(ranks):
    """Every rank rounds with the Hessians of all ranks' batches: the same FP8 bytes everywhere, and each
    linear's token count is that of all batches (8 batches of 2×9 tokens)."""
    first = ranks[0]["gptq"]
    assert first.keys() == {"qkv", "fc1", "fc2", "long"}
    for r in ranks[1:]:
        assert all(torch.equal(first[n], r["gptq"][n]) for n in first)
    assert all(r["gptq_tokens"] == dict.fromkeys(first, 8 * 2 * 9) for r in ranks)


@pytest.mark.parametrize("kind", list(OBSERVERS))
def test_calibration_state_does_not_grow_with_batches(kind):
    """A prepared model's tensors after 2 batches are as many bytes as after 12: what a rank holds, and what
    sync_observers sends, does not depend on how many batches it calibrated (per-observer sizes:
    tests/observers/test_observer_merge.py::test_state_is_fixed_size)."""
    def state_bytes(p: nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in p.state_dict().values())

    g = torch.Generator().manual_seed(3)
    p = dq.calibrate(_prepared(kind), [torch.randn(2, 9, DIM, generator=g) for _ in range(2)], progress=False)
    before = state_bytes(p)
    dq.calibrate(p, [torch.randn(2, 9, DIM, generator=g) for _ in range(10)], progress=False)
    assert state_bytes(p) == before > 0
