# SPDX-License-Identifier: Apache-2.0
"""``GET /info`` and the ``epd_build_info`` metric: what this server serves, in one place."""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client.core import GaugeMetricFamily

from epd_encoder import __version__
from epd_encoder.api.schemas import InfoCpus, InfoFeatures, InfoLimits, InfoResponse
from epd_encoder.config import ServeConfig
from epd_encoder.transfer.base import backends
from epd_encoder.wire import dtype_name

BUILD_LABELS = ("version", "model", "revision", "family", "dtype", "device")


def info(rt: Any, config: ServeConfig) -> InfoResponse:
    """The loaded runtime's identity and the configured bounds (read, never derived twice)."""
    lim, video, sched, cpu = config.limits, config.video, config.engine.scheduler, rt.cpus
    return InfoResponse(
        version=__version__, model=rt.model_id, revision=rt.revision, family=rt.family,
        dtype=dtype_name(rt.executor.dtype), device=str(rt.executor.device),
        hidden_size=rt.hidden_size, num_deepstack=rt.num_deepstack,
        limits=InfoLimits(
            max_items=lim.max_items, max_body_bytes=config.max_body_mb << 20,
            max_image_bytes=lim.max_image_bytes, max_image_pixels=lim.max_image_pixels,
            max_aspect_ratio=lim.max_aspect_ratio, max_video_bytes=video.max_video_bytes,
            max_video_seconds=video.max_video_seconds, max_video_frame_pixels=video.max_video_frame_pixels,
            max_video_sampled_frames=video.max_video_sampled_frames, max_batch_cost=sched.max_batch_cost,
            max_batch_items=sched.max_batch_items, max_pending_cost=config.engine.max_pending_cost,
            request_timeout_s=config.request_timeout),
        features=InfoFeatures(
            modalities=list(rt.front.media),
            delivery_modes=["inline", "pull", "push", "ec_store"] if config.ec_store.enabled
            else ["inline", "pull", "push"],
            push_backends=list(backends()), preprocess_backend=config.model.preprocess_backend,
            tower=config.model.tower, batch_invariant=config.model.batch_invariant,
            url_fetch=config.fetch.allow_url_fetch, tp=config.parallel.tp,
            tp_mode=config.parallel.tp_mode if config.parallel.tp > 1 else None),
        cpus=InfoCpus(threads=cpu.threads, source=cpu.source, affinity=cpu.affinity, quota=cpu.quota,
                      host=cpu.host, preprocess_workers=rt.preprocess_workers, wait_policy=cpu.wait_policy))


class BuildInfoCollector:
    """``epd_build_info{version,model,revision,family,dtype,device} 1``, read at scrape time.

    Exported only once the model has loaded: before that model, revision and device are
    unknown, and a series with empty labels would linger next to the real one.
    """

    def __init__(self, runtime: Callable[[], Any]) -> None:
        self._runtime = runtime

    def collect(self):
        rt = self._runtime()
        if rt is None:
            return
        family = GaugeMetricFamily("epd_build_info", "The server's version and the model it serves",
                                   labels=BUILD_LABELS)
        family.add_metric([__version__, rt.model_id, rt.revision, rt.family, dtype_name(rt.executor.dtype),
                           str(rt.executor.device)], 1)
        yield family

    def describe(self):
        # Registered before the model loads: an empty describe keeps the registry from calling
        # collect() (and reading a runtime that is not there) at registration.
        return []
