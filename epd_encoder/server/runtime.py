# SPDX-License-Identifier: Apache-2.0
"""Runtime: everything a server needs, built from the config tree, with a lifecycle.

``Runtime(config)`` loads the model and builds the engine; ``start()`` starts
the engine thread and runs a warm-up encode (``ready`` turns true after it);
``stop()`` refuses new work, drains in-flight requests up to the drain
timeout, then cancels the rest.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import torch
from blake3 import blake3
from PIL import Image
from prometheus_client import Gauge

from epd_encoder.api.metrics import Metrics
from epd_encoder.config import ServeConfig
from epd_encoder.engine.build import build_cache, build_engine
from epd_encoder.errors import NotReady
from epd_encoder.models.executor import VisionExecutor
from epd_encoder.models.registry import load_vision_model
from epd_encoder.preprocess.registry import load_preprocessor
from epd_encoder.server.executor import ServingExecutor
from epd_encoder.server import memory
from epd_encoder.server.front import EncodeFront
from epd_encoder.server.pull_store import PullStore
from epd_encoder.wire import dtype_name

log = logging.getLogger(__name__)
MiB = 1 << 20


def checkpoint_revision(path: Path, weights_digest: str) -> str:
    """The revision hashed into content keys: the configs plus the digest of the
    vision weights actually loaded, so any change to what the tower computes
    (a fine-tune with the same shapes included) changes every key."""
    h = blake3()
    for name in ("config.json", "preprocessor_config.json"):
        f = path / name
        if f.is_file():
            h.update(name.encode() + b"\0" + f.read_bytes())
    h.update(weights_digest.encode())
    return h.hexdigest()[:16]


def _device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(spec)


class Runtime:
    def __init__(self, config: ServeConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        if config.model.model is None:
            from epd_encoder.models.tiny import default_model_dir

            path = default_model_dir()
            log.info("no --model given: serving the built-in tiny model at %s", path)
            self.source = None
        else:
            from epd_encoder.models.loading.hub import resolve

            # A local directory as is, or a Hub id fetched (vision shards only) into the HF cache.
            self.source = resolve(config.model.model, config.model.revision)
            path = self.source.path
        memory.tune()  # before the first large image: freed pixel blocks go back to the OS
        from epd_encoder.server import cpus

        # Before the first forward: threads started later take torch's count when they first run an op.
        self.cpus = cpus.budget(config.threads)
        torch.set_num_threads(self.cpus.per_rank(config.parallel.tp))  # a TP group sets the same share
        self.preprocess_workers = self.cpus.preprocess_workers(config.preprocess_workers)
        log.info("CPU budget: %s; %d preprocessing workers", self.cpus.describe(), self.preprocess_workers)
        device = _device(config.model.device)
        model_id = config.model.model_id or (self.source and self.source.repo_id)
        # A rank failure (--tp > 1) may come from any thread once the group is up: see _rank_failed.
        self.failure: BaseException | None = None
        self.on_failure = None  # set by the app (api/app.py AppState.load): stop and exit 1
        self.executor: Any
        if config.parallel.tp > 1:
            from epd_encoder.server.parallel import build_executor

            # The TP executor loads its own weights (replica or shard); the model keeps TP1's digest.
            self.executor, self.model = build_executor(config, path, device, model_id, self._rank_failed,
                                                       threads=self.cpus.per_rank(config.parallel.tp))
        else:
            self.model = load_vision_model(path, dtype=config.model.dtype, device=device, model_id=model_id,
                                           tower=config.model.tower)
            self.executor = VisionExecutor(self.model.tower, device=device, dtype=self.model.dtype,
                                           batch_invariant=config.model.batch_invariant)
        try:
            self._assemble(config, path, device, metrics)
        except BaseException:
            self._abandon()  # no rank, heartbeat or pool outlives a runtime that failed to build
            raise

    def _assemble(self, config: ServeConfig, path: Path, device: torch.device, metrics: Metrics | None) -> None:
        """Everything built on the executor, up to the probe encode (``__init__``'s second half)."""
        self.model_id = self.model.model_id  # display only: responses' "model"
        # The tower, the batch mode and the dtype change the last bits of an embedding: part of the key.
        from epd_encoder.server.parallel import key_mode

        mode = (f"{config.model.tower}{'+batch-invariant' if config.model.batch_invariant else ''}"
                f"{key_mode(config)}:{dtype_name(self.model.dtype)}")
        self.revision = f"{checkpoint_revision(path, self.model.weights_digest)}:{mode}"
        # Keys name the checkpoint by what it computes (configs + vision weights, in
        # ``revision``), never by its path or display name: replicas mounted anywhere, or
        # fetched from the Hub, share keys (docs/models.md, "Model sources").
        self.key_identity = self.family
        limits = config.limits
        bounds = None
        if limits.min_pixels_floor is not None or limits.max_pixels_ceiling is not None:
            base = load_preprocessor(path, backend=config.model.preprocess_backend).params()
            bounds = (limits.min_pixels_floor or base["min_pixels"],
                      limits.max_pixels_ceiling or base["max_pixels"])
        self.preprocessor = load_preprocessor(path, pixel_bounds=bounds, backend=config.model.preprocess_backend)
        self.metrics = metrics if metrics is not None else Metrics()
        self.cache = build_cache(
            config.engine,
            to_host=lambda v: v.map(lambda t: t.to("cpu", non_blocking=False)),
            to_device=lambda v: v.map(lambda t: t.to(device, non_blocking=False)),
        )
        serving = ServingExecutor(self.executor, self.preprocessor, self.metrics,
                                  max_batch_cost=config.engine.scheduler.max_batch_cost)
        from epd_encoder.server.parallel import wrap_scheduler

        self.engine = build_engine(config.engine, serving, self.cache, wrap_scheduler=wrap_scheduler(self.executor))
        self.metrics.bind(cache=self.cache, queue_depth=self.engine.worker.pending_size,
                          pending_cost=lambda: self.engine.outstanding_cost,
                          coalesced=lambda: self.engine.worker.coalesced_total)
        self.pull_store = PullStore(ttl_s=config.pull_ttl, capacity_bytes=config.pull_store_mb * MiB)
        self.shared = self._shared_tier(config, device)
        self.front = EncodeFront(
            engine=self.engine, cache=self.cache, preprocessor=self.preprocessor,
            model_id=self.key_identity, revision=self.revision, limits=limits, metrics=self.metrics,
            request_timeout=config.request_timeout, workers=self.preprocess_workers,
            fetcher=self._fetcher(), attention_weight=config.engine.scheduler.attention_weight,
            max_preprocess_items=config.max_preprocess_items, trim=memory.trim,
            video=self._video(path), max_batch_cost=config.engine.scheduler.max_batch_cost,
            shared=self.shared,
        )
        serving.held = self.front.decoded  # the prefetched batch is charged with the staged pixels
        # Read at scrape time; 0 whenever nothing is being decoded or queued (the soak checks it).
        Gauge("epd_decoded_bytes", "Host bytes the front answers for: images being decoded (predicted), "
              "staged pixels of queued items, the prefetched batch",
              registry=self.metrics.registry).set_function(lambda: self.front.decoded.used)
        self._ready = threading.Event()
        self._push, self._push_lock, self._push_closed = None, threading.Lock(), False
        probe = self.executor.encode([self.preprocessor.preprocess(Image.new("RGB", (64, 64)))])[0]
        self.hidden_size = int(probe.embedding.shape[1])
        self.num_deepstack = len(probe.deepstack or ())

    def _shared_tier(self, config: ServeConfig, device: torch.device):
        """The fleet's L3 on Mooncake Store (--shared-cache), or None."""
        if not config.shared.enabled:
            return None
        from epd_encoder.cache.shared_build import build_shared_tier

        tier = build_shared_tier(config.shared, to_device=lambda v: v.map(lambda t: t.to(device)))
        self.metrics.bind_shared(tier)
        return tier

    @property
    def push(self):
        """The push sender, started on first use (its sockets and threads cost nothing before)."""
        with self._push_lock:
            if self._push is None:
                if self._push_closed:  # stop() has run: a sender made now would never be closed
                    raise NotReady("the server is shutting down")
                from epd_encoder.transfer.sender import PushSender

                p = self.config.push
                self._push = PushSender(
                    sender_id=f"{self.model_id}/{os.getpid()}/{uuid.uuid4().hex[:8]}",
                    bootstrap_timeout=p.bootstrap_timeout, transfer_timeout=p.transfer_timeout,
                    record_ttl=p.room_record_ttl, max_queue_per_peer=p.max_rooms_per_peer,
                    max_peers=p.max_push_peers, proven_slots=p.proven_peer_slots,
                    peer_idle_s=p.push_peer_idle_timeout,
                    allowed_targets=p.allowed_targets, observer=self.metrics.push)
            return self._push

    def wire_item(self, prepared):
        from epd_encoder.transfer.messages import WireItem

        import msgspec

        from epd_encoder.transfer.messages import VideoWire

        video = None if prepared.meta is None else msgspec.convert(prepared.meta, VideoWire)
        return WireItem(key=prepared.key.hex(), num_tokens=prepared.num_tokens,
                        grid_thw=tuple(prepared.grid_thw), hidden_size=self.hidden_size,
                        dtype=dtype_name(self.executor.dtype), num_deepstack=self.num_deepstack,
                        modality=prepared.modality, video=video)

    def _fetcher(self):
        if not self.config.fetch.allow_url_fetch:
            return None
        from epd_encoder.api.fetch import UrlFetcher
        from epd_encoder.errors import VideoTooLarge

        f = self.config.fetch
        image = UrlFetcher(max_bytes=self.config.limits.max_image_bytes, connect_timeout_s=min(5.0, f.fetch_timeout),
                           total_timeout_s=f.fetch_timeout, max_redirects=f.fetch_max_redirects,
                           allow_hosts=f.allow_hosts, allow_private=f.fetch_allow_private)
        return {"image": image, "video": image.limited(self.config.video.max_video_bytes, VideoTooLarge)}

    def _video(self, path: Path):
        """The video path of a family that has one (the Qwen families), else None: video
        items then get 415."""
        from epd_encoder.errors import UnsupportedModel
        from epd_encoder.preprocess.registry import load_video_preprocessor
        from epd_encoder.preprocess.video import VideoBounds
        from epd_encoder.preprocess.video_decode import VideoLimits
        from epd_encoder.server.media import VideoMedia

        v = self.config.video
        try:
            pre = load_video_preprocessor(path, bounds=VideoBounds(max_frames=v.max_video_sampled_frames))
        except UnsupportedModel:
            return None
        limits = VideoLimits(
            max_bytes=v.max_video_bytes, max_pixels=v.max_video_frame_pixels,
            max_duration_s=v.max_video_seconds, max_frames=v.max_video_decoded_frames,
            max_decoded_pixels=v.max_video_decoded_pixels,
            max_output_pixels=v.max_video_sampled_frames * v.max_video_frame_pixels)
        return VideoMedia(pre, limits, self.metrics)

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.engine.running and self.failure is None

    def _rank_failed(self, error: BaseException) -> None:
        """The TP group failed (a rank died or hung): called once, from the thread that saw it.
        Unhealthy at once, every accepted request ends with ``error``, new ones are refused
        with it; ``on_failure`` (the app) then stops the server, which exits 1."""
        self.failure = error  # ``ready`` is false from here on
        engine = getattr(self, "engine", None)  # None while __init__ runs: its probe raises instead
        if engine is not None:
            engine.fail_all(error)
        if self.on_failure is not None:
            self.on_failure(error)

    def _abandon(self) -> None:
        front = getattr(self, "front", None)
        if front is not None:
            front.close()
        self._close_executor()

    def _close_executor(self) -> None:
        close = getattr(self.executor, "close", None)  # a TP executor: Shutdown to the ranks, group down
        if close is not None:
            close()

    @property
    def family(self) -> str:
        return self.model.family.name

    def start(self) -> None:
        try:
            if self.shared is not None:
                self.shared.start()  # connects in the background: misses until it is up
            self.engine.start()
            self.warmup()
            if self.failure is not None:
                raise self.failure
        except BaseException:
            self.engine.stop(drain=False, timeout=5.0)
            if self.shared is not None:
                self.shared.close()
            self._close_executor()
            raise
        self._ready.set()
        log.info("ready: %s (%s) on %s, %s", self.model_id, self.family, self.executor.device,
                 str(self.executor.dtype).removeprefix("torch."))

    def warmup(self) -> None:
        """A real decode → preprocess → forward on mixed sizes, outside the cache."""
        rng = np.random.default_rng(0)
        images = [Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))
                  for h, w in ((64, 64), (96, 160))]
        self.executor.encode([self.preprocessor.preprocess(im) for im in images])
        log.info("warm-up encode done: %s", json.dumps({"items": len(images)}))

    def stop(self) -> None:
        deadline = time.monotonic() + self.config.drain_timeout
        self._ready.clear()
        self.engine.stop(drain=True, timeout=self.config.drain_timeout)
        if self.engine.running:
            self.engine.stop(drain=False, timeout=5.0)
        self.front.close()
        with self._push_lock:
            push, self._push_closed = self._push, True
        if push is not None:
            # Rooms already answered with 202 finish within what is left of the drain budget.
            push.close(timeout=max(0.0, deadline - time.monotonic()))
        if self.shared is not None:
            self.shared.close()
        self._close_executor()  # last: the engine has drained, so no batch is left for the ranks
