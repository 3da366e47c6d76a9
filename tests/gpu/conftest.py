import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))  # for _ref

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None


def _sm90() -> bool:
    try:
        return torch is not None and torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
    except Exception:
        return False


HAVE_SM90 = _sm90()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs an sm_90 (Hopper) GPU")
    for item in items:
        if "tests/gpu" in str(item.fspath).replace("\\", "/"):
            item.add_marker(pytest.mark.gpu)
            if not HAVE_SM90:
                item.add_marker(skip)
