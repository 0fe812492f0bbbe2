"""Every engine x every ready model on any torch device (issue 21, part 1), and half precision (part 2).

How this is tested without a GPU, the "meta default device" trick: the engine runs with its models on
``device`` (CPU by default, ``pytest --device cuda`` on a GPU) inside ``with torch.device("meta"):``,
torch's default-device context. Every tensor the library makes without an explicit ``device=`` (the bug
that crashes on CUDA: "Expected all tensors to be on the same device") then lands on "meta", and the first
op mixing it with the model's tensors raises (or a ``.tolist()`` / ``.item()`` of it: "Cannot copy out of
meta tensor"). Tensors made on the model's device are unaffected, so the run gives exactly the numbers of
the same run without the context (same seed): that is the check, cell by cell.
``test_the_meta_trick_catches_a_planted_device_bug`` shows that the trick fails on a planted
``torch.zeros(n)`` in a program's step (and that the same program with ``device=`` passes).
"""

from __future__ import annotations

import contextlib
import math

import pyro
import pyro.distributions as dist
import pytest
import torch
from engine_helpers import VOCAB, contrary_lm, tabular, thinking_prior
from torch.utils._device import DeviceContext

import ppl_thought as pt
from ppl_thought.distributions.lm_state import LMState
from ppl_thought.errors import DeviceMismatchError
from ppl_thought.guides.hmm import HMMGuide
from ppl_thought.projections import PauseToThink


def on(device):
    """``module -> module.to(device)``."""
    return lambda m: m.to(device)


class MetaDefault(DeviceContext):
    """``with torch.device("meta"):`` (torch's default-device context), except that ``torch.as_tensor(t)`` /
    ``torch.tensor(t)`` / ``torch.asarray(t)`` of a tensor ``t`` keep ``t``'s device, as they do outside the
    context (pyro's ``Unit`` of ``pyro.factor`` calls ``torch.as_tensor`` on the factor: no bug on a GPU)."""

    def __init__(self):
        super().__init__("meta")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _KEEP and args and isinstance(args[0], torch.Tensor) and kwargs.get("device") is None:
            return func(*args, **kwargs)
        return super().__torch_function__(func, types, args, kwargs)


_KEEP = (torch.as_tensor, torch.tensor, torch.asarray)


def meta_default(enabled: bool = True):
    return MetaDefault() if enabled else contextlib.nullcontext()


def flat(out) -> list[float]:
    """Every number of an engine's output (a Result, tensors, dicts, lists) on the host, in a fixed order."""
    if isinstance(out, pt.infer.Result):
        parts = [out.log_weights, out.log_marginal, out.samples, out.ancestry]
        return flat(parts)
    if isinstance(out, dict):
        return [v for k in sorted(out, key=str) for v in flat(out[k])]
    if isinstance(out, (list, tuple)):
        return [v for o in out for v in flat(o)]
    if isinstance(out, torch.Tensor):
        assert out.device.type != "meta", "an output landed on the default device"
        return out.detach().double().cpu().reshape(-1).tolist()
    if isinstance(out, (int, float, bool)):
        return [float(out)]
    if out is None:
        return []
    return flat(vars(out)) if hasattr(out, "__dict__") else [float(out)]


# ---------------------------------------------------------------------------------------------- the models
def slow_thinking(device, guide: str):
    prior = on(device)(pt.lm.Tabular(4, len(VOCAB), thinking_prior(0).logits, trainable=True))  # Inquisitive: theta
    proj = PauseToThink(VOCAB, max_thought_len=2)
    model = pt.models.SlowThinking(prior, proj)
    q = on(device)(contrary_lm(1))
    guides = {"identity": lambda: pt.guides.Identity(model), "predictive": lambda: pt.guides.Predictive(q, proj),
              "causal": lambda: pt.guides.Causal(q, proj), "explanatory": lambda: pt.guides.Explanatory(q, proj),
              "posterior": lambda: pt.guides.Posterior(model), "inquisitive": lambda: pt.guides.Inquisitive(model),
              "none": lambda: None}
    return model, guides[guide](), ("a b",)


def hmm(device, guide: str):
    A = torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.7, 0.2], [0.2, 0.1, 0.7]], dtype=torch.float64)
    B = torch.tensor([[0.8, 0.2], [0.3, 0.7], [0.5, 0.5]], dtype=torch.float64)
    model = pt.models.HMM(A, B, torch.tensor([0.5, 0.3, 0.2], dtype=torch.float64)).to(device)
    g = {"posterior": HMMGuide.posterior, "filtering": HMMGuide.filtering, "none": lambda m: None}[guide](model)
    return model, g, (torch.tensor([0, 1, 1, 0], device=device),)


def constrained(device, guide: str):
    from ppl_thought.projections import CharDFA, token_automaton, token_texts

    vocab = pt.Vocab(["a", "b", "e"])
    g = torch.Generator().manual_seed(0)
    lg = torch.full((len(vocab), len(vocab)), float("-inf"))
    cols = [vocab.eos_id] + vocab.ordinary_ids.tolist()
    lg[:, cols] = torch.randn(len(vocab), len(cols), generator=g)
    lm = on(device)(pt.lm.Tabular(2, len(vocab), lg, trainable=False))
    auto = token_automaton(CharDFA.lipogram("e"), token_texts(vocab))
    twist = (lambda toks: 0.7 * (toks == vocab.id("a")).sum(-1).float()) if guide == "twist" else None
    return pt.models.Constrained(lm, auto, 4, twist=twist), None, (torch.zeros(0, dtype=torch.long, device=device),)


def user_program(device, guide: str):
    from test_program_matrix import PlanThinkAnswer, PlanThinkGuide, tab

    model = PlanThinkAnswer(on(device)(tab(6, order=2)), on(device)(tab(7)))
    g = PlanThinkGuide(on(device)(tab(8, order=2)), None) if guide == "user" else None
    return model, g, (torch.tensor([VOCAB.id("a"), VOCAB.id("b")], device=device),)


def huggingface(device, guide: str):
    import hf_models as H

    prior = on(device)(H.small(0))
    proj = PauseToThink(prior.vocab, 1)
    model = pt.models.SlowThinking(prior, proj)
    g = {"causal": lambda: pt.guides.Causal(on(device)(H.small(12)), proj),
         "explanatory": lambda: pt.guides.Explanatory(on(device)(H.small(13)), proj),
         "identity": lambda: pt.guides.Identity(model)}[guide]()
    return model, g, (prior.vocab.encode(["a", "ba"]),)


MODELS = {"slow_thinking": slow_thinking, "hmm": hmm, "constrained": constrained, "user_program": user_program,
          "huggingface": huggingface}
CELLS = ([("slow_thinking", g) for g in ("identity", "predictive", "causal", "explanatory", "posterior",
                                          "inquisitive", "none")]
         + [("hmm", g) for g in ("posterior", "filtering", "none")]
         + [("constrained", "none"), ("constrained", "twist"), ("user_program", "user"), ("user_program", "none")]
         + [("huggingface", g) for g in ("causal", "explanatory", "identity")])


def run_engine(engine: str, model, guide, args, device):
    pyro.set_rng_seed(0)
    if engine == "importance":
        return pt.infer.Importance(16).run(model, guide, *args)
    gen = torch.Generator(device=device).manual_seed(1)
    return pt.infer.SMC(16, ess_threshold=0.9, generator=gen).run(model, guide, *args)


@pytest.mark.parametrize("engine", ["importance", "smc"])
@pytest.mark.parametrize("model,guide", CELLS)
def test_engine_matrix_makes_every_tensor_on_the_model_device(model, guide, engine, device):
    if model == "huggingface":
        pytest.importorskip("transformers")
    if model == "hmm" and guide == "filtering" and engine == "importance":
        pytest.skip("the filtering guide is an SMC proposal")
    m, g, args = MODELS[model](device, guide)
    ref = run_engine(engine, m, g, args, device)
    with meta_default(True):
        res = run_engine(engine, m, g, args, device)
    assert res.log_weights.device.type == torch.device(device).type  # Result keeps tensors on the device
    assert math.isfinite(float(res.log_marginal))
    assert flat(res) == flat(ref)


class _Counter(pt.Program):
    """A program of two one-token steps from an LM; ``planted=True`` makes its finished flags with a planted
    device bug (``torch.zeros(n)`` without ``device=``, the bug that crashes on CUDA)."""

    def __init__(self, lm, planted: bool):
        self.lm, self.planted = lm, planted

    def init(self, state, x):
        state["lm"] = LMState.start(self.lm, pt.particles(), max_len=8)

    def step(self, state, t, x):
        st = state["lm"]
        st.extend(pyro.sample(f"z_{t}", st.next_token()))
        pyro.sample(f"x_{t}", dist.Categorical(logits=torch.zeros(st.n, 2, device=st.device)), obs=x[t].expand(st.n))
        if t + 1 < len(x):
            return None
        if self.planted:
            return torch.zeros(st.n) == 0  # the bug: made on the default device, not the model's
        return torch.zeros(st.n, device=st.device) == 0


def test_the_meta_trick_catches_a_planted_device_bug(device):
    lm = on(device)(tabular(len(VOCAB), 0))
    x = torch.tensor([0, 1], device=device)
    for engine in ("importance", "smc"):
        good = run_engine(engine, _Counter(lm, planted=False), None, (x,), device)
        with meta_default():
            assert flat(run_engine(engine, _Counter(lm, planted=False), None, (x,), device)) == flat(good)
        run_engine(engine, _Counter(lm, planted=True), None, (x,), device)  # no error without the trick
        with meta_default(), pytest.raises((RuntimeError, NotImplementedError)):
            run_engine(engine, _Counter(lm, planted=True), None, (x,), device)


# ---------------------------------------------------------------------------------------------- device mismatch
def test_a_model_and_a_guide_on_different_devices_get_a_clear_error():
    """Model on "cpu", guide on "meta": DeviceMismatchError naming both devices, from every engine (before
    torch's own "Expected all tensors to be on the same device")."""
    proj = PauseToThink(VOCAB, max_thought_len=2)
    model = pt.models.SlowThinking(thinking_prior(0), proj)
    meta_lm = contrary_lm(1).to("meta")
    for guide in (pt.guides.Causal(meta_lm, proj), pt.guides.Explanatory(meta_lm, proj)):
        for engine in (pt.infer.Importance(4), pt.infer.SMC(4)):
            with pytest.raises(DeviceMismatchError, match=r"device cpu.*device meta"):
                engine.run(model, guide, "a b")
        with pytest.raises(DeviceMismatchError, match="meta"):
            pt.infer.decode(model, guide, "a", method="resampling", n=4, max_new_tokens=1)
    hmm_model, _, (x,) = hmm("cpu", "none")
    other = pt.models.HMM(hmm_model.A, hmm_model.B, hmm_model.lam).to("meta")
    with pytest.raises(DeviceMismatchError, match="meta"):
        pt.infer.SMC(4).run(hmm_model, HMMGuide.posterior(other), x)
    assert issubclass(DeviceMismatchError, pt.errors.PPLThoughtError)


# ---------------------------------------------------------------------------------------------- the other engines
# each case builds its models on ``device`` and returns the run (called with and without the meta default device)
def _decoding(method: str):
    def case(device):
        from engine_helpers import LiftingSampler, thinking_model

        model = thinking_model()
        model.prior.to(device)
        sampler = LiftingSampler(on(device)(contrary_lm()), model)

        def run():
            gen = torch.Generator(device=device).manual_seed(0)
            if method == "next_token":
                return pt.infer.next_token_distribution(model, sampler, "a", n=8, generator=gen)
            if method == "streaming":
                return [v for _, v in pt.infer.decode(model, sampler, "a", method="streaming", max_new_tokens=2)]
            d = pt.infer.decode(model, sampler, "a", method=method, n=8, max_new_tokens=2, num_samples=3, k=3,
                                generator=gen)
            return [d.tokens, d.z, d.stats.get("scores"), d.stats.get("next_token_probs")]
        return run
    return case


def _training(engine: str):
    def case(device):
        import functools

        from _training_fixtures import PROJ, X
        from _training_fixtures import tabular as tab

        prior, q = on(device)(tab(0)), on(device)(tab(1))
        model = pt.models.SlowThinking(prior, PROJ)
        guide = pt.guides.Causal(q, PROJ, name="q")
        start = [p.detach().clone() for p in (prior.logits, q.logits)]
        objective = pt.train.Sum(pt.train.OneSampler(8), pt.train.SamplerPolicyGradient(8))

        def run():
            pyro.clear_param_store()
            with torch.no_grad():
                prior.logits.copy_(start[0])
                q.logits.copy_(start[1])
            if engine == "svi":
                res = pt.train.SVI(objective, {"lr": 0.1}).run(model, guide, X.to(device), num_steps=3)
                out = [res.stats["losses"], res.log_weights, res.samples]
            else:
                t = pt.train.Trainer(model, guide, objective, {"prior": prior, "sampler": q},
                                     optimizer=functools.partial(torch.optim.Adam, lr=0.1), clip_norm=0.5,
                                     batch_size=2, progress=False, seed=0)
                out = [[{k: v for k, v in h.items() if k != "time"} for h in t.fit([X.to(device)] * 4, num_steps=2)]]
            pyro.clear_param_store()
            return out + [prior.logits.detach().clone(), q.logits.detach().clone()]
        return run
    return case


class LTMProgram(pt.Program):
    """SMC over a LatentThought decoder: z ~ N(0, I) at init, then one observed token per step."""

    max_plate_nesting = 0

    def __init__(self, ltm):
        self.ltm = ltm

    def init(self, state, tokens):
        n = pt.particles()
        z = pyro.sample("z", dist.Normal(torch.zeros(n, *self.ltm.latent_shape, device=tokens.device), 1.0)
                        .to_event(3))
        state["logits"] = self.ltm.logits(tokens[None], z[:, None])[:, 0]  # [n, N, V]: the window reads z

    def step(self, state, t, tokens):
        n = pt.particles()
        pyro.sample(f"x_{t}", dist.Categorical(logits=state["logits"][:, t]), obs=tokens[t].expand(n))
        return torch.ones(n, dtype=torch.bool, device=tokens.device) if t + 1 == len(tokens) else None


def _latent_thought(engine: str):
    def case(device):
        from ppl_thought.models.latent_thought import LatentThought

        torch.manual_seed(0)
        ltm = LatentThought(5, 16, 2, 2, 2, window=2, d_latent=4).to(device)
        tok = torch.tensor([[1, 3, 0, 2, 4, 1]], device=device)

        def run():
            with torch.no_grad():
                if engine == "importance":
                    return pt.infer.Importance(8).run(ltm.conditioned_model, None, tok)
                if engine == "smc":
                    return pt.infer.SMC(8, generator=torch.Generator(device=device).manual_seed(0)).run(
                        LTMProgram(ltm), None, tok[0])
            if engine == "langevin":
                from ppl_thought.training.latent_thought import langevin_posterior

                r = langevin_posterior(ltm, tok, num_steps=4, warmup_steps=3, num_chains=2, seed=0)
                return [r.samples, r.stats.get("accept_prob")]
            return ltm.evaluate(tok, num_steps=2, iw_samples=4)
        return run
    return case


def _verifier(engine: str):
    def case(device):
        from test_verifiers import dyck_task

        lm, ver, _ = dyck_task(4)
        lm = on(device)(lm)

        def run():
            if engine == "rejection":
                return pt.verifiers.RejectionSampling(20, 4).run(lm, ver)
            if engine == "tokenwise":
                return pt.verifiers.TokenwiseRejection(20, 4).run(lm, ver)
            if engine == "verifier_smc":
                return pt.verifiers.VerifierSMC(20, 4).run(lm, ver)
            if engine == "backtracking":
                return pt.verifiers.TokenwiseBacktracking(20, 4, quota=2, stride=1).run(lm, ver)
            # 4 samples of 8 steps still backtrack (~400 times); VGB(20, 4, num_steps=40) was ~15 s CPU a run
            return pt.verifiers.VGB(4, 4, num_steps=8).run(lm, ver)
        return run
    return case


OTHER = {**{f"decode_{m}": _decoding(m) for m in ("direct", "resampling", "unbiased", "exact", "best_of_k",
                                                   "streaming", "next_token")},
         "svi": _training("svi"), "trainer": _training("trainer"),
         **{f"latent_thought_{e}": _latent_thought(e) for e in ("importance", "smc", "langevin", "evaluate")},
         **{f"verifier_{e}": _verifier(e) for e in ("rejection", "tokenwise", "verifier_smc", "backtracking", "vgb")}}


@pytest.mark.parametrize("case", sorted(OTHER))
def test_every_other_engine_makes_every_tensor_on_the_model_device(case, device):
    """Decoding (every method), SVI, the Trainer, LatentThought (Importance, SMC, Langevin, its evaluation) and
    the verifier engines: the same numbers under the meta default device as without it."""
    run = OTHER[case](device)
    pyro.set_rng_seed(0)
    ref = run()
    pyro.set_rng_seed(0)
    with meta_default():
        out = run()
    assert flat(out) == flat(ref)


# ---------------------------------------------------------------------------------------------- host syncs
def test_a_decode_step_checks_token_ids_once_per_input_not_per_token(monkeypatch):
    """The LM protocol's range check (``check_token_ids``: an ``aminmax`` read on the host) runs on the prompt a
    program starts from, not at every decode step (the decoding loop's ids are sampled below vocab_size)."""
    import ppl_thought.lm.base as base
    import ppl_thought.lm.transformer as transformer

    calls = []
    real = transformer.check_token_ids  # counted where the LM calls it and its range test (the sync) runs; a
    # segment's own host bound per segment (an aminmax of its lengths) is not this check

    def counted(t, *a, **k):
        if not base.ids_are_checked():
            calls.append(t.shape)
        return real(t, *a, **k)

    monkeypatch.setattr(transformer, "check_token_ids", counted)
    torch.manual_seed(0)
    lm = pt.lm.Transformer(len(VOCAB), d_model=16, n_layers=1, n_heads=2, max_len=32)
    auto = pt.projections.PauseToThink(VOCAB, max_thought_len=2).domain(3)
    for tokens in (2, 6):
        calls.clear()
        pyro.set_rng_seed(0)
        res = pt.infer.SMC(8).run(pt.models.Constrained(lm, auto, tokens), None,
                                  torch.tensor([VOCAB.id("a")]))
        assert res.stats["token_steps"] >= tokens // 2
        assert len(calls) == 1, calls  # the prompt, once: not per token
    with pytest.raises(pt.errors.UnknownTokenError):
        lm(torch.tensor([[len(VOCAB)]]))  # a user's call is still checked


# ---------------------------------------------------------------------------------------------- half precision
def _half_problem(dtype, device):
    torch.manual_seed(0)
    prior = pt.lm.Transformer(len(VOCAB), d_model=32, n_layers=2, n_heads=2, max_len=32)
    q = pt.lm.Transformer(len(VOCAB), d_model=32, n_layers=1, n_heads=2, max_len=32)
    with torch.no_grad():  # logits of order 1 (a random init gives nearly uniform ones)
        prior.embed.weight.mul_(40.0)
    proj = PauseToThink(VOCAB, max_thought_len=2)
    prior, q = prior.to(device, dtype), q.to(device, dtype)
    return pt.models.SlowThinking(prior, proj), pt.guides.Causal(q, proj)


def _half_dtypes():
    out = [torch.bfloat16]
    try:  # fp16 matmuls on this CPU?
        torch.ones(2, 2, dtype=torch.float16) @ torch.ones(2, 2, dtype=torch.float16)
        out.append(torch.float16)
    except RuntimeError:
        pass
    return out


@pytest.mark.parametrize("dtype", _half_dtypes(), ids=str)
def test_half_precision_models_give_float32_estimates_close_to_float32(dtype, device):
    """The same random Transformer (prior and guide) in float32 and cast to ``dtype``: Importance and SMC log Z-hat.

    Log-probabilities are upcast to float32 before the log-softmax and every weight, log Z-hat and ESS is float32,
    so the estimates are finite and float32. Bound, from the model itself: each step log-probability moves by at
    most 2 * eps under the cast (eps = the largest change of a logit, measured on the steps of every sequence of
    the lifting), so |log P_half(z) - log P_32(z)| <= 2 eps L and the same for Q (L = the event length); each
    log weight moves by at most 4 eps L, and so does log Z-hat for the same draws. Draws may differ where the cast
    moves a sampling boundary, which the standard errors cover: the test takes 4 eps L + 3 sqrt(se_32^2 + se_h^2).
    The exact log Z of both models (enumeration) differ by at most 2 eps L. The sequence log-probabilities are
    float32 (before this was checked, LMSequence.log_prob of a bf16 LM summed in bf16: its exact log Z came out
    as -23.125, a bf16 number, instead of -23.1046)."""
    x = "a b"
    m32, g32 = _half_problem(torch.float32, device)
    mh, gh = _half_problem(dtype, device)
    support, _ = m32.enumerate_log_joint(x)
    L = support.shape[1]
    with torch.no_grad():
        bos = torch.full((support.shape[0], 1), pt.vocab.BOS_ID, device=device)
        inp = torch.cat([bos, support.to(device)], 1)
        eps = max(float((a(inp)[0].float() - b(inp)[0].float()).abs().max())
                  for a, b in ((m32.prior, mh.prior), (g32.lm, gh.lm)))
    bound = 2 * eps * L
    assert mh.z_dist(2).log_prob(support.to(device)).dtype == torch.float32
    assert gh.log_prob(gh.sample(x, 4), x).dtype == torch.float32
    exact32, exacth = float(m32.exact_log_prob(x)), float(mh.exact_log_prob(x))
    assert abs(exacth - exact32) <= bound, (exacth, exact32, bound)
    for engine in (pt.infer.Importance(64), pt.infer.SMC(64, ess_threshold=0.5)):
        pyro.set_rng_seed(0)
        r32 = engine.run(m32, g32, x)
        pyro.set_rng_seed(0)
        rh = engine.run(mh, gh, x)
        for r in (r32, rh):
            assert r.log_weights.dtype == torch.float32 and r.log_marginal.dtype == torch.float32
            assert not torch.isnan(r.log_weights).any() and math.isfinite(float(r.log_marginal))
            assert math.isfinite(float(r.ess))
        se = math.hypot(_se(r32), _se(rh))
        assert abs(float(rh.log_marginal) - float(r32.log_marginal)) <= 2 * bound + 3 * se, \
            (type(engine).__name__, float(rh.log_marginal), float(r32.log_marginal), eps, se)
        assert abs(float(rh.log_marginal) - exacth) <= 4 * max(_se(rh), 0.05)


def _se(r) -> float:
    """The delta-method SE of log Z-hat (Importance); for SMC with resampling the same formula on the final
    weights understates it, so at least 0.05."""
    w = torch.softmax(r.log_weights.double(), 0)
    n = w.numel()
    return max(float(((w * n - 1) ** 2).mean().sqrt() / math.sqrt(n)), 0.05)


@pytest.mark.parametrize("model,guide", [("slow_thinking", "causal"), ("user_program", "user")])
def test_results_convert_and_save_on_the_host(model, guide, device, tmp_path):
    """ArviZ conversion and ``save_result`` move a device Result to the host (under the meta default device
    too): the Result itself keeps its tensors on the device."""
    from ppl_thought.diagnostics import to_inference_data
    from ppl_thought.inference.result import load_result, save_result

    m, g, args = MODELS[model](device, guide)
    with meta_default():
        res = run_engine("smc", m, g, args, device)
        idata = to_inference_data(res)
        save_result(tmp_path / "r", res)
        back = load_result(tmp_path / "r")
    assert res.log_weights.device.type == torch.device(device).type
    assert back.log_weights.device.type == "cpu" and torch.equal(back.log_weights, res.log_weights.cpu())
    assert float(idata.posterior.attrs["log_marginal"]) == pytest.approx(float(res.log_marginal))
