# SPDX-License-Identifier: Apache-2.0
"""SGLang 0.5.23's encoder-to-prefill message, written without importing SGLang.

SGLang's prefill reads each embedding part as a two-frame ZMQ message: frame 0
is a pickled ``sglang.srt.disaggregation.encoder.receiver.EmbeddingData`` (the
metadata, ``embedding=None``), loaded with ``safe_pickle_loads`` (an allowlist of
globals); frame 1 is the raw row-major bytes of the ``[rows, width]`` embedding,
read back with ``torch.frombuffer(frame, dtype).reshape(shape)``.

We never import SGLang, so the globals are written by name: the opcodes below
are those ``pickle.dumps`` emits for SGLang's own object (NEWOBJ + BUILD of a
plain ``__dict__``, the ``Modality`` enum as ``Modality(value)``, a dtype as the
global ``torch.<name>``), and every global is one of the allowlist's. The state
holds only str, int, None, float and lists, so nothing of ours is unpickled
there. We never unpickle anything.
"""

from __future__ import annotations

import io
import pickle
from dataclasses import dataclass, field
from typing import Any, ClassVar

RECEIVER = "sglang.srt.disaggregation.encoder.receiver"
MODALITY_MODULE = "sglang.srt.multimodal.modality"
MODALITIES = {"IMAGE": 1, "VIDEO": 2, "AUDIO": 3}  # sglang.srt.multimodal.modality.Modality (auto())
# Our dtype names as SGLang's allowlist spells the torch globals.
DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


@dataclass(frozen=True)
class _Global:
    module: str
    name: str


@dataclass(frozen=True)
class _Enum:
    cls: _Global
    value: int


@dataclass
class _Instance:
    cls: _Global
    state: dict[str, Any] = field(default_factory=dict)


# The pure-Python pickler: its dispatch table takes our markers (typeshed omits its save/write).
_PurePickler: Any = pickle._Pickler


class _Writer(_PurePickler):  # type: ignore[misc]
    dispatch: ClassVar[dict[Any, Any]] = dict(_PurePickler.dispatch)

    def _save_global(self, obj: _Global) -> None:
        self.save(obj.module)
        self.save(obj.name)
        self.write(pickle.STACK_GLOBAL)
        self.memoize(obj)

    def _save_enum(self, obj: _Enum) -> None:
        self.save(obj.cls)
        self.save((obj.value,))
        self.write(pickle.REDUCE)
        self.memoize(obj)

    def _save_instance(self, obj: _Instance) -> None:
        self.save(obj.cls)
        self.save(())
        self.write(pickle.NEWOBJ)
        self.memoize(obj)
        self.save(obj.state)
        self.write(pickle.BUILD)

    dispatch[_Global] = _save_global
    dispatch[_Enum] = _save_enum
    dispatch[_Instance] = _save_instance


def _dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _Writer(buf, protocol=4).dump(obj)
    return buf.getvalue()


def embedding_data(*, req_id: str, num_parts: int, part_idx: int, modality: str,
                   grid_thw: list[list[int]] | None, shape: list[int] | None, dtype: str | None,
                   error_msg: str | None = None, error_code: int | None = None,
                   extra: dict[str, Any] | None = None) -> bytes:
    """Frame 0: ``EmbeddingData`` as SGLang's ``copy_without_embedding()`` pickles it.

    ``grid_thw`` is one ``[t, h, w]`` per item of this part; ``extra`` carries the
    per-part video attributes (``second_per_grid_ts``, ``video_timestamps``) as lists.
    """
    if modality not in MODALITIES:
        raise ValueError(f"unknown SGLang modality {modality!r}")
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} has no SGLang-allowlisted torch global")
    state: dict[str, Any] = {
        "req_id": req_id, "num_parts": int(num_parts), "part_idx": int(part_idx),
        "grid_dim": grid_thw, "modality": _Enum(_Global(MODALITY_MODULE, "Modality"), MODALITIES[modality]),
        "embedding": None, "send_time": None,
        "dtype": _Global("torch", DTYPES[dtype]) if dtype is not None else None,
        "shape": shape, "_mr_ptr": None, "error_msg": error_msg,
        "error_code": int(error_code) if error_code is not None else None,
    }
    for k, v in (extra or {}).items():
        if k in state or k.startswith("_"):
            raise ValueError(f"extra attribute {k!r} would overwrite EmbeddingData's own")
        state[k] = v
    return _dumps(_Instance(_Global(RECEIVER, "EmbeddingData"), state))
