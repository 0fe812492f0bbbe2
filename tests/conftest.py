"""Test-wide settings: one intra-op thread (small tensors on 2 shared cores are faster and steadier)."""

import warnings

import torch

torch.set_num_threads(1)
warnings.filterwarnings("ignore", category=FutureWarning, module="arviz")
