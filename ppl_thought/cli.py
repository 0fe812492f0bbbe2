"""The ``ppl-thought`` command."""

from __future__ import annotations

import argparse
import json
import sys


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


def _demo(args: argparse.Namespace) -> int:
    from ppl_thought.demo import _json_default, run_demo

    results = run_demo(out=args.out, quick=args.quick, seed=args.seed, n=args.n, parts=tuple(args.parts),
                       seeds=args.seeds)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2, default=_json_default)
        print(f"wrote {args.json}")
    return 0


def _diagnose(args: argparse.Namespace) -> int:
    from ppl_thought.diagnostics.report import diagnose

    try:
        text, _ = diagnose(args.file, out=args.out)
    except (FileNotFoundError, ValueError) as e:
        print(f"ppl-thought diagnose: {e}", file=sys.stderr)
        return 2
    print(text)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ppl-thought",
        description="Language models with latent thoughts as probabilistic programs (Pyro / NumPyro).",
    )
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    info = sub.add_parser("info", help="versions of ppl_thought and its backends")
    info.set_defaults(func=_info)
    demo = sub.add_parser("demo", help="the main job: run the library's showcase and write results")
    demo.add_argument("--quick", action="store_true", help="a shorter run (under five minutes on 2 cores)")
    demo.add_argument("--n", type=int, default=8, help="sampling size n of (7.1)/(7.2) (the paper uses 8 and 16)")
    demo.add_argument("--parts", nargs="+", default=["sec7", "a5"], choices=["sec7", "a5"],
                      help="which parts to run (Section 7 and/or A5)")
    demo.add_argument("--out", default="out/demo", help="output folder for JSON and plots")
    demo.add_argument("--json", default=None, help="also write the results JSON to this file")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--seeds", type=int, default=None,
                      help="Section 7 replicates (seeds --seed, --seed + 1, ...); default 3, or 1 with --quick")
    demo.set_defaults(func=_demo)
    diag = sub.add_parser("diagnose", help="summary table and plots for a saved result (netcdf or save_result dir)")
    diag.add_argument("file", help="a netcdf from to_inference_data(...).to_netcdf, or a save_result directory")
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
