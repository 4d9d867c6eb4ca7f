import pytest
from threads import one_thread


@pytest.fixture(autouse=True)
def _one_thread():
    """GPTQ's column loop is thousands of tiny ops: intra-op threads only add barrier waits."""
    with one_thread():
        yield
