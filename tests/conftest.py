"""Shared fixtures: the device under test and a clean Dynamo cache per test.

Tests run on CPU through Triton's interpreter by default; `FUSER_TEST_DEVICE=cuda` runs the same
suite on the GPU.
"""
import os

import pytest
import torch

import fuser  # noqa: F401

DEVICE = "cuda" if os.environ.get("FUSER_TEST_DEVICE") == "cuda" and torch.cuda.is_available() else "cpu"

# Dynamo times every new guard set once for a compile metric (guard_latency_us), after flushing the CPU's
# caches: 30-60 ms a compile on this suite's machines, a few thousand compiles.  No test reads the metric.
if hasattr(torch._dynamo.guards, "profile_guard_manager"):
    torch._dynamo.guards.profile_guard_manager = lambda *args: 0.0


@pytest.fixture
def device():
    return DEVICE


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
