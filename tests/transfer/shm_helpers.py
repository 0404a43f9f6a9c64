# SPDX-License-Identifier: Apache-2.0
"""Shared shm test fixtures: planes, subprocess spawning, and the no-leak check."""
from __future__ import annotations

import glob
import os
import subprocess
import sys
import textwrap

import torch

from epd_encoder.transfer.messages import WireItem
from epd_encoder.transfer.planes.shm import PREFIX

SHM = "/dev/shm"
PIDS: set[int] = {os.getpid()}  # every process whose segments must be gone at the end


def ours(pid: int) -> list[str]:
    return glob.glob(os.path.join(SHM, f"{PREFIX}{pid}-*"))


def spawn(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                            text=True, cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    PIDS.add(proc.pid)
    return proc


def items_and_tensors(dtype: torch.dtype, deepstack: int):
    name = {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]
    items = (WireItem("a", 7, (1, 2, 14), 12, name, deepstack), WireItem("b", 3, (1, 2, 6), 12, name, deepstack))
    g = torch.Generator().manual_seed(0)
    tensors = [[torch.randn(it.num_tokens, it.hidden_size, generator=g).to(dtype) for _ in range(1 + deepstack)]
               for it in items]
    return items, tensors
