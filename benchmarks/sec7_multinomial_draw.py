"""Section 7 with the thoughts drawn as before c801742: ``torch.multinomial`` instead of ``token_step``.

    python benchmarks/sec7_multinomial_draw.py --seed 0 --seeds 1 --n 8 --quick --steps 150 --batch 16 \\
        --eval-every 75 --threads 1 --json benchmarks/results/sec7_seed0_150x16_multinomial.json

Both draw the same law (the masked softmax of the sampler, (7.2)); only the random stream differs. Any arguments of
``python -m ppl_thought.experiments.sec7 --seeds ...`` are accepted; the JSON records this script as its command.
docs/demo.md ("Section 7 across sizes") uses it to show that the sign of the committed 150 x 16 run at n = 8 came
from the random stream of the thought draws.
"""

from __future__ import annotations

import json
import sys
from types import SimpleNamespace

import torch

import ppl_thought.experiments.sec7 as sec7
from ppl_thought.io import atomic_write_json


def multinomial_step(rule, logits, state, log_probs: torch.Tensor) -> SimpleNamespace:
    """The draw of 8a16c04: one ``torch.multinomial`` per row of ``exp(log_probs)``."""
    return SimpleNamespace(token=torch.multinomial(log_probs.exp(), 1).squeeze(1))


def main(argv: list[str]) -> int:
    sec7.token_step = multinomial_step
    rc = sec7.main(argv)
    if "--json" in argv:
        path = argv[argv.index("--json") + 1]
        d = json.loads(open(path).read())
        d["command"] = "python benchmarks/sec7_multinomial_draw.py " + " ".join(argv)
        atomic_write_json(path, d)
    return rc


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
