"""Shared test setup. Triton kernels run under the interpreter when there is no GPU (CI)."""

import importlib.util
import os
import socket
import sys

import pytest

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # report/export tests need no torch
    _HAS_CUDA = False

if not _HAS_CUDA:
    # Must be set before triton is first imported.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The test extra brings triton on Linux; elsewhere there is no triton wheel, so its kernels go untested there.
if sys.platform != "linux" and importlib.util.find_spec("triton") is None:
    collect_ignore = ["test_kernels.py", "test_spec_device.py"]


@pytest.fixture
def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
