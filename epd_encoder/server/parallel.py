# SPDX-License-Identifier: Apache-2.0
"""Rank 0's side of ``serve --tp N``: the tensor-parallel executor and the checkpoint identity.

The TP executors (``tp.data.TPExecutor``, ``tp.weights.TPWeightsExecutor``) load their own
weights (a replica, or rank 0's shard), so the runtime never loads the whole tower a second
time. What it still needs of the checkpoint is its identity for content keys, and that must
be the one ``--tp 1`` computes, so TP and non-TP replicas of one checkpoint share cache
entries: ``vision_identity`` streams the vision tensors through the loader's own digest onto
the meta device (one tensor in memory at a time, none kept) and returns TP1's digest.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from epd_encoder.config import ServeConfig
from epd_encoder.errors import RankFailed
from epd_encoder.models.registry import LoadedVisionModel, read_family, resolve_dtype

log = logging.getLogger(__name__)


def vision_identity(path: Path) -> tuple[Any, Any, str]:
    """``(family, hf_config, weights_digest)`` exactly as ``load_vision_model`` would report
    them for ``--tp 1``, without keeping any weight (the digest is over the bytes as stored,
    before any cast, so it does not depend on the dtype or device either)."""
    from epd_encoder.models.loading.loader import load_vision_weights

    family, hf_config = read_family(path)
    _, report = load_vision_weights(path, family.weight_prefixes, device="meta", progress=False)
    return family, hf_config, report.digest


def key_mode(config: ServeConfig) -> str:
    """What ``--tp`` adds to the tower mode hashed into keys: nothing, except weights mode
    under ``--batch-invariant``. Data mode computes what TP1 computes (bitwise with
    ``--batch-invariant``). Weights mode splits the sums, so its last bits differ from TP1's
    (within 1e-5): the same tolerance class as TP1's own batch-dependent packing, so plain
    keys are shared; but ``--batch-invariant`` promises bitwise-stable embeddings, cache hits
    included, which a shared key would break, so those keys name the split."""
    tp = config.parallel
    if tp.tp > 1 and tp.tp_mode == "weights" and config.model.batch_invariant:
        return f"+tp{tp.tp}-weights"
    return ""


def build_executor(config: ServeConfig, path: Path, device: torch.device, model_id: str,
                   on_failure: Callable[[RankFailed], None], *,
                   threads: int | None = None) -> tuple[Any, LoadedVisionModel]:
    """The started TP executor and the model rank 0 serves (its tower is the executor's:
    a replica in data mode, rank 0's shard in weights mode; the digest is TP1's). ``threads``:
    each rank's intra-op threads, the runtime's CPU budget split (default: the group's own)."""
    from epd_encoder.tp.data import ExecutorSpec, TPExecutor
    from epd_encoder.tp.replica import replica_args
    from epd_encoder.tp.weights import TPWeightsExecutor

    tp = config.parallel
    family, hf_config, digest = vision_identity(path)
    dtype = resolve_dtype(config.model.dtype, device)
    spec = ExecutorSpec(checkpoint=str(path), dtype=str(dtype).removeprefix("torch."),
                        device=device.type, batch_invariant=config.model.batch_invariant)
    cls: Any = TPExecutor if tp.tp_mode == "data" else TPWeightsExecutor
    # Every rank replays the engine's scheduler calls (wrap_scheduler) and forms each batch itself.
    executor = cls(spec, tp.tp, timeout_s=tp.tp_timeout, heartbeat_s=tp.tp_heartbeat,
                   scheduler=replica_args(config.engine.scheduler), on_failure=on_failure)
    if threads is not None:
        executor.group.threads = threads  # read by start(): rank 0's pool and every rank's spec
    executor.start()  # spawns ranks 1..N-1; cleans up after itself when it fails
    try:
        log.info("tensor parallel: %d ranks, %s mode, rank pids %s", tp.tp, tp.tp_mode, executor.group.pids)
        model = LoadedVisionModel(family, hf_config, executor.tower, model_id or path.resolve().name,
                                  executor.dtype, executor.device, digest)
    except BaseException:
        executor.close()  # the caller never gets the executor: no rank may outlive this call
        raise
    return executor, model


def wrap_scheduler(executor: Any) -> Callable[[Any], Any] | None:
    """The engine's scheduler wrapper for ``executor``: under ``--tp`` it records every call
    into the group's log, which the ranks replay; ``None`` for a single-process executor."""
    group = getattr(executor, "group", None)
    if group is None or group.log is None:
        return None
    from epd_encoder.tp.replica import RecordingScheduler

    return lambda scheduler: RecordingScheduler(scheduler, group.log)
