"""The ``ppl-thought`` command."""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

# The CLI imports the library inside its commands: ``ppl-thought --version`` and ``-h`` answer without loading
# torch, and each command loads only what it runs (docs/architecture.md, "The layers").


def _version() -> str:
    from ppl_thought import __version__

    return __version__


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


def _writable(folder: str, what: str) -> str | None:
    """None if ``folder`` can be created and written, else the reason (checked before a long run)."""
    try:
        os.makedirs(folder, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=folder):
            pass
    except OSError as e:
        return f"cannot write the {what} {folder!r}: {e.strerror or e}"
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
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
    return 1 if cpus <= SMALL_MACHINE_CORES else None


def _demo(args: argparse.Namespace) -> int:
    checks = [_writable(args.out, "output folder")]
    if args.json:
        checks.append(_writable(os.path.dirname(os.path.abspath(args.json)), "folder of --json"))
    problems = [c for c in checks if c]
    if problems:
        print(f"ppl-thought demo: {problems[0]}", file=sys.stderr)
        return 2
    threads = args.threads if args.threads is not None else default_demo_threads()
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    from ppl_thought.demo import json_default, run_demo
    from ppl_thought.io import atomic_write_json

    parts = None if args.parts is None else tuple(args.parts)
    results = run_demo(out=args.out, quick=args.quick, seed=args.seed, n=args.n, parts=parts, seeds=args.seeds)
    if args.json:
        atomic_write_json(args.json, results, default=json_default)
        print(f"wrote {args.json}")
    return 0


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ppl-thought",
        description="Language models with latent thoughts as probabilistic programs (Pyro / NumPyro).",
    )
    p.add_argument("--version", action="version", version=f"ppl_thought {_version()}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="versions of ppl_thought and its backends")
    info.set_defaults(func=_info)
    demo = sub.add_parser("demo", help="the main job: run the library's showcase and write results")
    demo.add_argument("--quick", action="store_true", help="a shorter run (under five minutes on 2 cores)")
    demo.add_argument("--n", type=_positive_int, default=8,
                      help="sampling size n of (7.1)/(7.2) (the paper uses 8 and 16)")
    demo.add_argument("--parts", nargs="+", default=None, choices=["sec7", "a5", "real"],
                      help="which parts to run (Section 7, A5, the real model; default: all that are installed)")
    demo.add_argument("--out", default="out/demo", help="output folder for JSON and plots")
    demo.add_argument("--json", default=None, help="also write the results JSON to this file")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--threads", type=_positive_int, default=None,
                      help="torch CPU threads (default: 1 on machines with <= 4 cores, else torch's choice)")
    demo.add_argument("--seeds", type=_positive_int, default=None,
                      help="Section 7 replicates (seeds --seed, --seed + 1, ...); default 3, or 1 with --quick")
    demo.set_defaults(func=_demo)
    diag = sub.add_parser("diagnose", help="a short report and plots for a result file (netcdf or saved Result dir)")
    diag.add_argument("file", help="a netcdf from to_inference_data(...).to_netcdf (any result type), one of the "
                                   "demo's .nc files, or a pt.infer.save_result directory")
    diag.add_argument("--out", default=None, help="folder for the plots (default: next to FILE)")
    diag.set_defaults(func=_diagnose)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 0
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
