# SPDX-License-Identifier: Apache-2.0
"""A rank process of the group (ranks 1..N-1): boot, build the handler, serve messages.

Rank 0 starts each rank as ``python -c BOOT spec_json``: no pickle and no re-import of the
server's main module. The boot code sets the parent-death signal before anything else, so
no rank outlives rank 0. ``rank_main`` builds the mode's ``RankHandler`` (loading weights
before joining the group, so a slow load meets no collective timeout), reports ready on its
pipe, joins gloo, and serves: receive a message, replay its scheduler calls on the rank's
``SchedulerReplica``, agree on the digest with every rank, run the handler's side of the
exchange. On any failure it writes its reason on the pipe and exits non-zero at once.
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection
from typing import Any, Protocol

import torch
import torch.distributed as dist

from epd_encoder.errors import EncoderError, RankFailed
from epd_encoder.tp.messages import Heartbeat, Shutdown, Work
from epd_encoder.tp.replica import SchedulerReplica
from epd_encoder.tp.wire import agree, receive_message

log = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1


class RankHandler(Protocol):
    """A rank's side of a mode (built in the rank process by the group's factory). An optional
    ``setup()`` runs once after the group is up, before the first message (with rank 0's
    ``RankGroup.start(setup)``)."""

    def digest(self, work: Work) -> bytes:
        """This rank's view of the batch (default: ``work.digest()``)."""
        ...

    def run(self, work: Work) -> None:
        """This rank's side of the exchange that follows ``work``; must complete the
        protocol even when its forward fails (send the failure, don't vanish)."""
        ...


# The child's first statements, before Python imports anything of ours (or torch): the
# parent-death signal, then the race check (a parent gone before prctl never signals).
BOOT = ("import ctypes, os, signal, sys\n"
         "if sys.platform.startswith('linux'):\n"
         "    ctypes.CDLL(None).prctl({pdeathsig}, signal.SIGKILL, 0, 0, 0)\n"
         "if os.getppid() != {parent}:\n"
         "    os._exit(1)\n"
         "from epd_encoder.tp.rank import rank_main\n"
         "rank_main(sys.argv[1])\n")


def resolve(target: str) -> Callable[..., Any]:
    """``"package.module:callable"`` to the callable (how a rank finds its handler factory)."""
    module, _, name = target.partition(":")
    if not module or not name:
        raise ValueError(f"a handler factory is 'module:callable', got {target!r}")
    obj: Any = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj


def rank_main(spec_json: str) -> None:
    spec = json.loads(spec_json)
    rank, size, timeout_s = spec["rank"], spec["size"], spec["timeout_s"]
    conn = Connection(spec["fd"], readable=False)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s rank{rank} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(spec["threads"])

    def say(kind: str, value: Any) -> None:
        conn.send_bytes(json.dumps([kind, value]).encode())

    try:
        handler = resolve(spec["factory"])(rank, size, **spec["args"])
    except BaseException as e:
        say("failed", f"rank {rank} could not start: {e!r}")
        sys.exit(2)
    # Ready before joining: rank 0 joins the process group (which needs every rank at
    # once) only when all ranks have built their handlers, however long a load takes.
    say("ready", os.getpid())
    try:
        store = dist.TCPStore("127.0.0.1", spec["port"], size, is_master=False,
                              timeout=timedelta(seconds=timeout_s))
        if spec.get("backend", "gloo") != "gloo":
            torch.cuda.set_device(rank)  # NCCL's communicator binds to the current device
        dist.init_process_group(spec.get("backend", "gloo"), store=store, rank=rank, world_size=size,
                                timeout=timedelta(seconds=timeout_s))
        setup = getattr(handler, "setup", None)
        if setup is not None:  # once, before the first message; rank 0 runs its own in start(setup)
            setup()
        replica = SchedulerReplica(**spec["scheduler"]) if spec.get("scheduler") is not None else None
        serve(rank, handler, replica)
    except BaseException as e:
        reason = str(e) if isinstance(e, EncoderError) else f"{type(e).__name__}: {e}"
        log.error("rank %d leaves the group: %s", rank, reason)
        try:
            say("failed", f"rank {rank}: {reason}")
        finally:
            os._exit(3)  # no atexit: gloo teardown against a broken peer can block
    dist.destroy_process_group()
    conn.close()


def serve(rank: int, handler: RankHandler, replica: SchedulerReplica | None = None) -> None:
    """Receive, check, run, until ``Shutdown``. With a ``replica``, every message's scheduler
    calls are replayed on it first, and each batch's digest covers the batch it formed."""
    last = 0
    while True:
        msg = receive_message()
        if isinstance(msg, Shutdown):
            log.info("rank %d shuts down after batch %d", rank, last)
            return
        if isinstance(msg, Heartbeat):
            if replica is not None:
                replica.replay(msg.calls)
            if msg.seq != last:
                raise RankFailed(f"rank 0 is at batch {msg.seq}, this rank at {last}")
            continue
        if msg.seq != last + 1:
            raise RankFailed(f"batch {msg.seq} arrived after batch {last}")
        last = msg.seq
        mine = handler.digest(msg)
        agree(mine if replica is None else replica.digest(msg, mine), msg.seq)
        handler.run(msg)

