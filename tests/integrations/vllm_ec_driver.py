# SPDX-License-Identifier: Apache-2.0
"""Run one vLLM ``LLM`` (in the vLLM venv) over a list of image requests; write JSON results.

``python vllm_ec_driver.py SPEC.json OUT.json``. SPEC: ``model``, ``ec_transfer_config``
(or null), ``requests``: ``[{"image": PNG path, "uuid": key or null, "gate": name or absent}]``;
before a gated request the driver touches ``OUT.<gate>.ready`` and waits for ``OUT.<gate>.go``. Each request runs
alone, so one that vLLM fails does not take the others with it. OUT: per request ``ok``,
``error``, ``token_ids``, ``prompt_logprobs`` (the prompt tokens' own logprobs; the first is
null), ``finish_reason``. Started by tests/integrations/test_vllm_ec*.py and test_vllm_connector*.py.
With ``"namespace_only": true`` it writes ``{"namespace": ...}`` instead, vLLM's Mooncake embedding
namespace for exactly this engine, without starting it (test_vllm_shared_cache.py).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

PROMPT = ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is in the picture?"
          "<|im_end|>\n<|im_start|>assistant\n")


def main(spec_path: str, out_path: str) -> None:
    from PIL import Image
    from vllm import LLM, SamplingParams

    with open(spec_path) as f:
        spec = json.load(f)
    kwargs = dict(model=spec["model"], dtype="float32", max_model_len=1024, max_num_seqs=2,
                  enforce_eager=True, gpu_memory_utilization=0.1, kv_cache_memory_bytes=256 << 20,
                  limit_mm_per_prompt={"image": 1}, seed=0)
    if spec.get("ec_transfer_config"):
        kwargs["ec_transfer_config"] = spec["ec_transfer_config"]
    if spec.get("namespace_only"):  # vLLM's Mooncake embedding namespace for this exact engine, no start
        from vllm.distributed.ec_transfer.ec_connector.mooncake_store_embedding.data import (
            build_embedding_namespace,
        )
        from vllm.engine.arg_utils import EngineArgs

        json.dump({"namespace": build_embedding_namespace(EngineArgs(**kwargs).create_engine_config())},
                  open(out_path, "w"))
        return
    llm = LLM(**kwargs)
    params = SamplingParams(max_tokens=4, temperature=0.0, prompt_logprobs=0, logprobs=0)
    results = []
    for r in spec["requests"]:
        if r.get("gate"):  # the test changes the world (the encode tier's state) between requests
            Path(f"{out_path}.{r['gate']}.ready").touch()
            deadline = time.monotonic() + 600
            while not Path(f"{out_path}.{r['gate']}.go").exists():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gate {r['gate']} never opened")
                time.sleep(0.05)
        prompt = {"prompt": PROMPT, "multi_modal_data": {"image": Image.open(r["image"]).convert("RGB")}}
        if r.get("uuid"):
            prompt["multi_modal_uuids"] = {"image": [r["uuid"]]}
        try:
            [out] = llm.generate([prompt], params, use_tqdm=False)
        except Exception as e:  # vLLM's answer to a failed request, kept for the test to read
            results.append({"ok": False, "error": f"{type(e).__name__}: {e}"})
            continue
        c = out.outputs[0]
        lps = [None if d is None else d[tok].logprob  # each prompt token's own logprob
               for d, tok in zip(out.prompt_logprobs or [], out.prompt_token_ids or [])]
        results.append({"ok": c.finish_reason != "error", "error": None, "token_ids": list(c.token_ids),
                        "prompt_logprobs": lps, "finish_reason": c.finish_reason})
    json.dump(results, open(out_path, "w"))


if __name__ == "__main__":  # vLLM starts its workers by spawn
    main(sys.argv[1], sys.argv[2])
