"""The `real` tier runs where a real model's wheel is installed: SmolLM2's (`make test` installs
it) or, for test_gemma3.py, Gemma 3 270M's (`make test-gemma`). A file names the package it
needs in its module's `REQUIRES` (package, install command); SmolLM2's by default."""

from __future__ import annotations

import importlib.util

import pytest

from proxima.tasks.instructions import INSTALL, SMOLLM_PACKAGE


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "real" not in item.keywords:
            continue
        package, install = getattr(item.module, "REQUIRES", (SMOLLM_PACKAGE, INSTALL))
        if not (importlib.util.find_spec(package) and importlib.util.find_spec("gguf")):
            item.add_marker(pytest.mark.skip(reason=f"{package} is not installed: {install}"))
