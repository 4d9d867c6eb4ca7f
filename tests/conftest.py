import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _seed_and_check_global_state():
    """Every test starts seeded and must leave Module.__call__ and the torch-function mode stack clean."""
    from dbr_quant.auto_trace import is_patched

    torch.manual_seed(0)
    yield
    assert not is_patched(), "nn.Module._call_impl (module-call interception) was left patched"
    assert torch._C._len_torch_function_stack() == 0, "a torch function mode was left on the stack"
