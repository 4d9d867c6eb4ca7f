"""``QConfig(weight_rounding="gptq")`` through prepare → calibrate → convert: the stored FP8 weights are what
``gptq_quantize`` gives on Hessians collected independently (forward hooks), on the same grid and layout as
nearest rounding, deterministic, and the converted model saves, loads and rewrites like any other."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from rounding_helpers import correlated_inputs, mixing_matrix
from torch import nn

import dbr_quant as dq
from dbr_quant.fx_rewriter import rewrite
from dbr_quant.quantize.rounding import HessianAccumulator, gptq_quantize
from dbr_quant.quantize.weights import fp8_weight_of
from dbr_quant.runtime.hessians import gptq_report

D = 32


class Block(nn.Module):
    """Attention-free transformer-ish block: fc2 is called twice per forward (a shared weight)."""

    def __init__(self) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(D)
        self.fc1, self.fc2, self.out = nn.Linear(D, 2 * D), nn.Linear(2 * D, 2 * D), nn.Linear(2 * D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.gelu(self.fc1(self.ln(x)))
        h = self.fc2(F.gelu(self.fc2(h)))
        return x + self.out(h)


def _batches(seed: int, n: int = 4, tokens: int = 24) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    mix = mixing_matrix(D, g)
    return [correlated_inputs(tokens, D, g, mix).reshape(2, tokens // 2, D) for _ in range(n)]


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return Block().eval()


def _convert(model: nn.Module, qconfig: dq.QConfig, batches: list[torch.Tensor], inplace: bool = False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = dq.prepare(model, batches[0], qconfig)
        dq.calibrate(p, batches, progress=False)
        return dq.convert(p, inplace=inplace)


def _weights(model: nn.Module) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    return {n: (fp8_weight_of(m).qdata, fp8_weight_of(m).scale) for n, m in model.named_modules()
            if fp8_weight_of(m) is not None}


def _hooked_hessians(model: nn.Module, batches: list[torch.Tensor], folds: int = 2) -> dict[str, HessianAccumulator]:
    """Independent collection: forward pre-hooks on the fp32 model, every call of batch i into fold i % folds."""
    accs: dict[str, HessianAccumulator] = {}
    batch = [0]

    def hook(name):
        def pre(_m, args):
            accs.setdefault(name, HessianAccumulator(args[0].shape[-1], folds)).add(args[0], fold=batch[0] % folds)
        return pre

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    with torch.no_grad():
        for i, x in enumerate(batches):
            batch[0] = i
            model(x)
    for h in handles:
        h.remove()
    return accs


@pytest.mark.parametrize("granularity", ["channel", "tensor"])
@pytest.mark.parametrize("act_order", [False, True])
def test_stored_weights_are_gptq_of_the_calibration_hessians(granularity, act_order):
    model, batches = _model(), _batches(0)
    weight = dq.TensorQConfig(granularity=granularity)
    options = dq.GPTQOptions(act_order=act_order, block_size=16)
    gptq = _weights(_convert(model, dq.QConfig(weight=weight, weight_rounding="gptq", gptq=options), batches))
    nearest = _weights(_convert(model, dq.QConfig(weight=weight), batches))
    accs = _hooked_hessians(model, batches)
    assert gptq.keys() == nearest.keys() == {"fc1", "fc2", "out"}
    changed = 0
    for name, (q, scale) in gptq.items():
        q_near, s_near = nearest[name]
        # same layout as nearest: dtype, shape, and the very same scales
        assert q.dtype == q_near.dtype == torch.float8_e4m3fn and q.shape == q_near.shape and q.is_contiguous()
        assert scale.shape == s_near.shape and torch.equal(scale, s_near)
        # on the FP8 grid: every stored value is its own re-quantization
        assert torch.equal(q.float().to(torch.float8_e4m3fn).view(torch.uint8), q.view(torch.uint8))
        w = getattr(model, name).weight.detach()
        want = gptq_quantize(w, accs[name], "e4m3", granularity, scale=scale, block_size=16, act_order=act_order)
        assert torch.equal(q.view(torch.uint8), want.qdata.view(torch.uint8)), name
        changed += int((q.view(torch.uint8) != q_near.view(torch.uint8)).sum())
    assert changed > 0  # GPTQ moved some weights off their nearest grid point


def test_a_linear_called_twice_per_forward_adds_both_calls_to_that_forwards_fold():
    model, batches = _model(), _batches(1, n=3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = dq.prepare(model, batches[0], dq.QConfig(weight_rounding="gptq"))
        dq.calibrate(p, batches, progress=False)
    accs = p.__dict__["_dbr_record"].hessians.accumulators
    tokens = batches[0].shape[0] * batches[0].shape[1]
    assert accs["fc1"].tokens.tolist() == [2 * tokens, tokens]
    assert accs["fc2"].tokens.tolist() == [4 * tokens, 2 * tokens]  # two calls per forward, folds by forward
    assert accs["fc2"].nbytes == 2 * (2 * D) ** 2 * 8  # folds · K² · 8 bytes


def test_deterministic_and_inplace_equal():
    model, batches = _model(), _batches(2)
    qconfig = dq.QConfig(weight_rounding="gptq")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = dq.prepare(model, batches[0], qconfig)
        dq.calibrate(p, batches, progress=False)
        a, b = dq.convert(p), dq.convert(p)  # convert copies: the prepared model keeps its Hessians
        c = dq.convert(p, inplace=True)
    for other in (b, c):
        for name, (q, s) in _weights(a).items():
            q2, s2 = _weights(other)[name]
            assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(s, s2)
    report = gptq_report(c)
    assert report.keys() == {"fc1", "fc2", "out"} and all(r.damping.cross_validated for r in report.values())
    assert not p.__dict__["_dbr_record"].hessians.accumulators  # inplace convert freed every accumulator


def test_nearest_keeps_no_hessians_and_override_picks_the_gptq_linears():
    model, batches = _model(), _batches(3)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = dq.prepare(model, batches[0])
    assert p.__dict__["_dbr_record"].hessians is None
    qconfig = dq.QConfig(overrides=(dq.Override(pattern="^fc2$", weight_rounding="gptq"),))
    c = _convert(model, qconfig, batches)
    assert gptq_report(c).keys() == {"fc2"}
    nearest = _weights(_convert(model, dq.QConfig(), batches))
    for name in ("fc1", "out"):
        assert torch.equal(_weights(c)[name][0].view(torch.uint8), nearest[name][0].view(torch.uint8))


def test_module_by_module_passes_merge_into_the_one_pass_model():
    """Where all Hessians do not fit at once (runtime/hessians.py): one calibrate/convert pass per group of
    linears, GPTQ only for that group; calibration runs in fp32, so each group's bytes and every scale equal
    the single pass's, and the passes' state_dicts merge into the one-pass model."""
    model, batches = _model(), _batches(6)
    one_pass = _convert(model, dq.QConfig(weight_rounding="gptq"), batches)
    target = _convert(model, dq.QConfig(), batches)  # nearest everywhere until the passes' weights load
    merged = dict(target.state_dict())
    for name in ("fc1", "fc2", "out"):
        c = _convert(model, dq.QConfig(overrides=(dq.Override(pattern=f"^{name}$", weight_rounding="gptq"),)),
                     batches)
        assert gptq_report(c).keys() == {name}
        merged[f"{name}.weight"] = c.state_dict()[f"{name}.weight"]
        for other, (q, s) in _weights(one_pass).items():
            assert torch.equal(s, _weights(c)[other][1])
            if other == name:
                assert torch.equal(q.view(torch.uint8), _weights(c)[name][0].view(torch.uint8))
    with torch.no_grad():
        assert not torch.equal(target(torch.ones(1, 2, D)), one_pass(torch.ones(1, 2, D)))
    target.load_state_dict(merged)
    x = torch.randn(3, 7, D)
    with torch.no_grad():
        assert torch.equal(target(x), one_pass(x))


def test_errors_name_what_to_do():
    with pytest.raises(ValueError, match="granularity 'block'"):
        dq.QConfig.fp8_block(weight_rounding="gptq")
    with pytest.raises(ValueError, match=r"Override\(pattern='\^fc1\$'.*'block'"):
        dq.QConfig(weight_rounding="gptq", dynamic=True, overrides=(
            dq.Override(pattern="^fc1$", weight=dq.TensorQConfig(granularity="block")),))
    # block weights for one module stay possible when that module keeps nearest rounding
    dq.QConfig(weight_rounding="gptq", dynamic=True, overrides=(
        dq.Override(pattern="^fc1$", weight=dq.TensorQConfig(granularity="block"), weight_rounding="nearest"),))
    with pytest.raises(ValueError, match="weight_rounding must be"):
        dq.QConfig(weight_rounding="gtpq")
    with pytest.raises(ValueError, match="folds"):
        dq.GPTQOptions(folds=1)
    model, batches = _model(), _batches(4)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        p = dq.prepare(model, batches[0], dq.QConfig(weight_rounding="gptq", dynamic=True))
    with pytest.raises(ValueError, match="'fc1' \\(Linear\\).*no calibration batches.*calibrate"):
        dq.convert(p)


class Branchy(nn.Module):
    """``long`` runs only on sequences of 8 tokens or more."""

    def __init__(self) -> None:
        super().__init__()
        self.fc, self.long = nn.Linear(D, D), nn.Linear(D, D)

    def forward(self, x):
        h = self.fc(x)
        return h + self.long(h) if x.shape[1] >= 8 else h


def test_a_linear_no_calibration_batch_reached_is_rounded_to_nearest_with_a_warning():
    torch.manual_seed(0)
    model, g = Branchy().eval(), torch.Generator().manual_seed(0)
    qconfig = dq.QConfig(weight_rounding="gptq", dynamic=True)
    p = dq.prepare(model, torch.randn(2, 9, D, generator=g), qconfig)  # the trace takes the branch
    dq.calibrate(p, [torch.randn(2, 4, D, generator=g) for _ in range(4)], progress=False)  # calibration does not
    with pytest.warns(UserWarning, match="no calibration batch reached 'long'.*rounded to nearest"):
        c = dq.convert(p)
    nearest = dq.convert(dq.prepare(model, torch.randn(2, 9, D, generator=g), dq.QConfig(dynamic=True)))
    got, want = fp8_weight_of(c.long).qdata, fp8_weight_of(nearest.long).qdata
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    report = gptq_report(c)
    assert report["long"].tokens == 0 and report["fc"].tokens == 4 * 2 * 4 and report["fc"].damping.cross_validated


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**16), n=st.integers(8, 48), k=st.integers(16, 48), per_tensor=st.booleans())
def test_gptq_layer_output_error_is_below_nearest_on_new_inputs(seed, n, k, per_tensor):
    """One random linear, correlated inputs: on fresh tokens from the calibration distribution, the output
    error of the stored GPTQ weight is at most 90 % of nearest rounding's."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g))
    mix = mixing_matrix(k, g)
    batches = [correlated_inputs(40 * k, k, g, mix) for _ in range(4)]
    weight = dq.TensorQConfig(granularity="tensor" if per_tensor else "channel")
    errors = {}
    fresh = correlated_inputs(4000, k, g, mix)
    for rounding in ("nearest", "gptq"):
        c = _convert(nn.Sequential(lin), dq.QConfig(weight=weight, weight_rounding=rounding, dynamic=True), batches)
        fw = fp8_weight_of(c[0])
        deq = fw.qdata.float() * (fw.scale[:, None] if fw.scale.dim() else fw.scale)
        errors[rounding] = float(((fresh @ (lin.weight.detach() - deq).T) ** 2).sum())
    assert errors["gptq"] < 0.9 * errors["nearest"], errors


@pytest.mark.parametrize("seed", [0, 1])
def test_scarce_calibration_gets_a_larger_damping(seed):
    """Through calibrate/convert: 4 batches of 6 tokens for 64 inputs (rank-deficient folds) vs 4 of 1000."""
    g = torch.Generator().manual_seed(seed)
    lin = nn.Linear(64, 16, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(16, 64, generator=g))
    mix = mixing_matrix(64, g)
    chosen = {}
    for tokens in (6, 1000):
        batches = [correlated_inputs(tokens, 64, g, mix) for _ in range(4)]
        c = _convert(nn.Sequential(lin), dq.QConfig(weight_rounding="gptq", dynamic=True), batches)
        chosen[tokens] = gptq_report(c)["0"].damping.damping
    assert chosen[6] > chosen[1000], chosen


def test_save_load_and_rewrite_like_any_other(tmp_path):
    model, batches = _model(), _batches(5)
    c = _convert(model, dq.QConfig(weight_rounding="gptq"), batches)
    dq.save_pretrained(c, tmp_path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loaded = dq.load_pretrained(tmp_path, _model())
    want, got = _weights(c), _weights(loaded)
    assert want.keys() == got.keys()
    for name, (q, s) in want.items():
        assert torch.equal(q.view(torch.uint8), got[name][0].view(torch.uint8)) and torch.equal(s, got[name][1])
    x = torch.randn(3, 7, D)
    with torch.no_grad():
        assert torch.equal(c(x), loaded(x))
        gm = rewrite(c)
        assert torch.equal(gm(x), c(x))


def test_offloaded_model_gets_the_same_gptq_weights(tmp_path):
    """accelerate disk offload: convert(inplace=True) reads each weight from its offload home; the Hessians come
    from calibration as usual, so the FP8 bytes equal the in-memory model's."""
    accelerate = pytest.importorskip("accelerate")
    from transformers import LlamaConfig, LlamaForCausalLM

    def llama():
        torch.manual_seed(0)
        return LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                            num_key_value_heads=1, intermediate_size=64, pad_token_id=0,
                                            use_cache=False)).eval()

    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(1, 128, (2, 12), generator=g)} for _ in range(3)]
    qconfig = dq.QConfig(weight_rounding="gptq", overrides=(dq.Override(pattern="^lm_head$", skip=True),))

    def quantize(model):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            p = dq.prepare(model, example_kwargs=batches[0], qconfig=qconfig, inplace=True)
            dq.calibrate(p, batches, progress=False)
            return dq.convert(p, inplace=True)

    def fp8_bytes(model):
        out = {}
        for name, m in model.named_modules():
            hook = getattr(m, "_hf_hook", None)
            w = hook.weights_map["weight"] if hook is not None and fp8_weight_of(m) is not None \
                and fp8_weight_of(m).qdata.is_meta else fp8_weight_of(m)
            if w is not None:
                out[name] = w.qdata.view(torch.uint8)
        return out

    in_memory = fp8_bytes(quantize(llama()))
    offloaded = quantize(accelerate.disk_offload(llama(), str(tmp_path), execution_device="cpu"))
    assert gptq_report(offloaded).keys() == in_memory.keys() and len(in_memory) == 7
    assert all(fp8_weight_of(m).qdata.is_meta for m in offloaded.modules() if fp8_weight_of(m) is not None)
    got = fp8_bytes(offloaded)
    assert got.keys() == in_memory.keys() and all(torch.equal(got[n], in_memory[n]) for n in got)
