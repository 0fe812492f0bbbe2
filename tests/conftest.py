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
    try:
        from hypothesis import HealthCheck, settings
    except ImportError:  # the property suite is then skipped by its import
        return
    # property-based tests (tests/test_robustness_properties.py): a modest number of examples by default
    quiet = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.filter_too_much]
    settings.register_profile("ppl_default", max_examples=25, deadline=None, suppress_health_check=quiet)
    settings.register_profile("ppl_slow", max_examples=300, deadline=None, suppress_health_check=quiet)
    settings.load_profile("ppl_slow" if config.getoption("--slow") else "ppl_default")
