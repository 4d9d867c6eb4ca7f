import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    """GPTQ's column loop is thousands of tiny ops: intra-op threads only add barrier waits (on a loaded
    2-core machine they made these tests several times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
