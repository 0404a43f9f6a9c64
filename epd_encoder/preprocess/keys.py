# SPDX-License-Identifier: Apache-2.0
"""Content keys: 256-bit blake3 over a canonical, length-framed serialization.

A key covers everything that determines an item's embedding:

    domain tag | model id | revision | resolved preprocessing params | modality | encoded bytes

Each field is framed as ``len (8 bytes, little endian) || bytes`` so no two
different field tuples serialize to the same stream (``("ab", "c")`` vs
``("a", "bc")``). Params are canonical JSON (sorted keys, no whitespace, NaN
rejected), so equal params always hash equal.

Why this shape:
- The key is over the *encoded* bytes, so a cache hit skips decoding and
  preprocessing as well as the tower.
- 256 bits: a 64-bit key collides by the birthday bound after ~2**32 items,
  which a busy fleet reaches; and a non-cryptographic hash lets a client craft
  a colliding image and poison another tenant's entry. blake3 is both
  collision-resistant and faster than memory bandwidth needs on one core.
- Model, revision and preprocessing are in the key because a different
  checkpoint, min/max pixels, normalization or preprocessing backend
  (torchvision and PIL resize differently) produces different embeddings for
  the same bytes: they must never share an entry.
"""

from __future__ import annotations

import json
from typing import Any, Mapping

from blake3 import blake3

KEY_BYTES = 32
_DOMAIN = b"epd-encoder/content-key/v1"
# Below this size threading costs more than it saves.
_THREADED_MIN_BYTES = 1 << 20


def canonical_params(params: Mapping[str, Any]) -> bytes:
    """Canonical JSON of resolved preprocessing parameters."""
    return json.dumps(
        params, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
    ).encode("utf-8")


def _frame(h: blake3, data: bytes | bytearray | memoryview) -> None:
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


class KeyContext:
    """The fixed part of the key (model, params, modality), hashed once.

    A preprocessor builds one context per resolved parameter set; each item
    then costs one hash over its own bytes only.
    """

    __slots__ = ("_prefix", "model_id", "revision", "params", "modality")

    def __init__(
        self, *, model_id: str, revision: str, params: Mapping[str, Any], modality: str = "image"
    ) -> None:
        self.model_id, self.revision, self.modality = model_id, revision, modality
        self.params = dict(params)
        h = blake3()
        for field in (_DOMAIN, model_id.encode(), revision.encode(), canonical_params(params),
                      modality.encode()):
            _frame(h, field)
        self._prefix = h.digest()

    def key(self, data: bytes | bytearray | memoryview) -> bytes:
        """The 32-byte content key of one item's encoded bytes (zero-copy)."""
        view = memoryview(data).cast("B")
        threads = blake3.AUTO if view.nbytes >= _THREADED_MIN_BYTES else 1
        # Chained on the prefix digest: the thread count never changes the value.
        h = blake3(self._prefix, max_threads=threads)
        _frame(h, view)
        return h.digest()


def content_key(
    data: bytes | bytearray | memoryview,
    *,
    model_id: str,
    revision: str,
    params: Mapping[str, Any],
    modality: str = "image",
) -> bytes:
    """One-shot content key; see the module docstring for what it covers."""
    return KeyContext(model_id=model_id, revision=revision, params=params, modality=modality).key(
        data
    )
