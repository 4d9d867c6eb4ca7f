import pytest
import torch
from inspect_toys import MLP, Attn, batches
from threads import one_thread

import dbr_quant as dq


@pytest.fixture(autouse=True)
def _one_thread():
    """The CI box has 2 shared cores: one intra-op thread avoids OpenMP contention (10× on MiniLM)."""
    with one_thread():
        yield


@pytest.fixture
def mlp_prepared():
    torch.manual_seed(0)
    model = MLP().eval()
    p = dq.prepare(model, (torch.randn(8, 16),))
    dq.calibrate(p, batches(), progress=False)
    return model, p


@pytest.fixture
def attn_prepared():
    torch.manual_seed(0)
    model = Attn().eval()
    p = dq.prepare(model, (torch.randn(2, 6, 16),), dq.QConfig(quantize_attention=True))
    dq.calibrate(p, batches(3, (2, 6, 16)), progress=False)
    return model, p
