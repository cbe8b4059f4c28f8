"""The `real` tier runs where SmolLM2's wheel is installed (`make test` installs it)."""

from __future__ import annotations

import importlib.util

import pytest

from proxima.tasks.instructions import INSTALL, SMOLLM_PACKAGE


def pytest_collection_modifyitems(config, items):
    have = importlib.util.find_spec(SMOLLM_PACKAGE) and importlib.util.find_spec("gguf")
    if have:
        return
    skip = pytest.mark.skip(reason=f"SmolLM2's wheel is not installed: {INSTALL}")
    for item in items:
        if "real" in item.keywords:
            item.add_marker(skip)
