"""Markers that depend on the machine: `vllm` tests need vLLM importable (`make test-vllm`
builds .venv-vllm with the CPU build), `gpu` tests need CUDA. Both are skipped, with the
reason, where their requirement is missing. And `one_thread`, for modules of nano models."""

from __future__ import annotations

import importlib.util

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    has_vllm = importlib.util.find_spec("vllm") is not None
    no_vllm = pytest.mark.skip(reason="vLLM is not installed here (`make test-vllm` runs these)")
    no_cuda = pytest.mark.skip(reason="needs a CUDA device")
    # the markers themselves: `item.keywords` also holds the names of the folders above the
    # test, so a checkout in a folder named `vllm` or `gpu` would skip the whole suite
    for item in items:
        if item.get_closest_marker("vllm") and not has_vllm:
            item.add_marker(no_vllm)
        if item.get_closest_marker("gpu") and not torch.cuda.is_available():
            item.add_marker(no_cuda)


@pytest.fixture(scope="module")
def one_thread():
    """Nano models gain nothing from threads, and a busy 2-core machine makes OpenMP's
    spin-waits cost seconds; restored afterwards for the rest of the suite. A module opts in
    with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
