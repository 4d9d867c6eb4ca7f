import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _seed_and_check_global_state():
    """Every test starts seeded and must leave Module.__call__ and the torch-function mode stack clean."""
    from dbr_quant.runtime.interception import is_patched

    torch.manual_seed(0)
    yield
    assert not is_patched(), "nn.Module._call_impl (module-call interception) was left patched"
    assert torch._C._len_torch_function_stack() == 0, "a torch function mode was left on the stack"


def assert_close_to_reference(out: torch.Tensor, ref: torch.Tensor, *, max_rel: float,
                              min_cos: float | None = None) -> float:
    """An FP8 output against its high-precision reference: the relative error ‖out − ref‖ / ‖ref‖ (which sees a
    wrong scale: ×2 or ×½ is a relative error ≥ 0.5, while the cosine stays 1), and the cosine where given.
    Returns the relative error. ``$DBR_TEST_LOG_REL`` (a file) records each measured value with its test."""
    out, ref = out.detach().double().flatten(), ref.detach().double().flatten()
    rel = ((out - ref).norm() / ref.norm()).item()
    cos = torch.nn.functional.cosine_similarity(out, ref, dim=0).item()
    if log := os.environ.get("DBR_TEST_LOG_REL"):
        with open(log, "a") as f:
            f.write(f"{os.environ.get('PYTEST_CURRENT_TEST', '?')}\trel={rel:.5f}\tmax_rel={max_rel}\tcos={cos:.6f}\n")
    assert rel <= max_rel, f"relative error {rel:.5f} > {max_rel} (cosine {cos:.6f})"
    if min_cos is not None:
        assert cos >= min_cos, f"cosine {cos:.6f} < {min_cos} (relative error {rel:.5f})"
    return rel


@pytest.fixture(scope="session")  # a plain function: hypothesis tests may take it too
def close_to_reference():
    """:func:`assert_close_to_reference`, for tests in any folder (a fixture needs no import path)."""
    return assert_close_to_reference
