# SPDX-License-Identifier: Apache-2.0
"""Videos on the prefill side: placeholders, timestamps, runs, positions, deepstack.

A video item is a ``VisionItem`` whose ``modality`` is ``"video"``. Besides the
rows and ``grid_thw`` (``T > 1`` temporal patches allowed), it carries what
the aggregated processor derives from the clip and the prefill cannot:

* ``second_per_grid_ts`` (Qwen2.5-VL): seconds per temporal patch,
  ``temporal_patch_size / sampled fps``; it spaces the video's temporal mrope
  positions (``get_rope_index``);
* ``timestamps`` (Qwen3-VL, Qwen3.5): one time in seconds per temporal patch
  (``frame_timestamps``); the processor writes each as ``<t seconds>`` text
  in front of that patch's tokens.

What an item is, and how its metadata is read, is ``prefill.items``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from epd_encoder.errors import InvalidInput
from epd_encoder.prefill.items import IMAGE, VIDEO, item_modality, video_meta

__all__ = ["expand_vision_placeholders", "frame_timestamps", "timestamp_text"]

# Their processor splits a video into temporal groups, each "<t seconds>" + vision_start +
# tokens + vision_end, and their get_rope_index gives each group its own (1, h, w) grid.
TIMESTAMPED_MODEL_TYPES = frozenset({"qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"})
# Their get_rope_index spaces a video's temporal positions by tokens_per_second * second_per_grid_ts.
SECONDS_MODEL_TYPES = frozenset({"qwen2_5_vl"})


def timestamp_text(seconds: float) -> str:
    """The text Qwen3VLProcessor writes before a temporal patch (one decimal, as it formats)."""
    return f"<{seconds:.1f} seconds>"


def frame_timestamps(frame_indices: Sequence[int], fps: float, temporal_patch_size: int = 2) -> list[float]:
    """Seconds per temporal patch, as Qwen3VLProcessor._calculate_timestamps computes them.

    ``frame_indices`` are the sampled frames' indices in the source video at
    ``fps``. An incomplete last patch repeats the last index; a patch's time is
    the mean of its first and last frame's.
    """
    idx = [int(i) for i in frame_indices]
    if not idx or fps <= 0:
        raise InvalidInput(f"frame_timestamps needs frames and fps > 0, got {len(idx)} frames at {fps}")
    idx += [idx[-1]] * (-len(idx) % temporal_patch_size)
    secs = [i / fps for i in idx]
    return [(secs[i] + secs[i + temporal_patch_size - 1]) / 2 for i in range(0, len(secs), temporal_patch_size)]


def _grid(item: Any, i: int) -> tuple[int, int, int]:
    grid = tuple(int(g) for g in item.grid_thw)
    if len(grid) != 3 or min(grid) < 1:
        raise InvalidInput(f"item {i}: grid_thw must be positive (t, h, w), got {grid}")
    return grid  # type: ignore[return-value]


def video_runs(config: Any, item: Any, i: int) -> list[int]:
    """Placeholder run lengths one video takes in the expanded prompt, in order."""
    t, h, w = _grid(item, i)
    merge = int(config.vision_config.spatial_merge_size)
    if config.model_type in TIMESTAMPED_MODEL_TYPES:
        return [h * w // (merge * merge)] * t
    return [t * h * w // (merge * merge)]


def _timestamps(config: Any, item: Any, i: int) -> list[float]:
    ts = video_meta(item, "timestamps")
    t = _grid(item, i)[0]
    if ts is None or len(ts) != t:
        got = "none" if ts is None else len(ts)
        raise InvalidInput(f"item {i}: {config.model_type} needs one timestamp per temporal patch ({t}), got {got}")
    return [float(s) for s in ts]


def expand_vision_placeholders(
    input_ids: Sequence[int] | torch.Tensor, items: Sequence[Any], config: Any, tokenizer: Any = None
) -> list[int]:
    """The 1-D prompt the aggregated processor would produce, from the items' metadata.

    Each image token (``config.image_token_id``) and video token
    (``config.video_token_id``) is one item's placeholder, as the chat template
    writes it between vision start/end; items are in prompt order. An image
    becomes ``t*h*w/merge²`` image tokens, and so does a video on Qwen2-VL and
    Qwen2.5-VL. On Qwen3-VL/Qwen3.5 a video becomes, per temporal patch,
    ``tokenizer.encode(timestamp_text(t))`` + vision_start + ``h*w/merge²``
    video tokens + vision_end (Qwen3VLProcessor.replace_video_token), so the
    tokenizer and the items' ``timestamps`` are needed. Only metadata is read
    (``grid_thw``, ``modality``, ``timestamps``), never the embeddings.
    """
    ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
    if ids and isinstance(ids[0], list):
        raise InvalidInput("expand_vision_placeholders takes one sequence, not a batch")
    image_tok, video_tok = int(config.image_token_id), int(config.video_token_id)
    kinds = [item_modality(it) for it in items]
    found = (ids.count(image_tok), ids.count(video_tok))
    want = (kinds.count(IMAGE), kinds.count(VIDEO))
    if found != want:
        raise InvalidInput(f"prompt has {found[0]} image and {found[1]} video placeholders "
                           f"but the items are {want[0]} images and {want[1]} videos")
    queues = {IMAGE: [i for i, k in enumerate(kinds) if k == IMAGE],
              VIDEO: [i for i, k in enumerate(kinds) if k == VIDEO]}
    merge = int(config.vision_config.spatial_merge_size)
    timestamped = config.model_type in TIMESTAMPED_MODEL_TYPES
    out: list[int] = []
    for tok in ids:
        if tok not in (image_tok, video_tok):
            out.append(tok)
            continue
        i = queues[IMAGE if tok == image_tok else VIDEO].pop(0)
        t, h, w = _grid(items[i], i)
        if tok == image_tok or not timestamped:
            out.extend([tok] * (t * h * w // (merge * merge)))
            continue
        if tokenizer is None:
            raise InvalidInput(f"{config.model_type} writes video timestamps as text: pass the tokenizer")
        start, end = int(config.vision_start_token_id), int(config.vision_end_token_id)
        for seconds in _timestamps(config, items[i], i):
            out.extend(tokenizer.encode(timestamp_text(seconds), add_special_tokens=False))
            out.extend([start, *[tok] * (h * w // (merge * merge)), end])
    return out


# -- what build_generate_kwargs / build_prefill_inputs need of the videos ---------


def check_video_runs(config: Any, ids: torch.Tensor, videos: Sequence[tuple[int, Any]]) -> torch.Tensor:
    """Match the prompt's video token runs (row-major) to the videos; returns the ``[B, L]`` mask.

    ``videos`` are ``(item index, item)`` in prompt order. ``InvalidInput``
    names the video, and on timestamped families the temporal patch.
    """
    token = int(config.video_token_id)
    mask = ids == token
    runs = [n for row in mask for n in token_runs(row)]
    want = [(k, g, n) for k, (i, it) in enumerate(videos) for g, n in enumerate(video_runs(config, it, i))]
    if len(runs) != len(want):
        raise InvalidInput(
            f"video placeholders: prompt has {len(runs)} runs ({sum(runs)} tokens) but the {len(videos)} video "
            f"items need {len(want)} ({sum(n for *_, n in want)} tokens); expand them with expand_vision_placeholders"
        )
    timestamped = config.model_type in TIMESTAMPED_MODEL_TYPES
    for run, (k, g, n) in zip(runs, want):
        if run != n:
            where = f"video {k}, temporal patch {g}" if timestamped else f"video {k}"
            raise InvalidInput(f"{where}: prompt has {run} placeholder tokens, item has {n} tokens")
    return mask


def second_per_grid_ts(config: Any, videos: Sequence[tuple[int, Any]]) -> torch.Tensor | None:
    """``[n_videos]`` float32, as the Qwen2.5-VL processor returns it; ``None`` where unused.

    Required on Qwen2.5-VL: without it transformers would space the temporal
    positions as if every temporal patch were one second, silently.
    """
    if config.model_type not in SECONDS_MODEL_TYPES or not videos:
        return None
    values = []
    for i, it in videos:
        s = video_meta(it, "second_per_grid_ts")
        if s is None or not math.isfinite(float(s)) or float(s) <= 0:
            raise InvalidInput(f"item {i}: {config.model_type} video needs second_per_grid_ts > 0 "
                               f"(temporal_patch_size / sampled fps), got {s}")
        values.append(float(s))
    # A list of Python floats becomes float32, as the processor's BatchFeature makes it.
    return torch.tensor(values)


def merge_visual(
    text: torch.Tensor,
    parts: Sequence[tuple[torch.Tensor | None, Sequence[torch.Tensor], list[list[torch.Tensor]] | None]],
) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor] | None]:
    """``inputs_embeds``, ``visual_pos_masks`` and deepstack, as transformers' forward builds them.

    ``parts`` is ``[(image_mask, rows, deepstack[layer][item]), (video_mask, ...)]``;
    a modality without items has ``None`` or no rows. Images are scattered first,
    then videos; with both, each deepstack layer holds the visual rows in
    prompt order (Qwen3-VL's joint tensor). The deepstack result is ``None``
    for families without deepstack.
    """
    present = [(m, rows, deep) for m, rows, deep in parts if m is not None and len(rows)]
    embeds = text
    for mask, rows, _ in present:
        flat = torch.cat(list(rows)).to(text.device, text.dtype)
        embeds = embeds.masked_scatter(mask.unsqueeze(-1).to(text.device), flat)
    if not present or present[0][2] is None:
        return embeds, None, None
    visual = present[0][0]
    for mask, *_ in present[1:]:
        visual = visual | mask
    layers = []
    for j in range(len(present[0][2])):
        cat = [torch.cat(deep[j]).to(text.device, text.dtype) for _, _, deep in present]
        if len(cat) == 1:
            layers.append(cat[0])
            continue
        joint = cat[0].new_zeros(int(visual.sum()), cat[0].shape[-1])
        for (mask, *_), rows in zip(present, cat):
            joint[mask[visual]] = rows
        layers.append(joint)
    return embeds, visual, layers


def token_runs(on: torch.Tensor) -> list[int]:
    """Lengths of the runs of ``True`` in a 1-D bool tensor, in order."""
    on = on.to(torch.int8)
    edges = torch.diff(on, prepend=on.new_zeros(1), append=on.new_zeros(1))
    return ((edges == -1).nonzero().flatten() - (edges == 1).nonzero().flatten()).tolist()
