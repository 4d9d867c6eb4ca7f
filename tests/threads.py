"""One intra-op thread for a block of test work (folders' conftests use it as an autouse fixture)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    """The CI machine has 2 cores shared with other jobs: OpenMP threads competing for them make small models
    5-10x slower than one thread, and GPTQ's column loop of tiny ops only gains barrier waits."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
