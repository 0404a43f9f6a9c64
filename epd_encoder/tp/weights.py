# SPDX-License-Identifier: Apache-2.0
"""Weights-mode tensor-parallel encode: every rank holds ~1/N of the tower and runs every batch.

Each rank loads only its shard (``shard.load_vision_shard``: heads and MLP/merger widths
split, ``all_reduce`` after every row-parallel layer). Per batch, rank 0 broadcasts the
``Work``, the ranks agree on its digest, rank 0 broadcasts the packed pixels as one flat
buffer (``group.broadcast_flat``: every rank needs all of them), and every rank runs
``forward_packed`` on the same batch. The all-reduces inside make every rank's output the
full output; rank 0 keeps its own, so nothing travels back.

A forward that fails is fatal to the group. The ranks are inside one chain of collectives:
a forward that raises on one rank (or dies, or hangs) leaves the others blocked in an
all-reduce, and no message can bring them back in step. So rank 0 turns any forward failure
(its own, or the broken collective a peer's failure causes) into ``RankFailed``
(``RankGroup.run`` kills every rank), unlike data mode, where a failed share is a failed
batch only. A peer that exits fails rank 0's collective at once (closed socket); one that
hangs fails it at the group's ``timeout_s``. Rank 0 rejects what it can see is malformed
before anything is sent (pixel dtype, pixel shapes against the grids): ``EncodeFailed``,
the group untouched. A forward that completes on every rank is settled: each rank checks
its output rows against the grids and the ranks all-gather the verdicts (``settle``, one
small collective); a row count that disagrees on any rank is then an ``OutputMismatch`` of
that batch only, since every rank has shown it finished the same collectives.

``batch_invariant``: every rank runs ``forward_units`` (one forward per image / temporal
group / tile, in batch order), so the collectives stay aligned, and a unit's output is
bitwise independent of what it is batched with, at the same N and thread count. It is
not bitwise ``--tp 1``: the sums are split differently (within float tolerance).
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict
from typing import Any

import torch
import torch.distributed as dist

from epd_encoder.errors import EncodeFailed, OutputMismatch, RankFailed
from epd_encoder.models.executor import VisionExecutor
from epd_encoder.models.invariant import forward_units
from epd_encoder.models.loading.loader import LoadReport
from epd_encoder.models.registry import LoadedVisionModel
from epd_encoder.tp.data import DTYPES, ExecutorSpec, GroupExecutor
from epd_encoder.tp.group import DEFAULT_HEARTBEAT_S, DEFAULT_TIMEOUT_S, RankGroup, broadcast_flat
from epd_encoder.tp.messages import Work
from epd_encoder.tp.shard import ShardStats, _whole_digest, load_vision_shard, shard_stats
from epd_encoder.types import ItemOutput, PreprocessedImage

log = logging.getLogger(__name__)


class ForwardBroken(RuntimeError):
    """A weights-mode forward failed part-way: the ranks' collectives are out of step.
    Not an ``EncoderError`` on purpose: ``RankGroup.run`` then fails the whole group."""


def load_shard(spec: ExecutorSpec, rank: int, size: int) -> tuple[LoadedVisionModel, LoadReport]:
    device = f"cuda:{rank}" if spec.device == "cuda" else spec.device
    return load_vision_shard(spec.checkpoint, rank, size, dtype=spec.dtype, device=device, progress=False)


def packed_forward(tower: Any, batch_invariant: bool) -> Callable[[torch.Tensor, torch.Tensor], Any]:
    """The forward every rank runs: the same call sequence on every rank (so the same collectives)."""
    if batch_invariant:
        return lambda p, g: forward_units(tower.forward_packed, p, g)
    return tower.forward_packed


def rows_fault(emb: torch.Tensor, deep: Sequence[torch.Tensor] | None, total: int) -> str:
    """What is wrong with a forward's row counts (``""``: nothing): the one-process check, as text."""
    try:
        VisionExecutor._check_rows(emb, None if deep is None else list(deep), total)
    except OutputMismatch as e:
        return str(e)
    return ""


def settle(fault: str, seq: int) -> list[str]:
    """Every rank's verdict on its finished forward (all-gathered: one int per rank, the
    reason stays local); ``"rank r: ..."`` for each rank that found its rows wrong."""
    mine = torch.tensor([1 if fault else 0], dtype=torch.int64)
    views = [torch.empty(1, dtype=torch.int64) for _ in range(dist.get_world_size())]
    dist.all_gather(views, mine)
    me = dist.get_rank()
    return [f"rank {r}: " + (fault if r == me else f"its output rows disagree with the grids of batch {seq}")
            for r, v in enumerate(views) if int(v)]


# -- ranks 1..N-1 ----------------------------------------------------------------------
class WeightsRank:
    """A rank's side of weights mode: take the pixels, run the shard's forward, send nothing."""

    def __init__(self, rank: int, size: int, spec: ExecutorSpec) -> None:
        self.rank, self.size = rank, size
        self.model, self.report = load_shard(spec, rank, size)  # before the group: a slow load meets no timeout
        self.device = self.model.device
        self._forward = packed_forward(self.model.tower, spec.batch_invariant)

    def setup(self) -> None:
        """With rank 0's ``start``: all-gather the shard digests into the whole tower's."""
        digest = _whole_digest(self.report.digest, self.rank, self.size, None, self.device)
        self.model = dataclasses.replace(self.model, weights_digest=digest)

    def digest(self, work: Work) -> bytes:
        return work.digest()

    def run(self, work: Work) -> None:
        if work.dtype not in DTYPES:  # rank 0 never sends one; a protocol break then
            raise RankFailed(f"batch {work.seq}: pixel dtype {work.dtype!r} is not one of {sorted(DTYPES)}")
        parts = broadcast_flat(None, [list(s) for s in work.shapes], DTYPES[work.dtype])
        with torch.inference_mode():
            pixels = (parts[0] if len(parts) == 1 else torch.cat(parts)).to(self.device)
            grid = torch.tensor([list(g) for g in work.grids], dtype=torch.long)
            # An exception here leaves the group (rank.rank_main): rank 0's collective fails at once.
            emb, deep = self._forward(pixels, grid)
        fault = rows_fault(emb, deep, sum(work.num_tokens))
        if fault:
            log.warning("batch %d on rank %d: %s", work.seq, self.rank, fault)
        settle(fault, work.seq)  # rank 0 fails the batch; this rank stays in step


def make_weights_rank(rank: int, size: int, **spec: object) -> WeightsRank:
    """The group factory of weights mode (``epd_encoder.tp.weights:make_weights_rank``)."""
    return WeightsRank(rank, size, ExecutorSpec(**spec))  # type: ignore[arg-type]


# -- rank 0 ----------------------------------------------------------------------------
class TPWeightsExecutor(GroupExecutor):
    """``VisionExecutor``'s interface over a weights-mode rank group (constructor as ``TPExecutor``'s).

    The constructor loads rank 0's shard, so a head count that ``size`` does not divide is a
    ``ConfigError`` here, before any rank process exists or any weight is read. ``start()``
    spawns ranks 1..N-1 (each loads its own shard) and combines the shard digests into
    ``model.weights_digest`` (one identity of the whole tower on every rank). ``encode`` runs
    one forward on every rank; any forward failure is a ``RankFailed`` that ends the group, and
    a row count that disagrees once every rank finished is an ``OutputMismatch`` of the batch.
    ``warmup`` goes through the group (a forward is a collective), so it needs ``start()``.
    """

    mode = "weights"

    def __init__(self, spec: ExecutorSpec, size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S, scheduler: dict | None = None,
                 on_failure: Callable[[RankFailed], None] | None = None) -> None:
        self.spec, self.size = spec, size
        # RankGroup checks its arguments (size >= 2, heartbeat) before any load.
        self.group = RankGroup(size, "epd_encoder.tp.weights:make_weights_rank", asdict(spec), timeout_s=timeout_s,
                               heartbeat_s=heartbeat_s, scheduler=scheduler, device=spec.device,
                               on_failure=on_failure)
        self.model, self.report = load_shard(spec, 0, size)
        # Rank 0's forward, checks and split are VisionExecutor's, on the sharded tower.
        self.local = VisionExecutor(self.model.tower, device=self.model.device,  # type: ignore[arg-type]
                                    dtype=self.model.dtype, batch_invariant=spec.batch_invariant)
        self.device, self.dtype, self.tower = self.local.device, self.local.dtype, self.local.tower
        self.batch_invariant = spec.batch_invariant
        self.weight_bytes = self.report.bytes  # what rank 0 read of the checkpoint (its shard)
        example = getattr(self.tower, "example_item", None)
        self._example = example() if callable(example) else None
        self._forward = packed_forward(self.tower, spec.batch_invariant)  # the ranks' own call sequence

    @property
    def stats(self) -> ShardStats:
        """Parameter counts per rank (``shard_stats`` on a meta tower of the full config)."""
        with torch.device("meta"):
            full = self.model.family.build_tower(self.model.hf_config)
        return shard_stats(self.model.family.name, full, self.size)

    def start(self) -> "TPWeightsExecutor":
        self.group.start(setup=self._setup)
        return self

    def _setup(self) -> None:
        digest = _whole_digest(self.report.digest, 0, self.size, None, self.device)
        self.model = dataclasses.replace(self.model, weights_digest=digest)

    def warmup(self, item: PreprocessedImage | None = None) -> None:
        """One small encode through the group (every rank pays its lazy init)."""
        item = item if item is not None else self._example
        if item is None:
            raise EncodeFailed(f"{type(self.tower).__name__} has no example_item(); pass a warmup item")
        self.encode([item])

    def encode(self, items: Sequence[PreprocessedImage], *, keys: Sequence[tuple[str, int]] | None = None,
               costs: Sequence[int] | None = None) -> list[ItemOutput]:
        """``keys`` (request id, item index) and ``costs`` go into the batch digest; they
        default to the item positions and the pre-merge patch counts."""
        if not items:
            return []
        counts = self.expected_tokens(items)  # before any rank sees the batch
        dtype = self._preflight(items)
        keys = list(keys) if keys is not None else [("", i) for i in range(len(items))]
        costs = list(costs) if costs is not None else [max(1, it.num_patches) for it in items]
        work = Work(seq=1, mode=self.mode, request_ids=[k[0] for k in keys], item_indices=[k[1] for k in keys],
                    costs=costs, grids=[(int(t), int(h), int(w)) for t, h, w in (it.grid_thw for it in items)],
                    num_tokens=counts, shapes=[list(it.pixel_values.shape) for it in items], dtype=dtype)
        return self.group.run(work, lambda w: self._exchange(w, items, counts))

    def _preflight(self, items: Sequence[PreprocessedImage]) -> str:
        """What rank 0 can see is malformed fails here, the group untouched (a failure inside
        the forward would end it). Returns the pixel dtype's wire name."""
        dtypes = {it.pixel_values.dtype for it in items}
        names = [n for n, d in DTYPES.items() if dtypes == {d}]
        if not names:
            raise EncodeFailed(f"a weights-mode batch needs one pixel dtype out of {sorted(DTYPES)}, got {dtypes}")
        ref = self._example.pixel_values if self._example is not None else items[0].pixel_values
        per_patch = self._example is not None and ref.shape[0] == math.prod(self._example.grid_thw)
        for i, it in enumerate(items):
            shape = tuple(it.pixel_values.shape)
            t, h, w = (int(v) for v in it.grid_thw)
            lead = t * h * w if per_patch else t
            if len(shape) != ref.dim() or shape[1:] != tuple(ref.shape[1:]) or (self._example is not None
                                                                              and shape[0] != lead):
                raise EncodeFailed(f"item {i}: pixels {list(shape)} do not fit grid {(t, h, w)} "
                                   f"(rows shaped {list(ref.shape[1:])} expected)")
        return names[0]

    def _exchange(self, work: Work, items: Sequence[PreprocessedImage], counts: list[int]) -> list[ItemOutput]:
        broadcast_flat([it.pixel_values.cpu() for it in items], [list(s) for s in work.shapes], DTYPES[work.dtype])
        with torch.inference_mode():  # rank 0 encodes its own items: the broadcast sent exactly their values
            host = items[0].pixel_values if len(items) == 1 else torch.cat([it.pixel_values for it in items])
            grid = torch.tensor([tuple(it.grid_thw) for it in items], dtype=torch.long)
            try:
                emb, deep = self._forward(self.local.upload(host), grid)
            except Exception as e:  # the forward broke part-way: the ranks' collectives are out of step
                raise ForwardBroken(f"weights-mode forward: {e}") from e
        faults = settle(rows_fault(emb, deep, sum(counts)), work.seq)
        if faults:  # every rank finished the forward: the group is intact, the batch is not
            raise OutputMismatch(f"batch {work.seq}: " + "; ".join(faults))
        return VisionExecutor._split(emb, deep, counts)  # the local executor's own split
