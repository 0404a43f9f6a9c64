# SPDX-License-Identifier: Apache-2.0
"""SGLang 0.5.23's own prefill-side receive code, run against one of our servers.

Run as ``python sglang_prefill.py SGLANG_DIR DEPS_DIR ENCODER_URL OUT.safetensors ERROR_FRAME IMAGE_URL...``
by tests/integrations/test_sglang_encoder.py. SGLANG_DIR is the unpacked wheel. Only
what cannot import on this CPU box is stubbed (STUBBED below); SGLang's code then
builds the ``/encode`` request (``MMReceiverHTTP.encode``), binds the ZMQ socket,
unpickles our message with ``safe_pickle_loads`` and aggregates the parts
(``MMReceiverBase.recv_mm_data`` / ``_recv_mm_data``, the zmq_to_tokenizer path).
The model's multimodal processor (prompt expansion, which needs the checkpoint's
tokenizer) is replaced by a recorder of what SGLang hands it.
"""

from __future__ import annotations

import asyncio
import importlib.abc
import importlib.machinery
import sys
import types

# CUDA compilers (triton, tvm_ffi) and optional packages absent from our venv that the
# receiver's import chain touches but the receive path never calls.
STUBBED = ("triton", "tvm_ffi", "IPython", "torchvision", "sentencepiece", "compressed_tensors", "gguf",
           "partial_json_parser")


class _Anything(type):
    def __getattr__(cls, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})

    def __call__(cls, *a, **k):
        return a[0] if len(a) == 1 and callable(a[0]) and not k else _Anything("call", (), {})

    def __getitem__(cls, key):
        return cls

    def __or__(cls, other):
        return cls

    __ror__ = __or__

    def __iter__(cls):
        return iter(())

    def __bool__(cls):
        return False


class _StubModule(types.ModuleType):
    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        return _Anything(name, (), {})


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname, path, target=None):
        if fullname.split(".")[0] in STUBBED:
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        m = _StubModule(spec.name)
        m.__path__, m.__version__ = [], "0.0.0"
        return m

    def exec_module(self, module):
        pass


def import_receiver(sglang_dir: str, deps_dir: str):
    # transformers and torch._inductor probe triton / torchvision once, at import: let them
    # see the truth (absent) before the stubs go in.
    import torch._inductor.select_algorithm  # noqa: F401
    import transformers.models.auto.image_processing_auto  # noqa: F401
    import transformers.models.auto.processing_auto  # noqa: F401

    sys.meta_path.insert(0, _StubFinder())
    sys.path[:0] = [sglang_dir, deps_dir]
    from sglang.srt.disaggregation.encoder import receiver

    return receiver


class Recorder:
    """Stands in for the model's mm processor: keeps what SGLang's receive path produced."""

    def __init__(self):
        self.calls = []

    def get_validated_mm_data(self, prompt, embedding, **meta):
        self.calls.append((embedding, meta))
        return {"ok": True}


async def receive(receiver, encoder_url: str, images: list[str]):
    import zmq.asyncio
    from sglang.srt.managers.io_struct import GenerateReqInput

    rx = receiver.MMReceiverHTTP.__new__(receiver.MMReceiverHTTP)  # no ServerArgs / scheduler here
    rx.context, rx.encode_urls, rx.host = zmq.asyncio.Context(), [encoder_url], "127.0.0.1"
    rx.recv_timeout, rx.model_type = 120.0, "qwen2_5_vl"
    obj = GenerateReqInput(text="x", image_data=images)
    rec = Recorder()
    result = await rx.recv_mm_data(obj, rec, "x")
    return result, rec


def main() -> None:
    sglang_dir, deps_dir, encoder_url, out, error_frame, *images = sys.argv[1:]
    receiver = import_receiver(sglang_dir, deps_dir)
    from sglang.srt.utils.common import safe_pickle_loads

    # An error part we pushed (captured by the test): SGLang's checks, as consume_parts runs them.
    part = safe_pickle_loads(open(error_frame, "rb").read())
    assert receiver._embedding_part_matches_request(part, "bad"), part
    print("ERROR_PART", part.error_code, part.error_msg)
    from safetensors.torch import save_file
    from sglang.srt.managers.schedule_batch import Modality

    result, rec = asyncio.run(receive(receiver, encoder_url, images))
    if result is None or len(rec.calls) != 1:
        sys.exit(f"SGLang's receive path returned {result!r} after {len(rec.calls)} calls")
    embedding, meta = rec.calls[0]
    save_file({"embedding": embedding[Modality.IMAGE].contiguous(),
               "img_grid_thw": meta["img_grid_thw"].contiguous()}, out)
    print("RECEIVED", tuple(embedding[Modality.IMAGE].shape), meta["img_grid_thw"].tolist())


if __name__ == "__main__":
    main()
