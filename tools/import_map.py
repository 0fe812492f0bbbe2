"""The import map of ppl_thought: which layer imports which, and every import that flows upward.

    python tools/import_map.py            # the layer graph, upward imports and import circles (exit 1 if any)
    python tools/import_map.py --modules  # module-level edges too

Layers, lowest first (docs/architecture.md). A module may import its own layer and the layers below;
``TYPE_CHECKING`` imports and imports inside functions count too (they are dependencies all the same).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ppl_thought"

# (layer, module prefixes) lowest first; the first matching prefix (longest) wins.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("errors", "checks", "vocab", "arviz_compat", "draws", "checkpoint", "transformer_checkpoint", "twists",
              "validation", "schemas", "resources", "provenance")),
    ("projections", ("projections",)),
    ("lm", ("lm", "io", "weights")),
    ("distributions", ("distributions", "program", "contract", "verifiers.process")),
    ("transforms", ("transforms",)),
    ("models/guides", ("models", "guides", "data")),
    ("inference", ("inference",)),
    ("verifiers", ("verifiers",)),
    ("training", ("training",)),
    ("diagnostics", ("diagnostics",)),
    ("experiments", ("experiments", "demo", "reproduce")),
    ("cli", ("cli", "__init__", "__main__")),
]
# The JAX backend is a column of its own: it may import the framework-free layers only.
SIDE_LAYERS = {"numpyro": ("base", "projections")}
# Layers that both backends read import no array framework (numpy only).
FRAMEWORK_FREE = ("base", "projections")
FRAMEWORKS = ("torch", "pyro", "jax", "jaxlib", "numpyro", "transformers")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__" and len(parts) > 1:
        parts.pop()
    return ".".join(parts)


def layer_of(module: str) -> str | None:
    best = None
    for rank, (name, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if module == p or module.startswith(p + "."):
                if best is None or len(p) > best[2]:
                    best = (rank, name, len(p))
    if module == "numpyro" or module.startswith("numpyro."):
        return "numpyro"
    return None if best is None else best[1]


def rank_of(layer: str) -> int:
    return [n for n, _ in LAYERS].index(layer)


def imports_of(path: Path, module: str) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".") if package else []
                base = base[: len(base) - (node.level - 1)] if node.level > 1 else base
                names = [".".join([*base, node.module] if node.module else base)]
            else:
                names = [node.module or ""]
        else:
            continue
        for n in names:
            if n.partition(".")[0] in FRAMEWORKS and not (isinstance(node, ast.ImportFrom) and node.level):
                out.add("!" + n.partition(".")[0])
            elif n == "ppl_thought" or n.startswith("ppl_thought."):
                out.add(n.removeprefix("ppl_thought").lstrip("."))
            elif node.__class__ is ast.ImportFrom and node.level:
                out.add(n)
    return {m for m in out if m}


def edges() -> dict[str, set[str]]:
    graph: dict[str, set[str]] = defaultdict(set)
    for path in sorted(ROOT.rglob("*.py")):
        mod = module_name(path)
        graph[mod] |= imports_of(path, mod if path.name != "__init__.py" else mod)
    return graph


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str, str, str]]:
    bad = []
    for src, dsts in graph.items():
        ls = layer_of(src)
        if ls is None:
            bad.append((src, "?", "", "module in no layer"))
            continue
        for dst in dsts:
            if dst.startswith("!"):
                framework = dst[1:]
                if ls in FRAMEWORK_FREE or (ls == "numpyro" and framework in ("torch", "pyro", "transformers")):
                    bad.append((src, framework, "", f"{ls} imports the framework {framework}"))
                continue
            ld = layer_of(dst)
            if ld is None:
                bad.append((src, dst, "?", "target in no layer"))
            elif ls == "numpyro":
                if ld not in (*SIDE_LAYERS["numpyro"], "numpyro"):
                    bad.append((src, dst, ld, "the JAX backend imports a torch layer"))
            elif ld == "numpyro":
                if ls != "cli":
                    bad.append((src, dst, ld, "the torch side imports the JAX backend"))
            elif rank_of(ld) > rank_of(ls):
                bad.append((src, dst, ld, f"{ls} imports {ld}"))
    return sorted(bad)


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles between modules: strongly connected components of more than one module (Tarjan)."""
    mods = set(graph)
    succ = {m: sorted(d for d in graph[m] if not d.startswith("!") and d in mods and d != m) for m in graph}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    for root in sorted(mods):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on.add(v)
            if i < len(succ[v]):
                work.append((v, i + 1))
                w = succ[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
            if work:
                parent = work[-1][0]
                low[parent] = min(low[parent], low[v])
    return sorted(out)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modules", action="store_true", help="print module-level edges too")
    args = ap.parse_args(argv)
    graph = edges()
    layer_edges: dict[str, set[str]] = defaultdict(set)
    for src, dsts in graph.items():
        for dst in dsts:
            if dst.startswith("!"):
                continue
            a, b = layer_of(src), layer_of(dst)
            if a and b and a != b:
                layer_edges[a].add(b)
    order = [n for n, _ in LAYERS] + ["numpyro"]
    print("layer -> layers it imports")
    for layer in order:
        if layer in layer_edges or any(layer_of(m) == layer for m in graph):
            print(f"  {layer:14s} -> {', '.join(sorted(layer_edges[layer], key=order.index)) or '-'}")
    if args.modules:
        for src in sorted(graph):
            print(f"{src}: {', '.join(sorted(d for d in graph[src] if not d.startswith('!')))}")
    bad = upward(graph)
    for src, dst, _layer, why in bad:
        print(f"UPWARD {src} -> {dst}: {why}")
    loops = circles(graph)
    for loop in loops:
        print(f"CIRCLE {' -> '.join(loop)}")
    print(f"{len(graph)} modules, {len(bad)} upward imports, {len(loops)} import circles")
    return 1 if bad or loops else 0


if __name__ == "__main__":
    sys.exit(main())
