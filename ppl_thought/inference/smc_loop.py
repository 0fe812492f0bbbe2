"""The data of the one SMC loop (:meth:`SMC._run <ppl_thought.inference.smc.SMC._run>`, docs/architecture.md,
"Engines"): what a step kernel gives the loop (:class:`Proposal`) and the loop's own state of a run
(:class:`LoopState`: weights, finished flags, potentials, step counter, records), on the host or on the device
(the kernel's ``sync`` policy). Both kernels import it: the generic one (inference/smc.py) and the static one
(inference/static_smc.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["LoopState", "Proposal"]


@dataclass
class Proposal:
    """What a kernel's step gives the loop: the step's incremental log weights ``[N]`` on the loop's device (before
    the twist), the particles that finished at this step (a bool ``[N]`` or None), the potential ``[N]`` the program set
    with ``pt.twist`` (or None), the kernel's own error flag (a 0-dim bool tensor, device policy: e.g. a row with no
    admissible token, raised by ``kernel.flag_error`` at the end) and the step's traces (read only to name the sites of
    NaN weights)."""

    log_w: torch.Tensor
    done: torch.Tensor | None
    log_psi: torch.Tensor | None = None
    flag: torch.Tensor | None = None
    traces: tuple = ()


class LoopState:
    """The loop's own state in a run, whatever the kernel: log weights, finished flags, twist potentials, the step
    counter and the per-step records. ``sync=True`` (host policy): values reassigned, the counter an int, records in
    Python lists. ``sync=False`` (device policy): buffers written in place (a captured step keeps their addresses),
    the counter a device tensor, records and error flags in device buffers of ``steps`` rows, read once at the end
    (flags: the kernel's flag, NaN weights, all finished, then per group: every weight zero)."""

    def __init__(self, N: int, G: int, device: Any, sync: bool, steps: int = 0):
        self.N, self.G, self.device, self.sync = N, G, torch.device(device), sync
        self.lw = torch.zeros(N, device=device)
        self.finished = torch.zeros(N, dtype=torch.bool, device=device)
        self.prev_psi = torch.zeros(N, device=device)
        self.twisted = self.any_finished = self.all_done = False
        if sync:
            self.t: Any = 0
            self.ess: Any = []
            self.resampled: Any = []
            self.ancestry: Any = []
            return
        self.t = torch.zeros(1, dtype=torch.long, device=device)
        self.ess = torch.zeros(steps, G, device=device)
        self.resampled = torch.zeros(steps, G, dtype=torch.bool, device=device)
        self.ancestry = torch.zeros(steps, N, dtype=torch.long, device=device)
        self.flags = torch.zeros(steps, 3 + G, dtype=torch.bool, device=device)
        self.ar = torch.arange(N, device=device)

    def reset(self) -> None:
        """Device policy: back to the start of a run, in place."""
        for buf in (self.lw, self.finished, self.prev_psi, self.t, self.ess, self.resampled, self.ancestry,
                    self.flags):
            buf.zero_()

    def stopped(self, t: int) -> bool:
        """Whether every particle has finished after step ``t``: read in the step's sync (host policy), from the
        flags on the CPU (free there); never on another device (the run takes its ``bound`` steps; finished particles
        are frozen)."""
        if self.sync:
            return self.all_done
        return self.device.type == "cpu" and bool(self.flags[t, 2])
