"""Verifier-guided generation on the Dyck sandbox: sampling, nucleus, tokenwise rejection, Algorithm 1, VGB,
SMC and AWRS-style weighted rejection, against the exact constrained distribution (thesis Ch. 3); and the
thesis' own Tables 3.1-3.3 at small scale (``thesis_tables`` in the JSON: Definition 3.2.1's Dyck law, a trained
imperfect verifier, OOD error counts with and without backtracking, the thesis' figures beside ours).

    python examples/dyck_backtracking.py [--quick] [--thesis-only] [--json FILE]

``--quick`` takes about a minute on 2 cores; the full run a few minutes. The experiment itself lives in
:mod:`ppl_thought.experiments.verifiers` (``python -m ppl_thought.experiments.verifiers`` runs the same).
"""

from ppl_thought.experiments.verifiers import main

if __name__ == "__main__":
    raise SystemExit(main())
