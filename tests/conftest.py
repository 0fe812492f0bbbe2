"""Test-wide settings: one intra-op thread (small tensors on 2 shared cores are faster and steadier)."""

import warnings

import torch

torch.set_num_threads(1)
warnings.filterwarnings("ignore", category=FutureWarning, module="arviz")


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="statistical tests with their full seed sets (default: a smaller seed set)")


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: statistical test whose full seed set runs with --slow")
