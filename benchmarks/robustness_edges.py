"""The edge families of issue 41 (items 4, 6, 8), generated from a seed, for ``benchmarks/robustness.py --edges``.

Each family draws ``n`` cases with ``random.Random(seed)`` (not a list of the issue's examples) and answers, per case,
``(input, answer, message)`` with the answers of benchmarks/robustness.py: ``clear`` (a PPLThoughtError naming
the problem), ``unclear``, ``silent`` (a value where an error was due), ``crash``; and, for inputs that must give a
value, ``ok`` (the exact answer) or ``wrong``. Families:

* ``loader keys``: a saved Transformer's config.json with a key removed, added or given a wrong type;
* ``oversize``: engine, LM and automaton sizes no machine holds (run only once ``ResourceError`` exists, so that
  a missing check cannot allocate the machine's memory away);
* ``zero weights``: a prior that never emits some tokens, an observation in / outside the image, Importance and
  SMC, guided and bootstrap: -inf with a warning, or ZeroWeightsError naming the guide or the model's prior;
* ``nan arguments``: every public parameter hinted ``float``, given NaN;
* ``tied logits``: k tied logits of 10^e: log p = -log k exactly, torch and JAX;
* ``foreign automata``: an automaton lifted from a permuted vocabulary of the LM's size: TokenizerMismatchError;
* ``clamping sites``: a probs= site with a probability under float32 eps, scored through ``pt.observe``.
"""

# ruff: noqa: B023 -- every lambda here is called at once by answer(), inside its loop iteration
from __future__ import annotations

import inspect
import json
import math
import random
import string
import tempfile
import warnings
from pathlib import Path

import torch

import ppl_thought as pt
from ppl_thought.errors import PPLThoughtError, ZeroWeightsError

CRASH = (RuntimeError, IndexError, KeyError, AttributeError, ZeroDivisionError, AssertionError, MemoryError,
         OverflowError)


def answer(call, phrase: str = "", check=None) -> tuple[str, str]:
    """``clear`` / ``unclear`` / ``crash`` for an error, ``silent`` for a value where ``check`` is None, else
    ``ok`` / ``wrong`` by ``check(value)``."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = call()
    except PPLThoughtError as e:
        ok = phrase.lower() in str(e).lower()
        return ("clear" if ok else "unclear"), f"{type(e).__name__}: {e}"[:160]
    except CRASH as e:
        return "crash", f"{type(e).__name__}: {e}"[:160]
    except Exception as e:  # noqa: BLE001 -- another exception type: an answer, not the library's
        return "unclear", f"{type(e).__name__}: {e}"[:160]
    if check is None:
        return "silent", f"returned {type(out).__name__}"
    good = check(out)
    return ("ok" if good else "wrong"), f"returned {out!r}"[:160]


# ---------------------------------------------------------------------------------------------- loaders
def loader_keys(rng: random.Random, n: int) -> list[tuple[str, str, str]]:
    from ppl_thought.transformer_checkpoint import TRANSFORMER_ARGS

    V = 6
    torch.manual_seed(0)
    lm = pt.lm.Transformer(V, d_model=8, n_layers=1, n_heads=2, max_len=8)
    out = []
    with tempfile.TemporaryDirectory() as d:
        base = lm.save(Path(d) / "base")
        header = json.loads((base / "config.json").read_text())
        for i in range(n):
            how = rng.choice(["missing", "extra", "wrong type"])
            cfg = json.loads(json.dumps(header))
            keys = [k for k in TRANSFORMER_ARGS if k in cfg["config"]] or list(cfg["config"])
            key = rng.choice(keys)
            if how == "missing":
                del cfg["config"][key]
            elif how == "extra":
                key = "".join(rng.choices(string.ascii_lowercase, k=6))
                cfg["config"][key] = rng.choice([1, "x", None, [1]])
            else:
                cfg["config"][key] = rng.choice([[cfg["config"][key]], {"v": 1}, "12", 1.5])
            path = Path(d) / f"case{i}"
            path.mkdir()
            for f in base.iterdir():
                if f.name != "config.json":
                    (path / f.name).write_bytes(f.read_bytes())
            (path / "config.json").write_text(json.dumps(cfg))
            out.append((f"config.json {how} {key!r}", *answer(lambda p=path: pt.lm.Transformer.load(p), key)))
    return out


# ---------------------------------------------------------------------------------------------- sizes
def oversize(rng: random.Random, n: int) -> list[tuple[str, str, str]]:
    if not hasattr(pt.errors, "ResourceError"):
        return [("oversize", "skipped", "pt.errors.ResourceError has not landed: not run (it could allocate)")]
    vocab = pt.Vocab(["a", "b"])
    V = len(vocab)
    model = pt.models.SlowThinking(pt.lm.Tabular(2, V, torch.zeros(V, V), trainable=False),
                                   pt.projections.PauseToThink(vocab, 1))
    makers = [
        ("Importance(2**{e}).run", lambda e: pt.infer.Importance(2 ** e).run(model, None, "ab")),
        ("SMC(2**{e}).run", lambda e: pt.infer.SMC(2 ** e).run(model, None, "ab")),
        ("Transformer(max_len=10**{k})", lambda e: pt.lm.Transformer(V, 8, 1, 2, max_len=10 ** (e // 3))),
    ]
    out = []
    for _ in range(n):
        name, make = rng.choice(makers)
        e = rng.randint(40, 60)
        out.append((name.format(e=e, k=e // 3), *answer(lambda m=make, e=e: m(e), "")))
    return out


# ---------------------------------------------------------------------------------------------- zero weights
def zero_weights(rng: random.Random, n: int) -> list[tuple[str, str, str]]:
    vocab = pt.Vocab(["a", "b", "c"])
    V = len(vocab)
    out = []
    for _ in range(n):
        g = torch.Generator().manual_seed(rng.randrange(2**31))
        logits = torch.randn(V, V, generator=g)
        banned = rng.choice(["a", "b", "c"])
        logits[:, vocab.id(banned)] = float("-inf")
        model = pt.models.SlowThinking(pt.lm.Tabular(2, V, logits, trainable=False),
                                       pt.projections.PauseToThink(vocab, 1))
        outside = rng.random() < 0.3
        x = [vocab.id(rng.choice("abc")) for _ in range(rng.randint(1, 3))]
        if outside:
            x[rng.randrange(len(x))] = vocab.id("<s>")  # not observable: the lifting is empty
        x = torch.tensor(x)
        exact = float(model.exact_log_prob(x))
        guided = rng.random() < 0.5
        guide = pt.guides.Causal(pt.lm.Tabular(2, V, torch.zeros(V, V), trainable=False), model.projection) \
            if guided else None
        engine = rng.choice([pt.infer.Importance(32), pt.infer.SMC(32)])
        who = "the guide" if guided else "own prior"
        label = f"{type(engine).__name__} {'guided' if guided else 'bootstrap'} x={x.tolist()} banned={banned!r}"

        def run(e=engine, m=model, q=guide, x=x):
            return e.run(m, q, x).log_marginal

        if math.isfinite(exact):  # a value is due; all-zero weights by chance are a legitimate estimate of 0
            a, msg = answer(run, check=lambda v: math.isfinite(float(v)))
            a = "ok" if a in ("ok",) or (a == "clear" and "are zero" in msg) else a
            out.append((label + " (p > 0)", a, msg))
        elif outside:  # p(x) = 0 exactly, known: -inf with a warning
            out.append((label + " (outside)", *answer(run, check=lambda v: float(v) == float("-inf"))))
        else:  # in the image, p(x) = 0: every weight zero, an error naming what proposed
            a, msg = answer(run, who)
            if a == "clear" and not msg.startswith(ZeroWeightsError.__name__):
                a = "unclear"
            out.append((label + " (p = 0)", a, msg))
    return out


# ---------------------------------------------------------------------------------------------- NaN arguments
def nan_arguments(rng: random.Random, n: int) -> list[tuple[str, str, str]]:
    from ppl_thought.validation import _float_parameters

    found = []
    for sub in ("data", "diagnostics", "distributions", "guides", "inference", "lm", "models", "projections",
                "training", "transforms", "verifiers"):
        mod = getattr(pt, sub)
        for attr in sorted(getattr(mod, "__all__", ())):
            obj = getattr(mod, attr, None)
            fns = [obj] if inspect.isfunction(obj) else [getattr(obj, "__init__", None)] if inspect.isclass(obj) else []
            for fn in fns:
                raw = inspect.unwrap(fn) if fn is not None else None
                for _pos, name in _float_parameters(raw) if raw is not None else ():
                    found.append((f"pt.{sub}.{attr}", obj, name))
    out = []
    for where, obj, name in rng.sample(found, min(n, len(found))):
        out.append((f"{where}({name}=nan)", *answer(lambda o=obj, k=name: o(**{k: float("nan")}), name)))
    return out


# ---------------------------------------------------------------------------------------------- tied logits
def tied_logits(rng: random.Random, n: int) -> list[tuple[str, str, str]]:
    from ppl_thought.distributions.token_rule import TokenRule, token_step

    out = []
    for _ in range(n):
        V, k = rng.randint(4, 40), rng.randint(2, 4)
        big = 10.0 ** rng.uniform(3, 38)
        x = torch.full((1, V), -big)
        ids = rng.sample(range(2, V), min(k, V - 2))
        x[0, ids] = big
        want = -math.log(len(ids))
        rule, s = TokenRule(None, V), torch.zeros(1, dtype=torch.long)
        label = f"{len(ids)} tied logits of {big:.2g} over V={V}"
        out.append((label + " (log_probs)", *answer(lambda: rule.log_probs(x, s)[0, ids[0]],
                                                    check=lambda v: abs(float(v) - want) < 1e-5)))
        out.append((label + " (token_step)", *answer(lambda: token_step(rule, x, s).log_prob,
                                                     check=lambda v: abs(float(v) - want) < 1e-5)))
        try:
            import jax.numpy as jnp

            from ppl_thought.numpyro.distributions import masked_log_softmax
        except ImportError:
            continue
        out.append((label + " (JAX)", *answer(lambda: masked_log_softmax(jnp.asarray(x.numpy()),
                                                                         jnp.ones((1, V), bool))[0, ids[0]],
                                              check=lambda v: abs(float(v) - want) < 1e-5)))
    return out


# ---------------------------------------------------------------------------------------------- automata
def foreign_automata(rng: random.Random, n: int) -> list[tuple[str, str, str]]:
    from ppl_thought.projections import CharDFA, token_automaton, token_texts

    out = []
    for _ in range(n):
        letters = rng.sample(string.ascii_lowercase, rng.randint(3, 6))
        other = letters[:]
        while other == letters:
            rng.shuffle(other)
        ours = pt.Vocab(letters)
        lm = pt.lm.Tabular(1, len(ours), torch.zeros(len(ours)), trainable=False)
        lm.vocab = ours
        dfa = CharDFA.lipogram(letters[0])
        auto = token_automaton(dfa, token_texts(pt.Vocab(other)))
        out.append((f"automaton of {''.join(other)} on an LM of {''.join(letters)}",
                    *answer(lambda a=auto: pt.models.Constrained(lm, a, 4), "another tokenizer")))
    return out


# ---------------------------------------------------------------------------------------------- clamping sites
def clamping_sites(rng: random.Random, n: int) -> list[tuple[str, str, str]]:
    import pyro
    import pyro.distributions as dist

    out = []
    for _ in range(n):
        tiny = 10.0 ** rng.uniform(-30, -8)
        K = rng.randint(2, 6)
        kind = rng.choice(["Categorical", "Bernoulli", "OneHotCategorical"])
        v = rng.randrange(K)
        if kind == "Bernoulli":
            d, value = dist.Bernoulli(probs=torch.tensor(tiny)), torch.tensor(1.0)
        else:
            p = torch.full((K,), (1 - tiny) / (K - 1))
            p[v] = tiny
            d = dist.Categorical(probs=p) if kind == "Categorical" else dist.OneHotCategorical(probs=p)
            value = torch.tensor(v) if kind == "Categorical" else \
                torch.nn.functional.one_hot(torch.tensor(v), K).float()
        want = math.log(torch.tensor(tiny, dtype=torch.float32).item())  # the float32 probability's own log

        def score(d=d, value=value):
            return pyro.poutine.trace(lambda: pt.observe("y", d, value)).get_trace().log_prob_sum()

        out.append((f"{kind}(probs) site, p = {tiny:.2g}",
                    *answer(score, check=lambda s, w=want: abs(float(s) - w) < 1e-3 * abs(w))))
    return out


FAMILIES = {"loader keys": loader_keys, "oversize": oversize, "zero weights": zero_weights,
            "nan arguments": nan_arguments, "tied logits": tied_logits, "foreign automata": foreign_automata,
            "clamping sites": clamping_sites}


def edge_rows(n: int, seed: int = 0) -> dict[str, list[tuple[str, str, str]]]:
    """``{family: [(input, answer, message)]}``: ``n`` generated cases per family."""
    return {name: make(random.Random(f"{seed}:{name}"), n) for name, make in FAMILIES.items()}


__all__ = ["FAMILIES", "edge_rows"]
