"""The converted model in the field: many threads, `module.weight`, dtype and device moves, reports."""

from __future__ import annotations

import copy
import threading
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import dbr_quant as dq
from dbr_quant.kernels.reference import dense as R
from dbr_quant.quantize.weights import FP8Weight, fp8_weight_bytes, fp8_weight_of


class Block(nn.Module):
    """LayerNorm → MLP (a fused subgraph), attention through matmuls, a gated MLP, a hooked linear."""

    def __init__(self, d: int = 16) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.q, self.k, self.v = nn.Linear(d, d), nn.Linear(d, d), nn.Linear(d, d)
        self.gate, self.up, self.down = nn.Linear(d, 2 * d, bias=False), nn.Linear(d, 2 * d, bias=False), \
            nn.Linear(2 * d, d, bias=False)
        self.hooked = nn.Linear(d, d)
        self.seen: dict[int, tuple] = {}  # thread id → shape of the output the hook saw
        self.hooked.register_forward_hook(self._hook)

    def _hook(self, module, inputs, output):
        self.seen[threading.get_ident()] = tuple(output.shape)
        return output * 0.5

    def forward(self, x):
        x = x + self.fc2(F.gelu(self.fc1(self.norm(x))))
        a = torch.softmax(self.q(x) @ self.k(x).transpose(-1, -2) / 4, -1) @ self.v(x)
        x = x + a + self.down(F.silu(self.gate(x)) * self.up(x))
        return self.hooked(x)


def _converted(seed: int = 0, **qc):
    torch.manual_seed(seed)
    m = Block().eval()
    x = torch.randn(2, 5, 16)
    p = dq.prepare(m, (x,), dq.QConfig(**qc))
    dq.calibrate(p, [torch.randn(2, 5, 16) for _ in range(3)], progress=False)
    return m, dq.convert(p)


def _inputs(n: int, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1 + i % 4, 1 + (i * 7) % 9, 16, generator=g) for i in range(n)]


def _in_threads(fn, items, threads: int = 8, passes: int = 1) -> list:
    """Run fn over items from ``threads`` threads at once (each thread takes every item, in its own order)."""
    results = [[None] * len(items) for _ in range(threads)]
    errors = []
    start = threading.Barrier(threads)

    def work(t):
        try:
            start.wait()
            for p in range(passes):
                order = list(range(len(items)))[t + p:] + list(range(len(items)))[:t + p]
                for i in order:
                    results[t][i] = fn(items[i])
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    ts = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors, errors
    return results


@pytest.mark.parametrize("dynamic", [False, True])
def test_many_threads_get_exactly_the_single_threaded_outputs(dynamic):
    _, c = _converted(dynamic=dynamic)
    xs = _inputs(24)
    with torch.no_grad():
        want = [c(x) for x in xs]
        with dq.disabled():
            want_hp = [c(x) for x in xs]

    def both(x):  # converted and disabled() forwards of the same model interleave across threads
        fp8 = c(x)
        with dq.disabled():
            return fp8, c(x)

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no "control flow changed" warning may appear
        with torch.no_grad():
            got = _in_threads(both, xs, threads=8, passes=2)  # 8 threads × 2 passes × 24 inputs × 2 forwards
    for per_thread in got:
        for (fp8, hp), w, w_hp in zip(per_thread, want, want_hp):
            assert torch.equal(fp8, w) and torch.equal(hp, w_hp)


def test_hooks_run_in_every_thread_without_patching_the_module():
    _, c = _converted()
    with torch.no_grad():
        got = _in_threads(lambda x: (c(x), c.seen[threading.get_ident()]), _inputs(12), threads=4, passes=2)
    for per_thread in got:
        for out, shape in per_thread:
            assert tuple(out.shape) == shape  # each thread's hook saw its own output
    assert "forward" not in c.hooked.__dict__


def test_concurrent_calibration_equals_sequential_calibration():
    torch.manual_seed(0)
    m = Block().eval()
    batches = [torch.randn(2, 5, 16) * (1 + i) for i in range(16)]
    seq = dq.prepare(m, (batches[0],))
    dq.calibrate(seq, batches, progress=False)
    par = dq.prepare(m, (batches[0],))
    with torch.no_grad():
        _in_threads(lambda x: par(x), batches, threads=4)
    a, b = dq.convert(seq), dq.convert(par)
    for (name, s1), (_, s2) in zip(dq.quant_state(a).named_buffers(), dq.quant_state(b).named_buffers()):
        if name.startswith("scale_"):  # running max: order does not matter, races would lose updates
            assert torch.equal(s1, s2), name


def test_fp8_weight_is_module_weight_with_original_dtype_shape_device():
    m, c = _converted()
    for name in ("fc1", "q", "gate", "up", "hooked"):
        w = getattr(c, name).weight
        orig = getattr(m, name).weight
        assert isinstance(w, FP8Weight) and isinstance(w, nn.Parameter) and not w.requires_grad
        assert w.dtype == torch.float32 and w.shape == orig.shape and w.device == orig.device
        assert w.qdata.dtype == torch.float8_e4m3fn and w.qdata.shape == orig.shape
        deq = R.dequantize(w.qdata, w.scale[:, None], torch.float32)
        assert torch.equal(w.float(), deq) and torch.equal(w.dequantize(), deq)
        x = torch.randn(3, orig.shape[1])
        assert torch.equal(F.linear(x, w), F.linear(x, deq))  # used as a tensor: the dequantized values
        assert (deq - orig).abs().max() <= orig.abs().max() / 8
    want = sum(p.numel() + p.shape[0] * 4 for n, p in m.named_parameters() if n.endswith("weight") and p.dim() == 2)
    assert fp8_weight_bytes(c) == want  # one FP8 byte per weight + an fp32 scale per output channel, nothing else
    sd = c.state_dict()
    assert sd["fc1.weight"].dtype == torch.float8_e4m3fn and sd["fc1.weight_scale"].shape == (64,)
    assert sd["gate.weight"].shape == (32, 16) and sd["up.weight"].shape == (32, 16)  # own rows of the stack


@pytest.mark.parametrize("move", ["half", "bfloat16", "to_bf16", "float", "cpu", "to_cpu", "to_device_dtype"])
def test_dtype_and_device_moves_keep_fp8_bytes_and_scales(move):
    _, c = _converted()
    before = {n: (w.qdata.clone(), w.scale.clone()) for n, mod in c.named_modules()
              if (w := fp8_weight_of(mod)) is not None}
    act_scales = {n: b.clone() for n, b in dq.quant_state(c).named_buffers() if n.startswith("scale_")}
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        ref = c(x)
    target = {"half": torch.float16, "bfloat16": torch.bfloat16, "to_bf16": torch.bfloat16,
              "to_device_dtype": torch.bfloat16}.get(move, torch.float32)
    moved = {"half": lambda: c.half(), "bfloat16": lambda: c.bfloat16(), "to_bf16": lambda: c.to(torch.bfloat16),
             "float": lambda: c.float(), "cpu": lambda: c.cpu(), "to_cpu": lambda: c.to("cpu"),
             "to_device_dtype": lambda: c.to("cpu", torch.bfloat16)}[move]()
    assert moved is c
    for n, (q, s) in before.items():
        w = fp8_weight_of(c.get_submodule(n))
        assert w is not None and w.dtype == target, n
        assert w.qdata.dtype == torch.float8_e4m3fn and torch.equal(w.qdata.view(torch.uint8), q.view(torch.uint8))
        assert w.scale.dtype == torch.float32 and torch.equal(w.scale, s), n
    for n, s in dq.quant_state(c).named_buffers():
        if n in act_scales:
            assert s.dtype == torch.float32 and torch.equal(s, act_scales[n]), n
    with torch.no_grad():
        out = c(x.to(target))
    assert out.dtype == target
    cos = F.cosine_similarity(out.float().flatten(), ref.flatten(), 0)
    assert cos > (0.999 if target == torch.float32 else 0.99), cos


def test_deepcopy_keeps_stacked_gate_up_sharing_and_outputs():
    _, c = _converted()
    c2 = copy.deepcopy(c)
    g, u = c2.gate.weight.qdata, c2.up.weight.qdata
    assert g.untyped_storage().data_ptr() == u.untyped_storage().data_ptr()
    x = torch.randn(2, 5, 16)
    with torch.no_grad():
        assert torch.equal(c(x), c2(x))


def test_report_and_warnings_name_every_linear_left_high_precision():
    class WithBranch(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.head = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)

        def forward(self, x, use_b: bool = False):
            return self.head(self.b(x) if use_b else self.a(x))

    m = WithBranch()
    x = torch.randn(2, 8)
    with pytest.warns(UserWarning, match=r"prepare\(\): 1 weight\(s\) stay high precision.*\bb: never called"):
        p = dq.prepare(m, (x,))
    dq.calibrate(p, [x], progress=False)
    with pytest.warns(UserWarning, match=r"convert\(\): 1 weight\(s\) stay high precision \(0\.00 MiB"):
        c = dq.convert(p)
    rows = {r["fqn"]: r for r in dq.report(c)}
    assert set(rows) == {"a", "b", "head"}
    assert rows["a"]["fp8"] and rows["head"]["fp8"] and not rows["b"]["fp8"]
    assert "never called" in rows["b"]["reason"]
    assert fp8_weight_of(c.b) is None and fp8_weight_of(c.a) is not None


def test_everything_fp8_warns_nothing():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    x = torch.randn(2, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        p = dq.prepare(m, (x,))
        dq.calibrate(p, [x], progress=False)
        dq.convert(p)


class _Scaled(nn.Module):
    """fc2 reads 10 × its input, written in the model's code (the reference for the hooked version);
    ``functional`` adds an ``F.linear`` call, so calibration must route torch functions to the run."""

    def __init__(self, in_code: bool, functional: bool) -> None:
        super().__init__()
        self.fc1, self.fc2, self.in_code = nn.Linear(8, 16), nn.Linear(16, 4), in_code
        self.w = nn.Parameter(torch.randn(16, 16) / 4) if functional else None

    def forward(self, x):
        h = torch.tanh(self.fc1(x))
        if self.w is not None:
            h = torch.tanh(F.linear(h, self.w))
        return self.fc2(h * 10 if self.in_code else h)


@pytest.mark.parametrize("functions", [True, False], ids=["functions-routed", "module-calls-only"])
def test_calibration_observes_a_linear_input_after_its_pre_hooks(functions):
    """A forward pre-hook that changes a linear's input: calibration must observe what the FP8 linear will
    quantize (the input after the hook), as convert runs it. Both calibration modes: with torch functions
    routed to the run (the model calls F.linear), and module calls only (every quantized op a module)."""
    torch.manual_seed(0)
    hooked, plain = _Scaled(False, functions), _Scaled(True, functions)
    plain.load_state_dict(hooked.state_dict())
    hooked.fc2.register_forward_pre_hook(lambda m, a: (a[0] * 10,))
    x = torch.randn(4, 8)
    p_hooked, p_plain = dq.prepare(hooked, (x,)), dq.prepare(plain, (x,))
    assert p_hooked.__dict__["_dbr_record"].observes_functions == functions
    batches = [torch.randn(4, 8) for _ in range(3)]
    dq.calibrate(p_hooked, batches, progress=False)
    dq.calibrate(p_plain, batches, progress=False)
    c_hooked, c_plain = dq.convert(p_hooked), dq.convert(p_plain)
    with torch.no_grad():
        assert torch.equal(c_hooked(x), c_plain(x))  # same scales: the FP8 results agree bit for bit
