"""Tests of the concrete projections (Section 2.6, Ex 2.1-2.4, Remark 2.8, Section 5.1).

The ground truth is a brute-force search that uses only ``_project_one`` (the prefix projection
Proj^{<w} of Def 2.6, written as a direct scan in each class) and the definition of the lifting
(Prop 2.3): z is in the lifting of x iff x is a prefix of Proj^{<w}(z) and of no Proj^{<w}(z')
for a proper prefix z' of z. The automata are checked against it, and ``_project_one`` itself is checked
against an independent reference written from the paper's definitions as regular expressions (end of the file).
"""

from __future__ import annotations

import itertools
from functools import cache

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ppl_thought.errors import NotInDomainError, NotInImageError, NotRegularError, UnknownTokenError
from ppl_thought.projections import (
    Automaton,
    AutomatonBuilder,
    FirstTokenSwitch,
    Identity,
    PauseToThink,
    Product,
    Projection,
    QueryResponse,
    SparseThoughts,
    exponential_schedule,
)
from ppl_thought.vocab import Vocab

V2 = Vocab(["a", "b"])
A, B = V2.id("a"), V2.id("b")
EOS, S_, ES = V2.eos_id, V2.think_id, V2.end_think_id

PROJECTIONS: dict[str, Projection] = {
    "identity": Identity(V2),
    "product": Product.build(["a", "b", "<eos>"], ["g", "h"]),
    "pause1": PauseToThink(V2, max_thought_len=1),
    "pause2": PauseToThink(V2, max_thought_len=2),
    "sparse_exp": SparseThoughts(V2, thought_len=1),
    "sparse_set": SparseThoughts(V2, thought_len=2, positions={1}),
    "sparse_odd": SparseThoughts(V2, thought_len=1, positions=lambda t: t % 2 == 1),
    "qr0": QueryResponse(V2, max_thought_len=0),
    "qr2": QueryResponse(V2, max_thought_len=2),
    "switch": FirstTokenSwitch(V2, "a", horizon=8),
    "switch_eos": FirstTokenSwitch(V2, "<eos>", horizon=8),
}
NAMES = sorted(PROJECTIONS)
NMAX = 3  # |x| <= 3 for the brute force


def nmax(name: str) -> int:
    return NMAX


def is_prefix(u: tuple, w: tuple) -> bool:
    return len(u) <= len(w) and tuple(w[: len(u)]) == tuple(u)


def proj_of(p: Projection, z) -> tuple[int, ...]:
    return tuple(p._project_one(np.asarray(z, dtype=np.int64)).tolist())


def sigma_strings(p: Projection, n: int) -> list[tuple[int, ...]]:
    sig = p.observable_ids.tolist()
    return [tuple(x) for x in itertools.product(sig, repeat=n)]


@cache
def explore(name: str):
    """Depth-first search of Dom(Proj^{<w}) by ``_project_one`` alone.

    Returns ``nodes``: z -> (Proj^{<w}(z), admissible next tokens or None when not expanded),
    for every z in the domain whose proper prefixes all determine fewer than nmax observables;
    and ``lift``: x -> set of z (the lifting by its definition), for all x with |x| <= nmax.
    """
    p, n = PROJECTIONS[name], nmax(name)
    V = len(p.vocab)
    nodes: dict[tuple, tuple] = {}
    lift: dict[tuple, set] = {x: set() for k in range(n + 1) for x in sigma_strings(p, k)}
    stack = [((), proj_of(p, ()), ())]  # (z, Proj^{<w}(z), projections of proper prefixes)
    while stack:
        z, pz, anc = stack.pop()
        for x in lift:
            if is_prefix(x, pz) and not any(is_prefix(x, q) for q in anc):
                lift[x].add(z)
        kids = None
        if len(pz) < n:
            assert len(z) < 40, "the search does not terminate: a bug in _project_one"
            kids = []
            for a in range(V):
                try:
                    pa = proj_of(p, z + (a,))
                except NotInDomainError:
                    continue
                assert is_prefix(pz, pa), "Proj^{<w} must be monotone (Def 2.6)"
                kids.append(a)
                stack.append((z + (a,), pa, anc + (pz,)))
        nodes[z] = (pz, kids)
    return nodes, lift


def domain_or_none(p: Projection) -> Automaton | None:
    try:
        return p.domain()
    except NotRegularError:
        return None


def walk(a: Automaton, rng: np.random.Generator, max_steps: int = 500) -> list[int]:
    """A random walk on the admissible tokens until a final state (or max_steps)."""
    s, z = a.start, []
    while not a.final[s] and len(z) < max_steps:
        allowed = np.nonzero(a.allowed[s])[0]
        assert allowed.size, f"{a.name}: dead end after {z}"
        t = int(rng.choice(allowed))
        z.append(t)
        s = int(a.next_state[s, t])
    return z


# --------------------------------------------------------------------------------- liftings
@pytest.mark.parametrize("name", NAMES)
def test_lifting_equals_brute_force(name):
    p = PROJECTIONS[name]
    _, lift = explore(name)
    for x, ref in lift.items():
        a = p.lifting(np.array(x, dtype=np.int64))
        got = p.enumerate_lifting(np.array(x, dtype=np.int64))
        assert len(got) == len(set(got))
        assert set(got) == ref, (name, p.vocab.decode(x))
        assert a.count() == len(ref)
        assert a.max_len == max(len(z) for z in ref)
        # a final state admits no token (the lifting is prefix-free), and emitted = |Proj^{<w}| capped
        assert not a.allowed[a.final].any()
        for z in ref:
            states = a.run(z)
            for k in range(len(z) + 1):
                assert a.emitted[states[k]] == min(len(proj_of(p, z[:k])), len(x))
            assert a.final[states[-1]] and not a.final[states[:-1]].any()


@pytest.mark.parametrize("name", NAMES)
def test_domain_masks_equal_admissible_tokens(name):
    """Masks of domain() and domain(n) are Phi^{<=1}(z) of (2.26); emitted = |Proj^{<w}(z)| capped."""
    p, n = PROJECTIONS[name], nmax(name)
    nodes, _ = explore(name)
    dom, dom_n = domain_or_none(p), p.domain(num_observed=n)
    if name == "sparse_set":
        assert dom is not None and dom.max_len is None and not dom.final.any()
    for z, (pz, kids) in nodes.items():
        s = int(dom_n.run(z)[-1])
        assert s >= 0
        assert dom_n.emitted[s] == min(len(pz), n)
        if kids is None:  # determines n observables: z is minimal, so complete
            assert dom_n.final[s] and not dom_n.allowed[s].any()
            continue
        assert not dom_n.final[s]
        assert set(np.nonzero(dom_n.allowed[s])[0].tolist()) == set(kids), (name, p.vocab.decode(z))
        if dom is not None:
            sd = int(dom.run(z)[-1])
            assert set(np.nonzero(dom.allowed[sd])[0].tolist()) == set(kids)
            assert p.in_domain(np.array(z, dtype=np.int64))
        for a in set(range(len(p.vocab))) - set(kids):
            assert not p.in_domain(np.array(z + (a,), dtype=np.int64))


@pytest.mark.parametrize("name", NAMES)
def test_domain_n_accepts_union_of_liftings(name):
    p, nm = PROJECTIONS[name], nmax(name)
    _, lift = explore(name)
    for n in range(nm + 1):
        union = set().union(*(lift[x] for x in sigma_strings(p, n)))
        d = p.domain(num_observed=n)
        acc = d.enumerate()
        assert set(acc) == union and len(acc) == len(union)
        assert d.max_len == max(len(z) for z in union)
        assert not d.allowed[d.final].any()


# --------------------------------------------------------------------------------- segments, Phi
@cache
def phi_table(name: str) -> dict:
    """Phi_x(z, a) of (2.20) from the brute-force liftings: (x, z, a) -> set of segments.

    Also checks the disjoint union after (2.20): every z' in the lifting of xa has exactly one
    prefix in the lifting of x.
    """
    _, lift = explore(name)
    table: dict = {}
    for x, zs in lift.items():
        if len(x) >= nmax(name):
            continue
        for a in PROJECTIONS[name].observable_ids.tolist():
            for z in zs:
                table[(x, z, a)] = set()
            for w in lift[x + (a,)]:
                owners = [w[:k] for k in range(len(w) + 1) if w[:k] in zs]
                assert len(owners) == 1, (name, x, a, w)
                table[(x, owners[0], a)].add(w[len(owners[0]) :])
    return table


@cache
def next_segments_cached(name: str, x: tuple, z: tuple, a: int) -> frozenset:
    return frozenset(PROJECTIONS[name].next_segments(x, z, a))


@pytest.mark.parametrize("name", NAMES)
def test_segments_decompose_uniquely(name):
    p = PROJECTIONS[name]
    _, lift = explore(name)
    phi = phi_table(name)
    for x, zs in lift.items():
        for z in zs:
            segs = p.segments(np.array(z, dtype=np.int64), np.array(x, dtype=np.int64))
            assert len(segs) == len(x)
            assert tuple(itertools.chain.from_iterable(segs)) == z
            for t in range(len(x)):
                prefix = tuple(itertools.chain.from_iterable(segs[:t]))
                ph = phi[(x[:t], prefix, x[t])]
                assert segs[t] in ph
                # unique (Lemma 2.1): no other segment of Phi fits the rest of z
                rest = z[len(prefix) :]
                assert [s for s in ph if rest[: len(s)] == s] == [segs[t]]
                assert next_segments_cached(name, x[:t], prefix, x[t]) == ph


def test_segments_remark_2_8():
    p = PROJECTIONS["switch"]
    assert p.segments("a", "aaa") == [(A,), (), ()]
    assert p.segments("baab", "aab") == [(B, A), (A,), (B,)]
    # x defaults to Proj^{<w}(z), here r^w truncated to the horizon
    assert p.segments("a") == [(A,)] + [()] * (p.horizon - 1)


@pytest.mark.parametrize("name", NAMES)
def test_is_disentangled_by_brute_force(name):
    """Def 3.5: Phi_x(z, a) is the same set for every z in the lifting of x."""
    p = PROJECTIONS[name]
    _, lift = explore(name)
    disentangled = True
    for k in range(nmax(name)):
        for x in sigma_strings(p, k):
            sizes = set()
            for a in p.observable_ids.tolist():
                phis = {frozenset(phi_table(name)[(x, z, a)]) for z in lift[x]}
                disentangled &= len(phis) == 1
                sizes |= {len(s) for s in phis}
            disentangled &= len(sizes) == 1  # Phi_x(z, a) ~ S(x) x {a}
    assert p.is_disentangled == disentangled
    expected = {"switch": False, "switch_eos": False}.get(name, True)
    assert disentangled == expected


def test_remark_2_8_phi():
    p = PROJECTIONS["switch"]
    assert p.next_segments("a", "a", A) == [()]
    assert p.next_segments("a", "ba", A) == [(A,)]
    assert sorted(p.enumerate_lifting("aaa")) == sorted([(A,), (B, A, A, A), (EOS, A, A, A)])
    assert sorted(p.enumerate_lifting("ab")) == sorted([(B, A, B), (EOS, A, B)])
    assert p.enumerate_lifting("") == [()]
    lift = p.lifting("aaa")
    s = lift.step(lift.start, A)
    assert lift.emitted[s] == 3 and lift.final[s]


# --------------------------------------------------------------------------------- automata, hypothesis
xs = st.lists(st.integers(0, 2), max_size=6)


def to_sigma(p: Projection, idx: list[int]) -> np.ndarray:
    sig = p.observable_ids
    return sig[np.asarray(idx, dtype=np.int64) % len(sig)] if idx else np.zeros(0, dtype=np.int64)


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(NAMES), idx=xs, seed=st.integers(0, 2**32 - 1))
def test_batched_step_agrees_with_run(name, idx, seed):
    p = PROJECTIONS[name]
    rng = np.random.default_rng(seed)
    lift = p.lifting(to_sigma(p, idx))
    for a in (lift, p.domain(num_observed=len(idx)), domain_or_none(p)):
        if a is None:
            continue
        zs = [walk(a, rng, max_steps=12) for _ in range(4)]
        zs += [rng.integers(0, a.vocab_size, size=rng.integers(0, 10)).tolist() for _ in range(4)]
        zs += [z[:-1] + [int(rng.integers(0, a.vocab_size))] for z in zs[:4] if z]
        T = max(len(z) for z in zs)
        Z = np.zeros((len(zs), T), dtype=np.int64)
        for i, z in enumerate(zs):
            Z[i, : len(z)] = z
        lens = np.array([len(z) for z in zs])
        runs = [a.run(z) for z in zs]
        s_np = np.full(len(zs), a.start)
        s_t = a.start_states(len(zs), "cpu")
        for t in range(T + 1):
            want = np.array([r[min(t, len(r) - 1)] for r in runs])
            assert (s_np == want).all() and (s_t.numpy() == want).all()
            m = a.mask(s_np)
            assert (a.mask(s_t).numpy() == m).all()
            assert (m == np.where((want >= 0)[:, None], a.allowed[want], False)).all()
            assert (a.is_final(s_np) == a.is_final(s_t).numpy()).all()
            assert (a.num_emitted(s_np) == a.num_emitted(s_t).numpy()).all()
            if t == T:
                break
            active = t < lens
            s_np = np.where(active, a.step(s_np, Z[:, t]), s_np)
            s_t = torch.where(torch.as_tensor(active), a.step(s_t, torch.as_tensor(Z[:, t])), s_t)


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(NAMES), idx=xs, seed=st.integers(0, 2**32 - 1))
def test_lifting_walks_project_to_x(name, idx, seed):
    p = PROJECTIONS[name]
    rng = np.random.default_rng(seed)
    x = tuple(to_sigma(p, idx).tolist())
    lift = p.lifting(np.array(x, dtype=np.int64))
    for _ in range(5):
        z = walk(lift, rng)
        s = int(lift.run(z)[-1])
        assert lift.final[s] and not lift.allowed[s].any()
        px = proj_of(p, z)
        assert is_prefix(x, px) and (px == x or isinstance(p, FirstTokenSwitch))
        assert not any(is_prefix(x, proj_of(p, z[:k])) for k in range(len(z)))  # minimal
        assert len(z) <= lift.max_len


@settings(max_examples=60, deadline=None)
@given(name=st.sampled_from(NAMES), n=st.integers(0, 7), seed=st.integers(0, 2**32 - 1))
def test_domain_walks_project_to_length_n(name, n, seed):
    p = PROJECTIONS[name]
    rng = np.random.default_rng(seed)
    d = p.domain(num_observed=n)
    for _ in range(5):
        z = walk(d, rng)
        assert d.is_final(int(d.run(z)[-1]))
        px = proj_of(p, z)
        if isinstance(p, FirstTokenSwitch) and z[:1] == [p.repeat_id]:
            assert z == [p.repeat_id] and len(px) == p.horizon
        else:
            assert len(px) == n
        assert p.lifting(np.array(px[:n], dtype=np.int64)).accepts(z)


# --------------------------------------------------------------------------------- per-example facts
def test_pause_to_think_masks_by_hand():
    p = PROJECTIONS["pause2"]
    d = p.domain()
    sigma = {EOS, A, B}

    def allowed(z):
        return set(np.nonzero(d.mask(int(d.run(V2.encode(z))[-1])))[0].tolist())

    assert allowed("") == sigma | {S_}
    assert allowed("a") == sigma | {S_}
    assert allowed("<s>") == {A, B}
    assert allowed("<s>a") == {A, B, ES}
    assert allowed("<s>ab") == {ES}
    assert allowed("<s>ab</s>") == sigma
    assert allowed("<s>a</s><eos>") == sigma | {S_}
    assert d.max_len is None and not d.final.any()
    d2 = p.domain(num_observed=2)
    assert d2.max_len == 2 * (2 + 3)
    assert d2.is_final(int(d2.run(V2.encode("<s>a</s>ab"))[-1]))


def test_lifting_sizes_and_counts():
    for c in (1, 2, 3):
        p = PauseToThink(V2, c)
        thoughts = 1 + sum(2**k for k in range(1, c + 1))
        for n in range(4):
            assert p.lifting("a" * n).count() == thoughts**n
    p = PauseToThink(V2, 8)
    x = "ab" * 25
    assert p.lifting(x).num_states <= len(x) * (8 + 3) + 1
    assert p.lifting(x).max_len == len(x) * (8 + 3)
    # Ex 2.4 is polynomially simple: (#ordinary)^(c * #positions before |x|)
    s = SparseThoughts(V2, thought_len=2)
    for n in range(17):
        k = sum(t in (0, 2, 6, 14) for t in range(n))
        assert s.num_thoughts(n) == k
        assert s.lifting("a" * n).count() == 2 ** (2 * k)
    assert s.lifting("a" * 100).num_states <= 100 + 6 * (2 + 3) + 1


def test_exponential_schedule():
    assert [t for t in range(64) if exponential_schedule(t)] == [0, 2, 6, 14, 30, 62]


def test_sparse_thoughts_domain():
    with pytest.raises(NotRegularError, match="not a regular language"):
        SparseThoughts(V2, 1).domain()
    s = SparseThoughts(V2, 1, positions=[0, 3])
    d = s.domain()
    assert d.admits_prefix(V2.encode("<s>a</s>abb<s>b</s>aaaaaaaa"))
    assert not d.admits_prefix(V2.encode("<s>a</s>abb<s>b</s>aa<s>"))
    assert not d.admits_prefix(V2.encode("a"))
    assert s.in_domain("<s>b</s>ab") and not s.in_domain("<s>b</s>a<s>")
    assert SparseThoughts(V2, 1, positions=[]).domain().admits_prefix(V2.encode("abab"))


def test_query_response_lifting_by_hand():
    p = PROJECTIONS["qr2"]
    assert p.enumerate_lifting("ab<eos>") == [tuple(V2.encode("ab<eos>"))]
    got = {V2.decode(z) for z in p.enumerate_lifting("a<eos>b")}
    assert got == {f"a<eos><s>{y}</s>b" for y in ["", "a", "b", "aa", "ab", "ba", "bb"]}
    got = {V2.decode(z) for z in p.enumerate_lifting("<eos><eos><eos>")}
    assert got == {f"<eos><s>{y}</s><eos><eos>" for y in ["", "a", "b", "aa", "ab", "ba", "bb"]}
    d = p.domain()
    st_ = int(d.run(V2.encode("a<eos>"))[-1])
    assert set(np.nonzero(d.mask(st_))[0].tolist()) == {S_}
    st_ = int(d.run(V2.encode("a<eos><s>"))[-1])
    assert set(np.nonzero(d.mask(st_))[0].tolist()) == {A, B, ES}
    st_ = int(d.run(V2.encode("a<eos><s>ab"))[-1])
    assert set(np.nonzero(d.mask(st_))[0].tolist()) == {ES}


def test_product_helpers():
    p = PROJECTIONS["product"]
    v = p.vocab
    assert p.pair_id("a", "h") == v.id("a|h") == p.pair_id(v.id("a"), 1)
    assert p.pair_id("<eos>", "g") == v.id("<eos>|g")
    assert sorted(p.observable_ids.tolist()) == sorted([v.id("a"), v.id("b"), v.eos_id])
    assert len(p.latent_ids) == 6
    assert p.latent_to_observable[v.id("b|h")] == v.id("b")
    assert p.latent_to_hidden[v.id("b|h")] == 1
    assert p.latent_to_observable[v.id("a")] == -1
    assert p.project("a|g b|h <eos>|h").tolist() == v.encode("a b <eos>")
    with pytest.raises(UnknownTokenError, match="hidden value"):
        p.pair_id("a", "zz")
    with pytest.raises(UnknownTokenError, match="pair token"):
        Product(Vocab(["a", "b", "a|g"]), ["a", "b"], ["g"])
    with pytest.raises(ValueError, match="at least two"):
        Product.build(["a"], ["g"])


# --------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("name", NAMES)
def test_errors(name):
    p = PROJECTIONS[name]
    with pytest.raises(UnknownTokenError, match="not in the vocabulary|cannot tokenize"):
        p.lifting(["a", "zzz"])
    with pytest.raises(UnknownTokenError, match="outside the vocabulary"):
        p.lifting(np.array([len(p.vocab)]))
    with pytest.raises(NotInImageError, match="non-observable"):
        p.lifting([p.vocab.think_id])
    with pytest.raises(NotInDomainError, match=type(p).__name__):
        p.project([p.vocab.end_think_id])
    with pytest.raises(NotInDomainError, match=type(p).__name__):
        p.project([p.vocab.bos_id])
    with pytest.raises(NotInDomainError, match="not in the lifting"):
        p.segments(np.zeros(0, dtype=np.int64), p.observable_ids[:1])


def test_error_messages_name_the_problem():
    with pytest.raises(NotInDomainError, match="empty thought"):
        PROJECTIONS["pause2"].project("<s></s>a")
    with pytest.raises(NotInDomainError, match="longer than max_thought_len=2"):
        PROJECTIONS["pause2"].project("<s>aba</s>")
    with pytest.raises(NotInDomainError, match="two thoughts in a row"):
        PROJECTIONS["pause2"].project("<s>a</s><s>")
    with pytest.raises(NotInDomainError, match="ordinary tokens only"):
        PROJECTIONS["pause2"].project("<s><eos>")
    with pytest.raises(NotInDomainError, match="mandatory before observable position 0"):
        PROJECTIONS["sparse_exp"].project("a")
    with pytest.raises(NotInDomainError, match="no thought is allowed before observable position 1"):
        PROJECTIONS["sparse_exp"].project("<s>a</s>a<s>")
    with pytest.raises(NotInDomainError, match="must follow each query"):
        PROJECTIONS["qr2"].project("a<eos>b")
    with pytest.raises(NotInDomainError, match="inside a query"):
        PROJECTIONS["qr2"].project("a<s>")
    with pytest.raises(NotInImageError, match="Sigma of Product"):
        PROJECTIONS["product"].lifting("a|g")
    with pytest.raises(ValueError, match=">= 1"):
        PauseToThink(V2, 0)
    with pytest.raises(UnknownTokenError, match="not observable"):
        FirstTokenSwitch(V2, "<s>")
    with pytest.raises(ValueError, match="non-negative"):
        PROJECTIONS["pause1"].domain(num_observed=-1)


# --------------------------------------------------------------------------------- batched project
@pytest.mark.parametrize("name", NAMES)
def test_project_batched(name):
    p = PROJECTIONS[name]
    rng = np.random.default_rng(0)
    d = p.domain(num_observed=3)
    zs = [walk(d, rng)[: int(rng.integers(0, 12))] for _ in range(8)]
    T = max(len(z) for z in zs)
    Z = torch.full((len(zs), T), p.vocab.pad_id, dtype=torch.long)
    for i, z in enumerate(zs):
        Z[i, : len(z)] = torch.tensor(z, dtype=torch.long)
    out = p.project(Z)
    assert isinstance(out, list) and len(out) == len(zs)
    for o, z in zip(out, zs):
        assert o.dtype == np.int64 and o.tolist() == list(proj_of(p, z))
    out2 = p.project([np.array(z, dtype=np.int64) for z in zs])
    assert [o.tolist() for o in out2] == [o.tolist() for o in out]
    assert p.project(Z.numpy())[0].tolist() == out[0].tolist()


def test_builder_still_works_with_projection_automata():
    b = AutomatonBuilder(len(V2))
    s0, s1 = b.add_state(), b.add_state(final=True, emitted=1)
    b.edge(s0, np.array([A, B]), s1)
    a = b.build(s0, 1)
    assert a.enumerate() == [(A,), (B,)]


def test_lifting_is_cached_per_observation_and_still_checked():
    from ppl_thought.errors import NotInImageError
    from ppl_thought.projections import PauseToThink
    from ppl_thought.vocab import Vocab

    proj = PauseToThink(Vocab(["a", "b"]), max_thought_len=1)
    a1, a2, b = proj.lifting("ab"), proj.lifting("ab"), proj.lifting("ba")
    assert a1 is a2 and b is not a1
    with pytest.raises(NotInImageError):
        proj.lifting(["<s>"])


def test_automaton_tables_of_text_floats_or_0d_get_a_config_error_naming_the_field():
    """Found by the public sweep: Automaton(tensor(nan), ...) raised IndexError (a 0-d table), Automaton('', ...)
    int('')'s ValueError; a float table 1.5 was cast to state 1 silently."""
    from ppl_thought.errors import ConfigError

    ok = Automaton(np.array([[-1, 0]]), np.array([True]), np.array([0]))
    assert ok.num_states == 1
    with pytest.raises(ConfigError, match="next_state must be an array of integers"):
        Automaton("", np.array([True]), np.array([0]))
    with pytest.raises(ConfigError, match="next_state must hold integers"):
        Automaton(np.array([[-1.0, 0.5]]), np.array([True]), np.array([0]))
    with pytest.raises(ConfigError, match="non-empty \\[S, V\\] table"):
        Automaton(torch.tensor(0), np.array([True]), np.array([0]))
    with pytest.raises(ConfigError, match="final and emitted"):
        Automaton(np.array([[-1, 0]]), np.array([True, False]), np.array([0]))
    with pytest.raises(ConfigError, match="start"):
        Automaton(np.array([[-1, 0]]), np.array([True]), np.array([0]), start=2)


# --------------------------------------------------------------------------- an independent reference
# The brute force above trusts ``_project_one``. Here each projection's prefix map Proj^{<w} and its domain of
# prefixes are written a second time from the paper's definitions, as regular expressions over a one-character-
# per-token spelling of z (Ex 2.1 identity, Ex 2.2 product, Ex 2.3 pause-to-think with thoughts of ordinary
# tokens, Section 5.1's query-response format, Ex 2.4 sparse thoughts at chosen positions, Remark 2.8's switch),
# and compared with ``_project_one`` on every z of length <= 5 over the tokens that matter (plus one foreign token).
# Thoughts are written ``[`` ... ``]``; ``o`` stands for an observable token, ``y`` for a thought token.

import re  # noqa: E402

_SPELL = {"a": "a", "b": "b", "<eos>": "e", "<s>": "[", "</s>": "]", "<explain>": "x"}


def _spell(vocab: Vocab, z: tuple[int, ...]) -> str:
    return "".join(_SPELL[vocab.token(t)] for t in z)


def _strip_thoughts(s: str) -> str:
    """Proj^{<w} of a thought format: every complete or still open thought deleted (Ex 2.3, 2.4, Section 5.1)."""
    return re.sub(r"\[[^\]]*\]?", "", s)


def _pause_prefix(c: int) -> re.Pattern:
    """Prefixes of Dom(Proj) of Ex 2.3: (T? o)* followed by a proper prefix of T o, T = <s> y{1..c} </s>."""
    o, y = "[abe]", "[ab]"
    return re.compile(rf"(?:(?:\[{y}{{1,{c}}}\])?{o})*(?:\[{y}{{0,{c}}}|\[{y}{{1,{c}}}\])?")


def _query_response_prefix(c: int) -> re.Pattern:
    """Prefixes of the query-response format (Section 5.1): (query <eos> <s> y{0..c} </s> response <eos>)*."""
    q, t = "[ab]*e", rf"\[[ab]{{0,{c}}}\]"
    partial = rf"(?:[ab]*|{q}|{q}\[[ab]{{0,{c}}}|{q}{t}[ab]*)"
    return re.compile(rf"(?:{q}{t}[ab]*e)*{partial}")


def _sparse_prefix(c: int, is_position, n: int) -> re.Pattern:
    """Prefixes of Ex 2.4's domain with a thought of exactly c tokens before each observable position t with
    is_position(t), for up to n observables."""
    seg = [(rf"\[[ab]{{{c}}}\]" if is_position(t) else "") + "[abe]" for t in range(n + 1)]
    partials = []
    for k in range(n + 1):
        head = "".join(seg[:k])
        if is_position(k):
            partials += [head + rf"\[[ab]{{0,{c}}}", head + rf"\[[ab]{{{c}}}\]"]
        partials.append(head)
    return re.compile("(?:" + "|".join(partials) + ")")


def _reference(name: str, vocab: Vocab, z: tuple[int, ...]) -> str | None:
    """Proj^{<w}(z) spelled as a string, or None when z is no prefix of the domain."""
    s = _spell(vocab, z)
    if name == "identity":
        return s if re.fullmatch("[abe]*", s) else None
    if name.startswith("switch"):
        r = "a" if name == "switch" else "e"
        if not re.fullmatch("[abe]*", s):
            return None
        return "" if not s else (r * 8 if s[0] == r else s[1:])
    if name.startswith("pause"):
        pattern = _pause_prefix(int(name[-1]))
    elif name.startswith("qr"):
        pattern = _query_response_prefix(int(name[-1]))
    elif name.startswith("sparse"):
        p = PROJECTIONS[name]
        pattern = _sparse_prefix(p.thought_len, p.is_position, len(s))
    else:
        raise AssertionError(name)
    return _strip_thoughts(s) if pattern.fullmatch(s) else None


@pytest.mark.parametrize("name", [n for n in NAMES if n != "product"])
def test_project_one_matches_an_independent_reference(name):
    p = PROJECTIONS[name]
    tokens = [p.vocab.id(t) for t in ("a", "b", "<eos>", "<s>", "</s>", "<explain>")]
    checked = inside = 0
    for length in range(6):
        for z in itertools.product(tokens, repeat=length):
            want = _reference(name, p.vocab, z)
            try:
                got = _spell(p.vocab, proj_of(p, z))
            except NotInDomainError:
                got = None
            assert got == want, f"{name}: z = {_spell(p.vocab, z)!r}: _project_one {got!r}, reference {want!r}"
            checked += 1
            inside += want is not None
    assert inside > 20 and checked - inside > 20  # both sides of the domain were exercised


def test_product_projection_matches_its_definition():
    """Ex 2.2: Proj((x_t, y_t))_t = (x_t)_t, read from the pair tokens' own names ``"{a}|{g}"``."""
    p = PROJECTIONS["product"]
    pairs = [i for i in range(len(p.vocab)) if "|" in p.vocab.token(i)]
    others = [i for i in range(len(p.vocab)) if "|" not in p.vocab.token(i)]
    assert len(pairs) == 3 * 2
    for length in range(5):
        for z in itertools.product(pairs + others[:2], repeat=length):
            names = [p.vocab.token(t) for t in z]
            if all("|" in s for s in names):
                want = tuple(p.vocab.id(s.split("|")[0]) for s in names)
                assert proj_of(p, z) == want
            else:
                with pytest.raises(NotInDomainError):
                    proj_of(p, z)


def test_the_reference_catches_a_wrong_projection(monkeypatch):
    """A PauseToThink that also admits empty thoughts ``<s></s>`` (a plausible slip) disagrees with the reference."""
    p = PROJECTIONS["pause2"]
    right = type(p)._project_one

    def lax(self, z):
        z = np.asarray(z)
        keep = np.ones(len(z), dtype=bool)
        for i in range(len(z) - 1):
            if z[i] == S_ and z[i + 1] == ES:
                keep[i] = keep[i + 1] = False
        return right(self, z[keep]) if not keep.all() else right(self, z)

    monkeypatch.setattr(type(p), "_project_one", lax)
    z = (A, S_, ES, B)
    assert _reference("pause2", p.vocab, z) is None and proj_of(p, z) == (A, B)
