# SPDX-License-Identifier: Apache-2.0
"""One vLLM ``LLM`` answering JSON requests; run by tests/integrations/vllm_harness.py.

``.venv-vllm/bin/python -m tests.integrations.vllm_driver FD`` reads one JSON object per line
on stdin and writes one per line to file descriptor FD (vLLM logs to stdout). The first line is
``{"llm": {LLM kwargs}}``; the driver answers ``{"ok": true, "start_s": ...}`` once the engine is
up. Then each ``{"generate": [request, ...], "tensors": PATH | null, "max_tokens": N}`` answers
``{"ok": true, "results": [...]}`` or ``{"ok": false, "error": "..."}``. A request is
``{"prompt": str, "multi_modal_data": SPEC, "multi_modal_uuids": {...}?, "mm_processor_kwargs": {...}?}``;
in SPEC, ``"@t:NAME"`` is tensor NAME of the safetensors file at ``tensors``, ``{"@image": PATH}``
an image file, ``{"@video": "@t:FRAMES", "metadata": {...}}`` a (frames uint8 [T, H, W, 3],
metadata) pair. Runs only in the vLLM venv: it imports vllm, never epd_encoder.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def _resolve(spec, tensors):
    import numpy as np
    from PIL import Image

    if isinstance(spec, str) and spec.startswith("@t:"):
        return tensors[spec[3:]]
    if isinstance(spec, dict):
        if "@image" in spec:
            return Image.open(spec["@image"]).convert("RGB")
        if "@video" in spec:
            frames = _resolve(spec["@video"], tensors)
            return (np.ascontiguousarray(frames.numpy()), spec.get("metadata"))
        return {k: _resolve(v, tensors) for k, v in spec.items()}
    if isinstance(spec, list):
        return [_resolve(v, tensors) for v in spec]
    return spec


def _chosen(logprobs_list, ids):
    """The logprob of each chosen id (``None`` where vLLM gives none, the first prompt token)."""
    out = []
    for lp, tok in zip(logprobs_list or [], ids):
        out.append(None if lp is None else float(lp[tok].logprob))
    return out


def _generate(llm, msg):
    from safetensors.torch import load_file
    from vllm import SamplingParams

    tensors = load_file(msg["tensors"]) if msg.get("tensors") else {}
    prompts = []
    for r in msg["generate"]:
        p = {"prompt": r["prompt"]}
        for key in ("multi_modal_data", "multi_modal_uuids", "mm_processor_kwargs"):
            if r.get(key) is not None:
                p[key] = _resolve(r[key], tensors)
        prompts.append(p)
    params = SamplingParams(temperature=0.0, max_tokens=msg.get("max_tokens", 4), logprobs=0, prompt_logprobs=0)
    outs = llm.generate(prompts, params, use_tqdm=False)
    results = []
    for o in outs:
        c = o.outputs[0]
        results.append({
            "prompt_token_ids": list(o.prompt_token_ids),
            "prompt_logprobs": _chosen(o.prompt_logprobs, o.prompt_token_ids),
            "token_ids": list(c.token_ids),
            "logprobs": _chosen(c.logprobs, c.token_ids),
            "text": c.text,
        })
    return results


def main() -> None:
    out = os.fdopen(int(sys.argv[1]), "w", buffering=1)
    first = json.loads(sys.stdin.readline())
    t0 = time.monotonic()
    try:
        from vllm import LLM

        llm = LLM(**first["llm"])
    except Exception:
        out.write(json.dumps({"ok": False, "error": traceback.format_exc()[-6000:]}) + "\n")
        return
    out.write(json.dumps({"ok": True, "start_s": time.monotonic() - t0}) + "\n")
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            reply = {"ok": True, "results": _generate(llm, msg)}
        except Exception:
            reply = {"ok": False, "error": traceback.format_exc()[-6000:]}
        out.write(json.dumps(reply) + "\n")


if __name__ == "__main__":  # vLLM starts its workers by spawn
    main()
