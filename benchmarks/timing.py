# SPDX-License-Identifier: Apache-2.0
"""``--threads`` and ``--clock`` for the CPU benchmarks (imports torch only: a benchmark that
must set up transformers' backends first can import it early)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch


def add_timing_flags(ap: argparse.ArgumentParser, threads_help: str = "torch intra-op threads (0: torch's default)") -> None:
    """``--threads`` and ``--clock``, shared by the CPU benchmarks (``timing_clock`` applies them)."""
    ap.add_argument("--threads", type=int, default=0, help=threads_help)
    ap.add_argument("--clock", choices=["wall", "thread"], default="wall",
                    help="thread: CPU time of this thread, steady on a shared box (needs --threads 1)")


def timing_clock(ap: argparse.ArgumentParser, args: argparse.Namespace) -> Callable[[], float]:
    """Set the intra-op threads; the clock to time with (``thread`` needs exactly one thread)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock != "thread":
        return time.perf_counter
    if torch.get_num_threads() != 1:
        ap.error("--clock thread measures one thread: pass --threads 1")
    return time.thread_time
