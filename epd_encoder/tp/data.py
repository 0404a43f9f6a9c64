# SPDX-License-Identifier: Apache-2.0
"""Data-parallel encode over a rank group: whole items, cost-balanced, gathered on rank 0.

Every rank holds a full tower replica. For a batch, every rank computes the same
assignment from the costs in the ``Work`` (``lpt_assign``: largest first onto the
least-loaded rank; deterministic), so the assignment needs no message of its own
and the batch digest covers it. Rank 0 sends each rank its items' pixels as one
flat buffer (point to point: a rank receives only its share), encodes its own
share, then receives each rank's outputs as a 6-int64 header and one flat buffer
(embedding rows, then each deepstack) and reassembles them in item order.

Each item goes through ``VisionExecutor.encode`` with the other items of its
share, so outputs equal ``--tp 1`` within float tolerance; with
``batch_invariant`` every unit runs alone on every rank, so they are bitwise
``--tp 1 --batch-invariant`` at the same intra-op thread count.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from epd_encoder.errors import EncodeFailed, OutputMismatch, RankFailed
from epd_encoder.models.executor import VisionExecutor
from epd_encoder.tp.group import DEFAULT_HEARTBEAT_S, DEFAULT_TIMEOUT_S, RankGroup
from epd_encoder.tp.messages import Work
from epd_encoder.types import ItemOutput, PreprocessedImage

log = logging.getLogger(__name__)

# Wire dtypes: a name in a Work, a code in a result header. A closed set: a rank never
# getattr()s torch with a name off the wire.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CODES = list(DTYPES.values())
_OK, _FAILED = 0, 1


def lpt_assign(costs: Sequence[int], ranks: int) -> list[list[int]]:
    """Item indices per rank: largest cost first onto the least-loaded rank (ties: larger
    cost by lower index first; among equal loads the highest rank, so rank 0, which also
    moves everyone's data, is the last to take work). Each share is in item order."""
    loads = [0] * ranks
    shares: list[list[int]] = [[] for _ in range(ranks)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        r = min(range(ranks), key=lambda r: (loads[r], -r))
        shares[r].append(i)
        loads[r] += costs[i]
    return [sorted(s) for s in shares]


@dataclass(frozen=True)
class ExecutorSpec:
    """How every rank builds its tower replica (JSON: it travels to the rank processes)."""

    checkpoint: str
    dtype: str = "float32"
    device: str = "cpu"  # "cuda": rank r on cuda:r
    batch_invariant: bool = False

    def build(self, rank: int = 0) -> VisionExecutor:
        from epd_encoder.models.registry import load_vision_model

        device = f"cuda:{rank}" if self.device == "cuda" else self.device
        model = load_vision_model(self.checkpoint, dtype=self.dtype, device=device, progress=False)
        return VisionExecutor(model.tower, device=device, dtype=model.dtype,  # type: ignore[arg-type]
                              batch_invariant=self.batch_invariant)


# -- the wire format of a share's outputs ------------------------------------------------
def pack(outputs: Sequence[ItemOutput]) -> tuple[torch.Tensor, torch.Tensor]:
    """(header, flat): header ``[ok, rows, width, n_deep, dtype code, numel]``."""
    if not outputs:
        return torch.tensor([_OK, 0, 0, 0, 0, 0], dtype=torch.int64), torch.empty(0)
    emb = torch.cat([o.embedding for o in outputs]).cpu()
    n_deep = len(outputs[0].deepstack or ())
    deep = [torch.cat([o.deepstack[j] for o in outputs]).cpu() for j in range(n_deep)]  # type: ignore[index]
    flat = torch.cat([emb.reshape(-1), *(d.reshape(-1) for d in deep)])
    header = [_OK, emb.shape[0], emb.shape[1], n_deep, _CODES.index(emb.dtype), flat.numel()]
    return torch.tensor(header, dtype=torch.int64), flat


def unpack(header: list[int], flat: torch.Tensor, counts: list[int]) -> list[ItemOutput]:
    """A share's outputs, one own tensor per item (no item pins the receive buffer)."""
    _, rows, width, n_deep, _, _ = header
    if rows != sum(counts):
        raise OutputMismatch(f"a rank returned {rows} rows; its items need {sum(counts)}")
    if not counts:
        return []
    parts = flat.split(rows * width)
    embs = parts[0].view(rows, width).split(counts)
    deeps = [p.view(rows, width).split(counts) for p in parts[1:1 + n_deep]]
    return [ItemOutput(e.clone(), tuple(d[i].clone() for d in deeps) if n_deep else None)
            for i, e in enumerate(embs)]


def failure_packet(reason: str) -> tuple[torch.Tensor, torch.Tensor]:
    raw = torch.frombuffer(bytearray(reason.encode()[:4000] or b"?"), dtype=torch.uint8)
    return torch.tensor([_FAILED, 0, 0, 0, 0, raw.numel()], dtype=torch.int64), raw


def receive_packet(src: int) -> tuple[list[int], torch.Tensor]:
    header = torch.empty(6, dtype=torch.int64)
    dist.recv(header, src=src)
    h = header.tolist()
    if h[0] not in (_OK, _FAILED) or not 0 <= h[4] < len(_CODES) or h[5] < 0:
        raise RankFailed(f"rank {src} sent a malformed result header {h}")
    flat = torch.empty(h[5], dtype=torch.uint8 if h[0] == _FAILED else _CODES[h[4]])
    if flat.numel():
        dist.recv(flat, src=src)
    return h, flat


def _items(work: Work, share: list[int], flat: torch.Tensor) -> list[PreprocessedImage]:
    sizes = [math.prod(work.shapes[i]) for i in share]
    return [PreprocessedImage(p.view(work.shapes[i]), tuple(work.grids[i]), work.num_tokens[i])  # type: ignore[arg-type]
            for i, p in zip(share, flat.split(sizes))]


# -- ranks 1..N-1 ----------------------------------------------------------------------
class DataRank:
    """A rank's side of data mode: receive its share, encode it, send the outputs back."""

    def __init__(self, rank: int, size: int, executor: VisionExecutor) -> None:
        self.rank, self.size, self.executor = rank, size, executor

    def digest(self, work: Work) -> bytes:
        return work.digest()

    def run(self, work: Work) -> None:
        share = lpt_assign(work.costs, self.size)[self.rank]
        if work.dtype not in DTYPES:
            raise RankFailed(f"batch {work.seq}: pixel dtype {work.dtype!r} is not one of {sorted(DTYPES)}")
        flat = torch.empty(sum(math.prod(work.shapes[i]) for i in share), dtype=DTYPES[work.dtype])
        if share:
            dist.recv(flat, src=0)
        try:  # a failed forward is reported, never a missing message (rank 0 would wait it out)
            header, payload = pack(self.executor.encode(_items(work, share, flat)))
        except Exception as e:
            log.warning("batch %d failed on rank %d: %s", work.seq, self.rank, e)
            header, payload = failure_packet(f"rank {self.rank}: {e}")
        dist.send(header, dst=0)
        if payload.numel():
            dist.send(payload, dst=0)


def make_data_rank(rank: int, size: int, **spec: object) -> DataRank:
    """The group factory of data mode (``epd_encoder.tp.data:make_data_rank``)."""
    return DataRank(rank, size, ExecutorSpec(**spec).build(rank))  # type: ignore[arg-type]


# -- rank 0 ----------------------------------------------------------------------------
class GroupExecutor:
    """What the TP executors share: rank 0's ``local`` executor for the grid checks, the
    ``group`` they close, and their use as a context manager (``start`` is each mode's)."""

    group: RankGroup
    local: VisionExecutor

    def start(self) -> "GroupExecutor":
        raise NotImplementedError

    def close(self) -> None:
        self.group.close()

    def __enter__(self) -> "GroupExecutor":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def expected_tokens(self, items: Sequence[PreprocessedImage]) -> list[int]:
        return self.local.expected_tokens(items)


class TPExecutor(GroupExecutor):
    """``VisionExecutor``'s interface over a data-parallel rank group.

    ``encode(items)`` returns one ``ItemOutput`` per item, in order, equal to the local
    executor's. A forward that fails on any rank fails the batch (``EncodeFailed``, as a
    single executor does); a rank that dies or hangs raises ``RankFailed`` from then on.
    ``device``/``dtype``/``tower``/``warmup`` are rank 0's replica's.

    Weights mode is the same group with another handler pair: a ``RankHandler`` whose
    ``run`` takes the pixels by ``group.broadcast_flat`` and runs its shard, and a rank-0
    exchange passed to ``group.run``; ``encode`` below is the template.
    """

    mode = "data"

    def __init__(self, spec: ExecutorSpec, size: int, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                 heartbeat_s: float = DEFAULT_HEARTBEAT_S, scheduler: dict | None = None,
                 on_failure=None) -> None:
        self.spec, self.size = spec, size
        self.group = RankGroup(size, "epd_encoder.tp.data:make_data_rank", asdict(spec), timeout_s=timeout_s,
                               heartbeat_s=heartbeat_s, scheduler=scheduler, device=spec.device,
                               on_failure=on_failure)
        self.local = spec.build(0)
        self.device, self.dtype, self.tower = self.local.device, self.local.dtype, self.local.tower
        self.batch_invariant = self.local.batch_invariant

    def start(self) -> "TPExecutor":
        self.group.start()
        return self

    def warmup(self, item: PreprocessedImage | None = None) -> None:
        self.local.warmup(item)

    def encode(self, items: Sequence[PreprocessedImage], *, keys: Sequence[tuple[str, int]] | None = None,
               costs: Sequence[int] | None = None) -> list[ItemOutput]:
        """``keys`` (request id, item index) and ``costs`` go into the batch digest; they
        default to the item positions and the pre-merge patch counts."""
        if not items:
            return []
        counts = self.expected_tokens(items)  # grid arithmetic checked before any rank sees the batch
        dtypes = {it.pixel_values.dtype for it in items}
        names = [n for n, d in DTYPES.items() if dtypes == {d}]
        if not names:
            raise EncodeFailed(f"a data-parallel batch needs one pixel dtype out of {sorted(DTYPES)}, got {dtypes}")
        keys = list(keys) if keys is not None else [("", i) for i in range(len(items))]
        costs = list(costs) if costs is not None else [max(1, it.num_patches) for it in items]
        work = Work(seq=1, mode=self.mode, request_ids=[k[0] for k in keys],
                    item_indices=[k[1] for k in keys], costs=costs, grids=[(int(t), int(h), int(w)) for t, h, w in (it.grid_thw for it in items)],
                    num_tokens=counts, shapes=[list(it.pixel_values.shape) for it in items], dtype=names[0])
        return self.group.run(work, lambda w: self._exchange(w, items, counts))

    def _exchange(self, work: Work, items: Sequence[PreprocessedImage], counts: list[int]) -> list[ItemOutput]:
        shares = lpt_assign(work.costs, self.size)
        sends = [dist.isend(torch.cat([items[i].pixel_values.reshape(-1).cpu() for i in share]), dst=r)
                 for r, share in enumerate(shares) if r and share]
        out: list[ItemOutput | None] = [None] * len(items)
        failures: list[str] = []
        try:  # rank 0's share runs while the others run theirs
            for i, o in zip(shares[0], self.local.encode([items[i] for i in shares[0]])):
                out[i] = o
        except Exception as e:
            failures.append(f"rank 0: {e}")
        for r in range(1, self.size):  # every rank's answer is read, whatever failed, so the wire stays in step
            header, flat = receive_packet(r)
            if header[0] == _FAILED:
                failures.append(flat.numpy().tobytes().decode(errors="replace"))
                continue
            try:
                got = unpack(header, flat, [counts[i] for i in shares[r]])
            except OutputMismatch as e:
                failures.append(f"rank {r}: {e}")
                continue
            for i, o in zip(shares[r], got):
                out[i] = o if o.embedding.device == self.device else o.map(lambda t: t.to(self.device))
        for s in sends:
            if s is not None:  # isend returns None only outside a group
                s.wait()
        if failures:
            raise EncodeFailed(f"batch {work.seq} of {len(items)} failed: " + "; ".join(failures))
        return out  # type: ignore[return-value]
