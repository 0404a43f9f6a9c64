# SPDX-License-Identifier: Apache-2.0
"""Prefill-side assembly for transformers Qwen-VL models fed by the encode tier.

A prefill worker receives, per image, the embedding rows (``[num_tokens,
hidden]``), the deepstack tensors (Qwen3-VL) and ``grid_thw``. With these it
runs the language model exactly as the aggregated model would on pixels:

* ``expand_image_placeholders`` turns a prompt with one image token per image
  into the model's prompt with ``num_tokens`` copies per image
  (``video.expand_vision_placeholders`` does images and videos, Qwen3
  timestamps text included);
* ``build_generate_kwargs`` gives kwargs for ``model(**kw)`` and
  ``model.generate(**kw)`` through transformers' own precomputed-encoder path
  (``mm_encoder_outputs``), so the scatter, mrope positions and deepstack
  injection are transformers' code, unchanged;
* ``build_prefill_inputs`` makes those tensors explicit (``inputs_embeds``,
  mrope ``position_ids`` from the model's ``get_rope_index``, rope deltas,
  deepstack masks) for a worker that drives the text model itself;
  ``prefill_forward`` and ``greedy_generate`` run them.

Every mismatch between the prompt and the items raises ``InvalidInput``
naming the numbers, before any forward.
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from epd_encoder.errors import InvalidInput, UnsupportedModel
from epd_encoder.prefill import items as _items
from epd_encoder.prefill import kimi as _kimi
from epd_encoder.prefill import video as _video

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "PrefillInputs",
    "VisionItem",
    "build_generate_kwargs",
    "build_prefill_inputs",
    "expand_image_placeholders",
    "greedy_generate",
    "prefill_forward",
]

SUPPORTED_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"}) | _kimi.MODEL_TYPES


class VisionItem(Protocol):
    """One received image or video, in prompt order.

    ``embedding`` is ``[num_tokens, hidden]``; ``deepstack`` is one tensor of the
    same shape per deepstack layer (Qwen3-VL), else ``None``; ``grid_thw`` is the
    pre-merge patch grid. ``EncodedItem`` (client) and pushed items match it.
    Optional attributes, read with defaults (``prefill.items``): ``modality``
    (``"image"`` when absent, or ``"video"``), and for videos
    ``second_per_grid_ts`` (Qwen2.5-VL) and per-temporal-patch ``timestamps``
    in seconds (Qwen3-VL/Qwen3.5). ``items.as_video`` adds them to any item.
    """

    @property
    def embedding(self) -> torch.Tensor: ...

    @property
    def deepstack(self) -> Sequence[torch.Tensor] | None: ...

    @property
    def grid_thw(self) -> Sequence[int]: ...


@dataclass(frozen=True)
class PrefillInputs:
    """The text model's inputs for one prefill, made explicit.

    ``position_ids`` is ``[3, B, L]`` (temporal, height, width mrope rows) and
    ``rope_deltas`` is ``[B, 1]``: a token generated at text position ``p`` sits
    at mrope position ``p + rope_delta`` in all three rows. ``visual_pos_masks``
    (``[B, L]`` bool) and ``deepstack_visual_embeds`` (one ``[n_image_tokens,
    hidden]`` tensor per deepstack layer) are set for deepstack models only.
    """

    input_ids: torch.Tensor
    inputs_embeds: torch.Tensor
    position_ids: torch.Tensor
    rope_deltas: torch.Tensor
    attention_mask: torch.Tensor | None = None
    visual_pos_masks: torch.Tensor | None = None
    deepstack_visual_embeds: list[torch.Tensor] | None = None

    def text_model_kwargs(self) -> dict[str, Any]:
        """Kwargs for ``model.model.language_model(...)`` (the prefill step)."""
        kw: dict[str, Any] = {
            "inputs_embeds": self.inputs_embeds,
            "position_ids": self.position_ids,
            "attention_mask": self.attention_mask,
        }
        if self.deepstack_visual_embeds is not None:
            kw["visual_pos_masks"] = self.visual_pos_masks
            kw["deepstack_visual_embeds"] = self.deepstack_visual_embeds
        return kw


def expand_image_placeholders(
    input_ids: Sequence[int] | torch.Tensor, num_tokens: Sequence[int], image_token_id: int
) -> list[int]:
    """Replace the i-th ``image_token_id`` of a 1-D prompt by ``num_tokens[i]`` copies.

    Each occurrence of the token is one image's placeholder (as the chat template
    writes it, between vision start/end tokens). ``InvalidInput`` when the number
    of placeholders differs from ``len(num_tokens)`` or a count is below 1.
    """
    ids = input_ids.tolist() if isinstance(input_ids, torch.Tensor) else list(input_ids)
    if ids and isinstance(ids[0], list):
        raise InvalidInput("expand_image_placeholders takes one sequence, not a batch")
    found = ids.count(image_token_id)
    if found != len(num_tokens):
        raise InvalidInput(
            f"prompt has {found} image placeholders (token {image_token_id}) but {len(num_tokens)} images"
        )
    counts = iter(num_tokens)
    out: list[int] = []
    for tok in ids:
        if tok != image_token_id:
            out.append(tok)
            continue
        n = int(next(counts))
        if n < 1:
            raise InvalidInput(f"an image needs at least 1 token, got {n}")
        out.extend([image_token_id] * n)
    return out


# -- validation ---------------------------------------------------------------


@dataclass(frozen=True)
class _Checked:
    input_ids: torch.Tensor  # [B, L] long
    attention_mask: torch.Tensor | None
    image_mask: torch.Tensor  # [B, L] bool
    mm_token_type_ids: torch.Tensor  # [B, L] int
    grid_thw: torch.Tensor  # [n_images, 3] long
    embeds: list[torch.Tensor]
    deepstack: list[list[torch.Tensor]] | None  # [layer][image]
    # Videos, the same way (empty when there are none); mm_token_type_ids is 2 at their tokens.
    video_mask: torch.Tensor | None = None
    video_grid_thw: torch.Tensor | None = None
    video_embeds: list[torch.Tensor] = ()  # type: ignore[assignment]
    video_deepstack: list[list[torch.Tensor]] | None = None
    second_per_grid_ts: torch.Tensor | None = None


def _base(model: Any) -> Any:
    base = getattr(model, "model", None)
    rope = hasattr(base, "get_rope_index") or _is_kimi(model)  # Kimi K2.5: 1-D positions, no rope index
    if base is None or not rope or not hasattr(model, "lm_head"):
        raise UnsupportedModel(
            f"{type(model).__name__} is not a transformers Qwen-VL ForConditionalGeneration model"
        )
    return base


def _is_kimi(model: Any) -> bool:
    return getattr(getattr(model, "config", None), "model_type", None) in _kimi.MODEL_TYPES


def _num_deepstack(config: Any) -> int:
    return len(getattr(config.vision_config, "deepstack_visual_indexes", None) or ())


def _check(model: Any, input_ids, items: Sequence[VisionItem], attention_mask) -> _Checked:
    config = model.config
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise UnsupportedModel(
            f"prefill assembly supports {sorted(SUPPORTED_MODEL_TYPES)}, not {config.model_type!r}"
        )
    _base(model)
    ids = torch.as_tensor(input_ids, dtype=torch.long)
    if ids.dim() == 1:
        ids = ids.unsqueeze(0)
    if ids.dim() != 2:
        raise InvalidInput(f"input_ids must be [L] or [B, L], got shape {tuple(ids.shape)}")
    mask = None
    if attention_mask is not None:
        mask = torch.as_tensor(attention_mask, device=ids.device)
        mask = mask.unsqueeze(0) if mask.dim() == 1 else mask
        if tuple(mask.shape) != tuple(ids.shape):
            raise InvalidInput(f"attention_mask shape {tuple(mask.shape)} != input_ids {tuple(ids.shape)}")
    token = int(config.image_token_id)
    kinds = [_items.item_modality(it) for it in items]
    images = [(i, it) for i, (it, k) in enumerate(zip(items, kinds)) if k == _items.IMAGE]
    videos = [(i, it) for i, (it, k) in enumerate(zip(items, kinds)) if k == _items.VIDEO]
    runs = [n for row in ids for n in _video.token_runs(row == token)]
    if len(runs) != len(images):
        what = "items" if not videos else "image items"
        raise InvalidInput(
            f"prompt has {len(runs)} image placeholder runs ({sum(runs)} tokens) but {len(images)} {what}; "
            "expand each placeholder with expand_image_placeholders"
        )
    merge = int(config.vision_config.spatial_merge_size)
    hidden = int(config.text_config.hidden_size)
    n_deep = _num_deepstack(config)
    grids, embeds, deep = _items.check_rows(config, images, merge, hidden, n_deep)
    for k, ((i, item), run, emb) in enumerate(zip(images, runs, embeds)):
        if run != emb.shape[0]:
            raise InvalidInput(f"image {k}: prompt has {run} placeholder tokens, item has {emb.shape[0]} tokens")
    video_token = getattr(config, "video_token_id", None)
    if not videos and video_token is not None and bool((ids == int(video_token)).any()):
        raise InvalidInput("the prompt has video placeholders but no item has modality 'video'")
    v_grids, v_embeds, v_deep = _items.check_rows(config, videos, merge, hidden, n_deep)
    video_mask = _video.check_video_runs(config, ids, videos) if videos else None
    image_mask = ids == token
    # transformers' processor types: 0 text, 1 image, 2 video (get_rope_index groups by them).
    types = image_mask.to(torch.int32)
    v_grid_t = None
    if video_mask is not None:
        types = types.masked_fill(video_mask, 2)
        v_grid_t = torch.tensor(v_grids, dtype=torch.long, device=ids.device).reshape(-1, 3)
    grid_t = torch.tensor(grids, dtype=torch.long, device=ids.device).reshape(-1, 3)
    return _Checked(
        ids, mask, image_mask, types, grid_t, embeds, deep if n_deep else None,
        video_mask=video_mask, video_grid_thw=v_grid_t, video_embeds=v_embeds,
        video_deepstack=v_deep if n_deep else None,
        second_per_grid_ts=_video.second_per_grid_ts(config, videos),
    )


# -- the official path: transformers' own precomputed-encoder kwargs ------------


def _encoder_output(model: Any, embeds: list[torch.Tensor], deepstack: list[list[torch.Tensor]] | None) -> Any:
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    pooled = tuple(embeds)
    if deepstack is None:
        return BaseModelOutputWithPooling(pooler_output=pooled)
    # The Qwen3-VL output class of the model's own module (MoE variants define their own).
    cls = getattr(inspect.getmodule(type(model)), "BaseModelOutputWithDeepstackFeatures", None)
    if cls is None:
        from transformers.models.qwen3_vl import modeling_qwen3_vl

        cls = modeling_qwen3_vl.BaseModelOutputWithDeepstackFeatures
    return cls(pooler_output=pooled, deepstack_features=[tuple(layer) for layer in deepstack])


def build_generate_kwargs(
    model: Any,
    input_ids: Sequence[int] | torch.Tensor,
    items: Sequence[VisionItem],
    attention_mask: torch.Tensor | None = None,
) -> dict[str, Any]:
    """Kwargs for ``model(**kw)`` / ``model.generate(**kw)`` with precomputed images and videos.

    ``input_ids`` (``[L]`` or ``[B, L]``) already holds ``num_tokens`` image
    tokens per item, items in prompt order (row-major over the batch). The
    result carries ``input_ids``, ``attention_mask`` (when given),
    ``mm_token_type_ids``, ``image_grid_thw`` and ``mm_encoder_outputs``:
    transformers scatters the rows, computes the mrope positions and injects
    deepstack itself. With video items also ``video_grid_thw``,
    ``mm_encoder_outputs["video"]`` and, on Qwen2.5-VL, ``second_per_grid_ts``.
    Build a fresh dict per call; ``generate`` consumes it.
    """
    if _is_kimi(model):  # no mrope, no deepstack: prefill/kimi.py
        return _kimi.build_generate_kwargs(model, input_ids, items, attention_mask)
    checked = _check(model, input_ids, items, attention_mask)
    kw: dict[str, Any] = {"input_ids": checked.input_ids, "mm_token_type_ids": checked.mm_token_type_ids,
                          "mm_encoder_outputs": {}}
    # A modality with no items is left out, as the processor leaves it out (no empty outputs).
    if checked.embeds or checked.video_grid_thw is None:
        kw["image_grid_thw"] = checked.grid_thw
        kw["mm_encoder_outputs"]["image"] = _encoder_output(model, checked.embeds, checked.deepstack)
    if checked.video_grid_thw is not None:
        kw["video_grid_thw"] = checked.video_grid_thw
        kw["mm_encoder_outputs"]["video"] = _encoder_output(model, checked.video_embeds, checked.video_deepstack)
    if checked.second_per_grid_ts is not None:
        kw["second_per_grid_ts"] = checked.second_per_grid_ts
    if checked.attention_mask is not None:
        kw["attention_mask"] = checked.attention_mask
    return kw


# -- the explicit path: tensors a worker can feed its own text model ------------


def build_prefill_inputs(
    model: Any,
    input_ids: Sequence[int] | torch.Tensor,
    items: Sequence[VisionItem],
    attention_mask: torch.Tensor | None = None,
) -> PrefillInputs:
    """``inputs_embeds`` with image/video rows at their tokens, mrope positions, deepstack.

    Same contract on ``input_ids`` and ``items`` as ``build_generate_kwargs``.
    Positions come from the model's own ``get_rope_index``.
    """
    if _is_kimi(model):
        return _kimi.build_prefill_inputs(model, input_ids, items, attention_mask)
    checked = _check(model, input_ids, items, attention_mask)
    base = _base(model)
    ids = checked.input_ids
    vmask = checked.video_mask
    rope_kw: dict[str, Any] = {}
    if vmask is not None:
        rope_kw["video_grid_thw"] = checked.video_grid_thw
    if checked.second_per_grid_ts is not None:
        rope_kw["second_per_grid_ts"] = checked.second_per_grid_ts
    with torch.no_grad():
        inputs_embeds, visual, deep = _video.merge_visual(base.get_input_embeddings()(ids), [
            (checked.image_mask, checked.embeds, checked.deepstack),
            (vmask, checked.video_embeds, checked.video_deepstack),
        ])
        position_ids, deltas = base.get_rope_index(
            ids,
            mm_token_type_ids=checked.mm_token_type_ids,
            image_grid_thw=checked.grid_thw if checked.embeds or vmask is None else None,
            attention_mask=checked.attention_mask,
            **rope_kw,
        )
    return PrefillInputs(
        input_ids=ids,
        inputs_embeds=inputs_embeds,
        position_ids=position_ids,
        rope_deltas=deltas,
        attention_mask=checked.attention_mask,
        visual_pos_masks=visual,
        deepstack_visual_embeds=deep,
    )


def prefill_forward(
    model: Any, inputs: PrefillInputs, cache: Any = None, *, logits_to_keep: int = 0
) -> tuple[torch.Tensor, Any]:
    """Run the prefill on the text model; returns ``(logits [B, L, vocab], cache)``.

    This is what ``model(**build_generate_kwargs(...))`` computes.
    ``logits_to_keep > 0`` projects only the last that many positions.
    """
    base = _base(model)
    with torch.no_grad():
        out = base.language_model(**inputs.text_model_kwargs(), cache=cache, use_cache=True)
        hidden = out.last_hidden_state
        return model.lm_head(hidden[:, -logits_to_keep:] if logits_to_keep else hidden), out.cache


def greedy_generate(
    model: Any,
    inputs: PrefillInputs,
    max_new_tokens: int,
    eos_token_id: int | Sequence[int] | None = None,
    *,
    return_logits: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Plain argmax decoding after ``prefill_forward``: ``[B, n]`` new token ids.

    With ``return_logits`` also the ``[B, n, vocab]`` logits each token was picked from.
    Decode positions are the text position plus ``rope_deltas`` on all three
    mrope rows. ``eos_token_id`` defaults to the generation config's (``()``
    never stops); rows that emitted it continue with the pad token and decoding
    stops once every row has. No logits processors are applied.
    """
    if max_new_tokens < 1:
        raise InvalidInput(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    base = _base(model)
    gen = model.generation_config
    if eos_token_id is None:
        eos_token_id = getattr(gen, "eos_token_id", None)
    if eos_token_id is None:
        eos = []
    else:
        eos = [eos_token_id] if isinstance(eos_token_id, int) else list(eos_token_id)
    pad = getattr(gen, "pad_token_id", None)
    pad = pad if pad is not None else (eos[0] if eos else 0)
    # Only the last row is projected, as generate does: CPU GEMMs are not
    # row-count invariant, so projecting all rows could change the last one's bits.
    logits, cache = prefill_forward(model, inputs, logits_to_keep=1)
    mask = inputs.attention_mask
    batch, length = inputs.input_ids.shape
    done = torch.zeros(batch, dtype=torch.bool, device=logits.device)
    eos_t = torch.tensor(eos, dtype=torch.long, device=logits.device)
    tokens: list[torch.Tensor] = []
    scores: list[torch.Tensor] = []
    with torch.no_grad():
        for step in range(max_new_tokens):
            scores.append(logits[:, -1])
            nxt = logits[:, -1].argmax(-1).masked_fill(done, pad)
            tokens.append(nxt)
            done |= torch.isin(nxt, eos_t)
            if step == max_new_tokens - 1 or bool(done.all()):
                break
            if mask is not None:
                mask = torch.cat([mask, mask.new_ones(batch, 1)], dim=1)
                text_pos = mask.long().sum(-1, keepdim=True) - 1
            else:
                text_pos = torch.full((batch, 1), length + step, dtype=torch.long, device=nxt.device)
            if inputs.position_ids.dim() == 2:  # 1-D rope (Kimi K2.5): the text position itself
                pos = text_pos
            else:
                mrope = (text_pos + inputs.rope_deltas.to(text_pos.device)).unsqueeze(0).expand(3, -1, -1)
                # Row 0 is the text position, as generate passes it: the causal mask is built from it.
                pos = torch.cat([text_pos.unsqueeze(0), mrope], dim=0)
            emb = base.get_input_embeddings()(nxt.unsqueeze(1))
            out = base.language_model(
                inputs_embeds=emb, position_ids=pos, attention_mask=mask, cache=cache, use_cache=True
            )
            cache = out.cache
            logits = model.lm_head(out.last_hidden_state)
    out_tokens = torch.stack(tokens, dim=1)
    return (out_tokens, torch.stack(scores, dim=1)) if return_logits else out_tokens
