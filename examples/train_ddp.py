"""Training on several processes with PyTorch's own torch.distributed (gloo on CPU): docs/training.md.

    torchrun --nproc-per-node 2 examples/train_ddp.py --steps 40 --checkpoint-dir ckpt
    python examples/train_ddp.py --steps 40                 # one process: the same losses, to float tolerance

The model is a slow-thinking model (Proj # P) with PauseToThink (thoughts of at most 2 tokens) over two
ordinary tokens; the prior P and the causal sampler Q (3.33) are bigram tables. The data are observations
x of 3 tokens drawn from a teacher model (the same kind of model with other tables), and the objective is

* ``--objective svi`` (default): the one-sampler loss (3.17) for P plus the sampler's policy gradient (3.25)
  for Q on one shared batch of particles per x (``Sum(OneSampler(8), SamplerPolicyGradient(8))``);
* ``--objective sft``: teacher-forced next-token loss on the teacher's latent sequences z (App. L's SFT),
  deterministic: no sampling at all.

The global batch (``--batch-size``) is split over the processes. With ``--streams item`` (default) every item
of it is computed under its own random stream (``Trainer(seed=...)``), so the guide's samples, the losses and
the weights do not depend on how many processes run. With ``--streams rank`` each process draws from its own
stream, seeded with ``seed + rank`` (``Trainer(seed=None)``): training then equals single-process training in
distribution only. With ``--checkpoint-dir`` rank 0 writes ``step-XXXXXXXX`` folders every
``--checkpoint-every`` steps and a new run resumes from the newest one: kill it and start it again, and it
goes on to the numbers of an uninterrupted run. ``--json FILE`` writes the metrics history (rank 0).
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
from collections.abc import Callable

import torch
import torch.distributed as dist

import ppl_thought as pt
from ppl_thought import provenance as pv

VOCAB = pt.Vocab(["a", "b"])
PROJ = pt.projections.PauseToThink(VOCAB, max_thought_len=2)
NUM_OBSERVED = 3


def _bigram(seed: int, scale: float, trainable: bool = True) -> pt.lm.Tabular:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(len(VOCAB), len(VOCAB), generator=g) * scale
    return pt.lm.Tabular(2, len(VOCAB), logits, trainable=trainable)


def dataset(objective: str, size: int = 64, seed: int = 123) -> list:
    """``size`` items from the teacher: x strings (``svi``) or ``{"x": x, "sequences": z}`` (``sft``)."""
    teacher = _bigram(seed, scale=2.0, trainable=False)
    z_dist = pt.dist.LMSequence(teacher, constraint=PROJ.domain(NUM_OBSERVED))
    with torch.no_grad():
        z, _ = z_dist.sample_with_log_prob((size,), generator=torch.Generator().manual_seed(seed))
    xs = PROJ.project(z)
    if objective == "sft":
        return [{"x": torch.as_tensor(x), "sequences": zi} for x, zi in zip(xs, z)]
    return [VOCAB.decode(x) for x in xs]


def build(objective: str = "svi", seed: int = 0, batch_size: int = 4, lr: float = 0.05,
          checkpoint_dir: str | None = None, checkpoint_every: int = 0, progress: bool = False,
          item_streams: bool = True, distributed: bool | None = None) -> pt.train.Trainer:
    """The Trainer of this example (the same on every process; rank 0's initial weights are broadcast)."""
    prior, sampler = _bigram(seed, scale=1.0), _bigram(seed + 1, scale=1.0)
    model, guide = pt.models.SlowThinking(prior, PROJ), pt.guides.Causal(sampler, PROJ)
    if objective == "svi":
        loss = pt.train.Sum(pt.train.OneSampler(8), pt.train.SamplerPolicyGradient(8))
        modules = {"prior": prior, "sampler": sampler}
    elif objective == "sft":
        loss, modules = pt.train.SFT(), {"prior": prior}
    else:
        raise pt.errors.ConfigError(f"objective must be 'svi' or 'sft', got {objective!r}")
    return pt.train.Trainer(model, guide, loss, modules, optimizer=functools.partial(torch.optim.Adam, lr=lr),
                            clip_norm=1.0, batch_size=batch_size, checkpoint_dir=checkpoint_dir,
                            checkpoint_every=checkpoint_every, progress=progress,
                            seed=seed if item_streams else None, distributed=distributed)


def init_distributed() -> tuple[int, int]:
    """Join the process group torchrun describes (``WORLD_SIZE``, ``RANK``, ``MASTER_ADDR``/``PORT`` in the
    environment), on gloo; (0, 1) when run as a plain script."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not dist.is_initialized():
        dist.init_process_group("gloo")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def main(argv: list[str] | None = None, callback: Callable | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--objective", choices=("svi", "sft"), default="svi")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch-size", type=int, default=4, help="the global batch, over all processes")
    ap.add_argument("--lr", type=float, default=0.05)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--streams", choices=("item", "rank"), default="item",
                    help="random streams per item of the global batch (any number of processes gives the same "
                         "numbers) or per process (seed + rank)")
    ap.add_argument("--checkpoint-dir", default=None)
    ap.add_argument("--checkpoint-every", type=int, default=0)
    ap.add_argument("--json", default=None, help="write the metrics history here (rank 0)")
    ap.add_argument("--no-progress", action="store_true")
    args = ap.parse_args(argv)
    run_record = pv.record(pv.script(__file__, argv))  # before the run: the code that runs
    if args.steps < 0 or args.batch_size < 1 or args.seed < 0 or (args.checkpoint_every and not args.checkpoint_dir):
        ap.error("--steps and --seed must be >= 0, --batch-size >= 1, and --checkpoint-every needs --checkpoint-dir")
    torch.set_num_threads(1)
    rank, world_size = init_distributed()
    if args.streams == "rank":
        torch.manual_seed(args.seed + rank)  # this process's stream (a checkpoint keeps every rank's state)
    trainer = build(args.objective, args.seed, args.batch_size, args.lr, args.checkpoint_dir, args.checkpoint_every,
                    progress=not args.no_progress, item_streams=args.streams == "item")
    latest = pt.train.Trainer.latest_checkpoint(args.checkpoint_dir) if args.checkpoint_dir else None
    if latest is not None:
        trainer.load(latest)
        if rank == 0:
            print(f"resumed from {latest} (step {trainer.step_count})", file=sys.stderr)
    trainer.fit(dataset(args.objective), args.steps, callback=callback)
    out = {"world_size": world_size, "objective": args.objective,
           "history": trainer.history, "written": [str(p) for p in trainer.checkpoints_written],
           "weights": {name: {k: v.tolist() for k, v in m.state_dict().items()}
                       for name, m in trainer.modules.items()}}
    if rank == 0:
        last = trainer.history[-1] if trainer.history else {}
        print(f"{world_size} process(es), {trainer.step_count} steps, loss {last.get('loss', float('nan')):.4f}")
        if args.json:
            out[pv.KEY] = pv.finish(run_record)  # commit, command, machine, load, seconds
            pt.io.atomic_write_json(args.json, out)
    return out


if __name__ == "__main__":
    try:
        main()
    finally:
        if dist.is_initialized():
            dist.barrier()  # no rank tears its connections down while another still talks (gloo aborts then)
            dist.destroy_process_group()
