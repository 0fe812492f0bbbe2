"""Regression tests for the reliability issue's defects (bad input and edge cases), one per defect."""

import math

import numpy as np
import pyro
import pyro.distributions as dist
import pytest
import torch

import ppl_thought as pt
from ppl_thought.errors import ArgumentTypeError, PPLThoughtError

VOCAB = pt.Vocab(["a", "b"])


def _model(lm=None):
    proj = pt.projections.PauseToThink(VOCAB, max_thought_len=1)
    g = torch.Generator().manual_seed(0)
    lm = lm if lm is not None else pt.lm.Tabular(2, len(VOCAB), torch.randn(len(VOCAB), len(VOCAB), generator=g),
                                                trainable=False)
    return pt.models.SlowThinking(lm, proj)


class _Twisted(pt.Program):
    """No observations (log Z = 0); a twist that is -inf for the even particles at every step."""

    def init(self, state):
        state["i"] = torch.arange(pt.particles())

    def step(self, state, t):
        pyro.sample(f"z_{t}", dist.Bernoulli(0.5 * torch.ones(pt.particles())))
        pt.twist(torch.where(state["i"] % 2 == 0, float("-inf"), 0.0))
        return torch.ones(pt.particles(), dtype=torch.bool) if t == 2 else None


def test_a_minus_inf_twist_stays_minus_inf_never_nan():
    """(defect 2) psi - prev_psi with -inf - -inf was NaN: the weights must be -inf or finite."""
    r = pt.infer.SMC(8, ess_threshold=0.0).run(_Twisted(), None)
    assert not torch.isnan(r.log_weights).any()
    assert torch.isneginf(r.log_weights[0::2]).all() and torch.isfinite(r.log_weights[1::2]).all()


def test_float64_models_sample_score_and_run_smc():
    """(defect 3) a float64 LM: sampling, scoring and SMC work; log-probabilities come out finite."""
    torch.manual_seed(0)
    lm = pt.lm.Transformer(len(VOCAB), d_model=16, n_layers=1, n_heads=2).double()
    model = _model(lm)
    seq = pt.dist.LMSequence(lm, constraint=model.projection.domain(2), max_len=4)
    z, lp = seq.sample_with_log_prob((16,))
    assert torch.isfinite(lp).all()
    torch.testing.assert_close(seq.log_prob(z).float(), lp.float(), atol=1e-5, rtol=1e-5)
    r = pt.infer.SMC(256).run(model, None, "ab")
    assert abs(float(r.log_marginal) - float(model.exact_log_prob("ab"))) < 0.3


def test_the_empty_observation_has_its_exact_log_prob():
    """(defect 4) Importance on x = "" crashed in the projection's log_prob (reshape of 0 elements)."""
    model = _model()
    exact = float(model.exact_log_prob(""))
    for engine in (pt.infer.Importance(16), pt.infer.SMC(16)):
        assert math.isclose(float(engine.run(model, None, "").log_marginal), exact, abs_tol=1e-6)


def test_vocab_refuses_bad_specials_with_a_library_error():
    """(defect 11) duplicate and whitespace-containing specials were accepted."""
    for specials in (["<x>", "<x>"], ["<a b>"], [""]):
        with pytest.raises(PPLThoughtError, match="special"):
            pt.Vocab(["a"], specials=specials)
    with pytest.raises(PPLThoughtError, match="twice"):
        pt.Vocab(["a", "a"])


def test_tabular_refuses_nan_and_plus_inf_logits():
    """(defect 6) +inf logits were accepted (softmax of +inf is NaN)."""
    for bad in (float("nan"), float("inf")):
        logits = torch.zeros(len(VOCAB), len(VOCAB))
        logits[2, 3] = bad
        with pytest.raises(PPLThoughtError, match=r"NaN or \+inf"):
            pt.lm.Tabular(2, len(VOCAB), logits)


def _robustness():
    """benchmarks/robustness.py as a module (its bad-input table and its kill loop are the tests' too)."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.spec_from_file_location("robustness", Path(__file__).parent.parent / "benchmarks"
                                                  / "robustness.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_killed_while_overwriting_the_folder_still_loads(request):
    """(defect 1) SIGKILL at random moments while a writer overwrites one checkpoint folder (and one saved
    result) in a loop: every time the folder loads, with the tensors of its own config (config.json is the
    commit point). Before, the tensors were replaced before the config, and a kill in between left a folder
    whose SHA check failed (the old writer fails this test)."""
    kills = 25 if request.config.getoption("--slow") else 4
    out = _robustness().kill_loop(kills)
    assert out == {"tried": 2 * kills, "unloadable": 0}


def test_checkpoint_configs_that_point_outside_or_lack_keys_get_a_clear_error(tmp_path):
    """(defect 10) a config naming ../file, missing keys or bad JSON gave KeyError / JSONDecodeError."""
    import json

    from ppl_thought import io
    from ppl_thought.errors import CheckpointError

    path = io.save_checkpoint(tmp_path / "ck", {"w": torch.ones(2)}, {"a": 1})
    cfg = path / "config.json"
    header = json.loads(cfg.read_text())
    cases = {
        "plain file name": {**header, "tensors": {**header["tensors"], "file": "../x.safetensors"}},
        "lacks tensors": {k: v for k, v in header.items() if k != "tensors"},
        "lacks tensors.sha256": {**header, "tensors": {"file": header["tensors"]["file"]}},
    }
    for message, bad in cases.items():
        cfg.write_text(json.dumps(bad))
        with pytest.raises(CheckpointError, match=message):
            io.load_checkpoint(path)
    cfg.write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        io.load_checkpoint(path)


def test_divergences_refuse_nan_log_probabilities():
    """(defect 8) chi2 of NaN log-probabilities returned 0.0."""
    from ppl_thought.diagnostics import chi2, kl
    from ppl_thought.errors import DiagnosticError

    lp = torch.tensor([-0.5, -1.0]).log_softmax(0)
    for bad in (torch.tensor([float("nan"), -0.1]), torch.tensor([float("inf"), -0.1])):
        for f in (chi2, kl):
            with pytest.raises(DiagnosticError, match="NaN or"):
                f(lp, bad)
            with pytest.raises(DiagnosticError, match="NaN or"):
                f(bad, lp)
    assert chi2(lp, lp) == 0.0 and kl(lp, lp) == 0.0


def test_cli_argument_errors_are_messages_not_tracebacks(tmp_path, capsys):
    """(defect 9) bad arguments to the main job: a usage message and exit status 2, never a traceback;
    an unwritable output folder is found before the run, not after it."""
    from ppl_thought.cli import main

    for argv in (["demo", "--n", "0"], ["demo", "--seeds", "-1"], ["demo", "--n", "many"], ["demo", "--threads", "0"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "ppl-thought demo: error" in err
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    assert main(["demo", "--out", str(blocker / "out")]) == 2
    assert "cannot write the output folder" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and pt.__version__ in capsys.readouterr().out


def test_the_demo_keeps_its_numbers_when_plotting_fails(tmp_path, monkeypatch):
    """(defect 9) results.json was written after the plots: a plotting failure lost the numbers."""
    import json

    from ppl_thought import demo

    def no_plots(results, out):
        raise RuntimeError("no display")

    monkeypatch.setattr(demo, "_plots", no_plots)
    monkeypatch.setattr(demo, "run_a5", lambda cfg, seed, progress: {"excess": 0.5, "_arrays": {}})
    monkeypatch.setattr(demo, "PRINTERS", {name: (lambda results: None) for name in demo.PRINTERS})
    res = demo.run_demo(out=str(tmp_path), quick=True, parts=("a5",), progress=False)
    saved = json.loads((tmp_path / "results.json").read_text())
    assert saved["a5"]["excess"] == 0.5 and "plots: RuntimeError: no display" in saved["errors"]
    assert res["errors"] == saved["errors"]


def test_nan_parameters_raise_instead_of_returning_nan():
    """(defect 6) NaN parameters gave NaN exact_log_prob / LMSequence.log_prob without complaint."""
    from ppl_thought.errors import NumericalError

    torch.manual_seed(0)
    lm = pt.lm.Transformer(len(VOCAB), d_model=16, n_layers=1, n_heads=2)
    model = _model(lm)
    seq = pt.dist.LMSequence(lm, constraint=model.projection.domain(2), max_len=4)
    z, _ = seq.sample_with_log_prob((4,))
    with torch.no_grad():
        lm.norm.weight[0] = float("nan")  # every position reads it
    with pytest.raises(NumericalError, match="norm.weight"):
        seq.log_prob(z)
    with pytest.raises(NumericalError):
        seq.sample_with_log_prob((4,))
    with pytest.raises(NumericalError):
        model.exact_log_prob("ab")
    with pytest.raises(NumericalError):
        pt.infer.SMC(8).run(model, None, "ab")


def test_a_guide_on_another_vocabulary_or_projection_is_refused():
    """(defect 5) a guide built on another Vocab or projection ran and returned meaningless numbers."""
    from ppl_thought.errors import SiteMismatchError

    model = _model()
    lm = pt.lm.Tabular(2, len(VOCAB), torch.zeros(len(VOCAB), len(VOCAB)), trainable=False)
    other_vocab = pt.Vocab(["b", "a"])
    cases = {
        "vocabulary": pt.projections.PauseToThink(other_vocab, max_thought_len=1),
        "max_thought_len": pt.projections.PauseToThink(VOCAB, max_thought_len=2),
        "projection": pt.projections.SparseThoughts(VOCAB, thought_len=1, positions=[0]),
    }
    for message, proj in cases.items():
        guide = pt.guides.Causal(lm, proj)
        for engine in (pt.infer.Importance(8), pt.infer.SMC(8)):
            with pytest.raises(SiteMismatchError, match=message):
                engine.run(model, guide, "ab")
    same = pt.projections.PauseToThink(VOCAB, max_thought_len=1)  # equal, though another object: fine
    assert torch.isfinite(pt.infer.Importance(64).run(model, pt.guides.Causal(lm, same), "ab").log_marginal)


def test_vocab_decode_encode_round_trips():
    """(defect 11) decode -> encode was not the identity when ordinary characters spell a special."""
    import random

    rng = random.Random(0)
    alphabets = [list("ab"), list("<s>a"), list("</>se"), ["ab", "a", "b", "<", ">"], ["x", "xy", "y<", ">"]]
    for tokens in alphabets:
        v = pt.Vocab(tokens)
        ids = list(range(v.num_specials, len(v))) + [v.think_id, v.end_think_id, v.eos_id]
        for _ in range(300):
            seq = [rng.choice(ids) for _ in range(rng.randint(0, 8))]
            assert v.encode(v.decode(seq)) == seq, (tokens, seq, v.decode(seq))


def test_a_model_is_saved_and_loaded_with_its_vocabulary(tmp_path):
    """(item 14) the vocabulary was not saved with a model: its ids could not be read back as tokens."""
    from ppl_thought.errors import VocabularyError

    vocab = pt.Vocab(["a", "b", "<x>"], specials=("<x2>",))
    torch.manual_seed(0)
    lm = pt.lm.Transformer(len(vocab), d_model=16, n_layers=1, n_heads=2)
    path = lm.save(tmp_path / "m", vocab=vocab)
    back, v2 = pt.lm.Transformer.load(path), pt.lm.Transformer.load_vocab(path)
    assert v2 == vocab and v2.specials == vocab.specials
    ids = torch.tensor([[1, 6, 7, 8]])
    torch.testing.assert_close(back(ids)[0], lm(ids)[0])
    assert pt.lm.Transformer.load_vocab(lm.save(tmp_path / "plain")) is None
    with pytest.raises(VocabularyError, match="ids"):
        lm.save(tmp_path / "bad", vocab=pt.Vocab(["a"]))


def test_every_bad_input_of_the_robustness_benchmark_gets_a_clear_error():
    """benchmarks/robustness.py's table of bad inputs, without its kill loop: each answer is a library error
    that names the problem (the benchmark's JSON reports the same classification)."""
    mod = _robustness()
    answers = {name: mod.classify(call, phrase) for name, call, phrase in mod.CASES}
    bad = {name: a for name, a in answers.items() if a[0] != "clear"}
    assert not bad, bad
    assert len(answers) >= 40


# ------------------------------------------------------------------------------------------------ defect 7
def _tf(max_len: int, seed: int = 0):
    torch.manual_seed(seed)
    return pt.lm.Transformer(len(VOCAB), d_model=16, n_layers=1, n_heads=2, max_len=max_len)


def test_padding_alone_raises_no_max_len_error_in_scoring():
    """(defect 7) a value (or prompt) right-padded wider than the LM's context was fed with its padding, and
    the Transformer refused the padded width although every row fits; the numbers equal the unpadded ones,
    and a row that really is too long still raises."""
    from ppl_thought.errors import MalformedSequenceError
    from ppl_thought.vocab import PAD_ID

    a, b, eos = VOCAB.id("a"), VOCAB.id("b"), VOCAB.eos_id
    lm = _tf(max_len=6)
    seq = pt.dist.LMSequence(lm, max_len=12, stop=eos)
    short = torch.tensor([[a, b, eos], [b, eos, PAD_ID]])
    wide = torch.cat([short, torch.full((2, 9), PAD_ID)], 1)  # width 12 > the LM's 6 positions
    torch.testing.assert_close(seq.log_prob(wide), seq.log_prob(short))
    steps, complete = seq.step_log_probs(wide)
    assert steps.shape == (2, 12) and complete.all() and (steps[:, 3:] == 0).all()
    torch.testing.assert_close(steps.sum(-1), seq.log_prob(short))
    with pytest.raises(MalformedSequenceError, match="max_len"):
        seq.log_prob(torch.tensor([a] * 7 + [eos]))  # 8 tokens: really longer than the context
    # a shared prompt with right padding: the padding is not context
    padded_prompt = pt.dist.LMSequence(lm, prompt=torch.tensor([a, b] + [PAD_ID] * 8), max_len=3, stop=eos)
    plain_prompt = pt.dist.LMSequence(lm, prompt=torch.tensor([a, b]), max_len=3, stop=eos)
    torch.testing.assert_close(padded_prompt.log_prob(short), plain_prompt.log_prob(short))
    # batched prompts padded past the context: each row scored as on its own
    rows = torch.tensor([[a, b] + [PAD_ID] * 8, [b] + [PAD_ID] * 9])
    batched = pt.dist.LMSequence(lm, prompt=rows, max_len=3, stop=eos)
    for i, p in enumerate(([a, b], [b])):
        alone = pt.dist.LMSequence(lm, prompt=torch.tensor(p), max_len=3, stop=eos)
        torch.testing.assert_close(batched.log_prob(short)[i], alone.log_prob(short[i]))


def test_ragged_rows_are_limited_by_their_own_positions_not_the_cache_slots():
    """(defect 7) a batch of ragged rows (padded prompts, segments of different lengths) takes more cache
    slots than any row has tokens; the Transformer counted the slots. Row by row, the batched log-probs equal
    the ones of each row decoded alone."""
    from ppl_thought.distributions import LMState
    from ppl_thought.errors import MalformedSequenceError
    from ppl_thought.vocab import PAD_ID

    a, eos = VOCAB.id("a"), VOCAB.eos_id
    lm = _tf(max_len=8)
    prompts = torch.tensor([[a] * 5, [a] + [PAD_ID] * 4])
    seg = torch.tensor([[eos] + [PAD_ID] * 4, [a, a, a, a, eos]])  # rows of 7 positions; 6 + 5 slots
    state = LMState.start(lm, 2, prompt=prompts, stop_ids=torch.tensor([eos]))
    lp = state.extend(seg).log_prob
    for i in range(2):
        p, s = prompts[i][prompts[i] != PAD_ID], seg[i][seg[i] != PAD_ID]
        alone = LMState.start(lm, 1, prompt=p, stop_ids=torch.tensor([eos])).extend(s[None]).log_prob
        torch.testing.assert_close(lp[i], alone[0], atol=1e-5, rtol=1e-5)
    # rows that ended their sequence earlier take no positions while the others sample on
    for seed in range(12):
        state = LMState.start(lm, 10, stop_ids=torch.tensor([eos]))
        state.extend(torch.tensor([[a] * 6 + [eos]] * 2 + [[a] + [PAD_ID] * 6] * 8))  # 2 rows end at 7 tokens
        torch.manual_seed(seed)
        value, lp = state.segment(max_tokens=5).sample_with_log_prob()  # the others: at most 1 + 1 + 5 positions
        assert (value[:2] == PAD_ID).all() and (lp[:2] == 0).all() and torch.isfinite(lp).all()
    # the Transformer itself: valid=False tokens take slots, not positions
    toks = torch.tensor([[1, a, a, a, a, a, a, a, PAD_ID, PAD_ID], [1, a, PAD_ID, PAD_ID, PAD_ID, a, a, a, a, a]])
    valid = toks != PAD_ID
    logits, _ = lm(toks, valid=valid)
    for i in range(2):
        dense, _ = lm(toks[i][valid[i]][None])
        torch.testing.assert_close(logits[i][valid[i]], dense[0], atol=1e-5, rtol=1e-5)
    with pytest.raises(MalformedSequenceError, match="max_len"):
        lm(torch.tensor([[1] + [a] * 8, [1] + [PAD_ID] * 8]), valid=torch.tensor([[True] * 9, [True] + [False] * 8]))


def test_smc_and_importance_run_with_an_lm_context_of_the_event_length():
    """(defect 7) SMC with a guide fed each segment at its padded width (and the last token of a finished
    sequence): with the LM's max_len equal to the model's z length, every run raised a max_len error. Now the
    estimates agree with the exact log p(x) (mean of Z-hat over seeds, unbiased), and a right-padded observation
    gives the same numbers as the unpadded one."""
    from ppl_thought.vocab import PAD_ID

    proj = pt.projections.PauseToThink(VOCAB, max_thought_len=2)
    x = "ab"
    L = proj.domain(len(x)).max_len
    model = pt.models.SlowThinking(_tf(L, seed=0), proj)
    guide = pt.guides.Causal(_tf(L, seed=1), proj)
    exact = float(model.exact_log_prob(x))
    log_z = []
    for seed in range(4):
        torch.manual_seed(seed)
        log_z.append(pt.infer.SMC(256).run(model, guide, x).log_marginal)
    assert abs(float(torch.logsumexp(torch.stack(log_z), 0) - math.log(len(log_z))) - exact) < 0.05
    padded = torch.tensor(VOCAB.encode(x) + [PAD_ID] * 6)
    for engine in (pt.infer.Importance(64), pt.infer.SMC(64)):
        for g in (None, guide):
            torch.manual_seed(0)
            plain = engine.run(model, g, x).log_marginal
            torch.manual_seed(0)
            assert torch.equal(engine.run(model, g, padded).log_marginal, plain)
    z = guide.sample(x, 8)
    torch.testing.assert_close(guide.log_prob(z, padded), guide.log_prob(z, x))


# ----------------------------------------------------------------------- found by the property-based suite
def test_decode_refuses_what_is_not_one_sequence_of_integer_ids():
    """(tests/test_robustness_properties.py) decode truncated floats (6.7 -> 'a'), read True as id 1, flattened
    a 2-D batch into one string, and raised a bare ValueError on strings."""
    from ppl_thought.errors import MalformedSequenceError

    for bad in ([6.7], [True, 6], np.array([[6, 7], [7, 6]]), ["a"], [[6], [6, 7]], 6):
        with pytest.raises((MalformedSequenceError, ArgumentTypeError), match="1-D sequence of integer token ids|ids="):
            VOCAB.decode(bad)
    assert VOCAB.decode(torch.tensor([6, 0, 7])) == "ab" and VOCAB.decode([]) == ""


def test_argument_types_are_checked_not_converted():
    """(property suite) int(2.7) == 2, int("4") == 4 and True == 1 were taken silently for counts and lengths,
    and a string or NaN gave a bare TypeError / ValueError from deep inside."""
    from ppl_thought.errors import ConfigError, MalformedSequenceError

    tab = pt.lm.Tabular(2, len(VOCAB), torch.zeros(len(VOCAB), len(VOCAB)), trainable=False)
    cases = [
        (lambda: pt.infer.Importance(2.7), "num_particles"),
        (lambda: pt.infer.Importance("4"), "num_particles"),
        (lambda: pt.infer.Importance(float("nan")), "num_particles"),
        (lambda: pt.infer.SMC(True), "num_particles"),
        (lambda: pt.infer.SMC(4, ess_threshold="0.5"), "ess_threshold"),
        (lambda: pt.infer.SMC(4, ess_threshold=float("nan")), "ess_threshold"),
        (lambda: pt.infer.SMC(4, resampling=3), "resampling"),
        (lambda: pt.dist.LMSequence(tab, max_len="3"), "max_len"),
        (lambda: pt.dist.LMSequence(tab, max_len=2.5), "max_len"),
        (lambda: pt.dist.LMSequence(tab, max_len=True), "max_len"),
        (lambda: pt.dist.LMSequence(tab, max_len=3, stop=1.5), "stop"),
        (lambda: pt.lm.Tabular(2.0, len(VOCAB)), "order"),
        (lambda: pt.lm.Tabular("2", len(VOCAB)), "order"),
        (lambda: pt.lm.Tabular(2, 8.0), "vocab_size"),
        (lambda: pt.projections.PauseToThink(VOCAB, 1).lifting([[6, 6], [6]]), "1-D array of integer ids"),
    ]
    for call, phrase in cases:
        with pytest.raises((ConfigError, MalformedSequenceError), match=phrase):
            call()
    assert pt.infer.SMC(np.int64(4), ess_threshold=1).num_particles == 4  # numpy ints and int fractions are fine


def test_transformer_load_checks_the_config_against_the_tensors(tmp_path):
    """(property suite) a corrupted Transformer config gave a bare TypeError (unknown key), RuntimeError
    (tensors of another shape, a missing tensor) or, for n_layers = 10**12, built blocks until memory ran out.
    Now each is a CheckpointError found before anything is allocated."""
    import time

    from ppl_thought.errors import CheckpointError

    torch.manual_seed(0)
    lm = pt.lm.Transformer(len(VOCAB), d_model=8, n_layers=1, n_heads=2, max_len=8)
    config = {"class": "Transformer", **lm.config()}
    state = dict(lm.state_dict())
    cases = {
        "not Transformer arguments": ({**config, "knob": 1}, state),
        "n_layers=1000000000000": ({**config, "n_layers": 10 ** 12}, state),
        "does not describe the saved tensors": ({**config, "vocab_size": 10 ** 12}, state),
        "not a positive integer": ({**config, "d_model": "8"}, state),
        "cannot build a Transformer": ({**config, "n_heads": 3}, state),
        "do not match the config": (config, {k: v for k, v in state.items() if k != "norm.weight"}),
        "of another shape": (config, {**state, "norm.weight": torch.ones(9)}),
    }
    for i, (message, (cfg, st)) in enumerate(cases.items()):
        path = pt.io.save_checkpoint(tmp_path / str(i), st, cfg)
        t0 = time.perf_counter()
        with pytest.raises(CheckpointError, match=message if message != "n_layers=1000000000000" else "n_layers"):
            pt.lm.Transformer.load(path)
        assert time.perf_counter() - t0 < 5.0
    back = pt.lm.Transformer.load(pt.io.save_checkpoint(tmp_path / "ok", state, config))
    torch.testing.assert_close(back(torch.tensor([[1, 6]]))[0], lm(torch.tensor([[1, 6]]))[0])


def test_padding_takes_no_position_of_a_huggingface_model_either():
    """(defect 7, the HuggingFace adapter on main since) its max_position_embeddings bound counted cache slots;
    padding (valid=False) takes none of a row's positions, and an invalid token of a full row is never read
    (GPT-2's learned position table would have been indexed past its end)."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from ppl_thought.errors import MalformedSequenceError
    from ppl_thought.lm.huggingface import HuggingFace, random_gpt2, train_bpe_tokenizer

    tok = train_bpe_tokenizer(["abcab", "cabba", "abcabc", "bacab", "ccab"] * 4, 8, byte_level=False, alphabet="abc")
    lm = HuggingFace(random_gpt2(len(tok), n_embd=32, n_head=2, n_positions=8), tok)
    a = lm.vocab.num_specials  # an ordinary token
    pad = 0
    toks = torch.tensor([[1] + [a] * 7 + [pad, pad], [1, a, pad, pad, pad, a, a, a, a, a]])
    valid = toks != pad  # 10 slots, rows of 8 and 7 positions
    with torch.no_grad():
        logits, _ = lm(toks, valid=valid)
        for i in range(2):
            dense, _ = lm(toks[i][valid[i]][None])
            torch.testing.assert_close(logits[i][valid[i]], dense[0], atol=1e-4, rtol=1e-4)
        with pytest.raises(MalformedSequenceError, match="max_position_embeddings"):
            lm(torch.tensor([[1] + [a] * 8, [1] + [pad] * 8]), valid=torch.tensor([[True] * 9, [True] + [False] * 8]))
