"""The layout's promises (docs/architecture.md): shared layers import no framework, imports flow downward."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest

BLOCK = """
import sys
class _Block:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in {blocked!r}:
            raise ImportError("blocked by the test: " + name)
sys.meta_path.insert(0, _Block())
"""


def run_blocked(blocked: set[str], body: str) -> subprocess.CompletedProcess:
    code = BLOCK.format(blocked=blocked) + textwrap.dedent(body)
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)


def test_shared_layers_import_without_torch():
    """Vocabularies, projections, token automata and character automata are numpy only: the JAX backend
    reads the same tables. (Fails if any of them imports torch or pyro, even indirectly.)"""
    r = run_blocked({"torch", "pyro"}, """
        import ppl_thought as pt
        from ppl_thought.projections import PauseToThink, CharDFA, token_automaton, token_texts
        v = pt.Vocab(["a", "b"])
        A = PauseToThink(v, 2).lifting(v.encode(list("ab")))
        s = A.start_states(3)
        assert type(s).__module__ == "numpy", type(s)
        print("ok", A.num_states)
    """)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.startswith("ok")


def test_blocking_works():
    """The blocker itself: importing the torch side with torch blocked must fail."""
    r = run_blocked({"torch"}, "import ppl_thought.lm")
    assert r.returncode != 0 and "blocked by the test" in r.stderr


def test_automaton_tables_in_each_framework():
    """One numpy table, stepped as numpy, torch and jax arrays with the same results."""
    torch = pytest.importorskip("torch")
    import ppl_thought as pt
    from ppl_thought.projections import PauseToThink

    v = pt.Vocab(["a", "b"])
    A = PauseToThink(v, 2).lifting(v.encode(list("abba")))
    rng = np.random.default_rng(0)
    s_np = A.start_states(64)
    s_t = A.start_states(64, "cpu")
    assert isinstance(s_t, torch.Tensor) and s_t.dtype == torch.long
    arrays = [(s_np, lambda a: a), (s_t, torch.as_tensor)]
    try:
        import jax.numpy as jnp

        arrays.append((A.start_states(64, jnp.zeros(1)), jnp.asarray))
    except ImportError:
        pass
    # host start states read with torch tokens come back as torch (user programs: start_states(n), then step)
    first = A.step(s_np, torch.as_tensor(rng.integers(0, A.vocab_size, 64)))
    assert isinstance(first, torch.Tensor) and first.dtype == torch.long
    assert isinstance(A.advance(s_np, torch.zeros(64, dtype=torch.long)), torch.Tensor)
    for _ in range(6):
        tok = rng.integers(0, A.vocab_size, 64)
        ref = A.step(s_np, tok)
        for i, (s, conv) in enumerate(arrays):
            nxt = A.step(s, conv(tok))
            assert (np.asarray(nxt) == ref).all()
            assert (np.asarray(A.mask(nxt)) == A.mask(ref)).all()
            assert (np.asarray(A.is_final(nxt)) == A.is_final(ref)).all()
            assert (np.asarray(A.num_emitted(nxt)) == A.num_emitted(ref)).all()
            arrays[i] = (nxt, conv)
        s_np = ref


def test_imports_flow_downward():
    """tools/import_map.py: vocab -> projections -> lm -> distributions -> models/guides -> inference ->
    diagnostics -> experiments -> cli, nothing upward, no framework in the shared layers."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([sys.executable, str(root / "tools" / "import_map.py")], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert " 0 upward imports" in r.stdout
