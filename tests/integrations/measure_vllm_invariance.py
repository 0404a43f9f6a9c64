# SPDX-License-Identifier: Apache-2.0
"""Are vLLM's logprobs on our embeddings bitwise equal to vLLM's own aggregated run? (a measurement,
not a test: four vLLM starts). ``.venv/bin/python -m tests.integrations.measure_vllm_invariance``

For Qwen2.5-VL on 3 images: our server with and without ``--batch-invariant`` feeds a noise-tower
vLLM; vLLM on the true checkpoint encodes the PNGs itself. Both vLLMs run once by default and once
with ``VLLM_BATCH_INVARIANT=1``. Prints each max |difference| of prompt and sample logprobs, and
whether one request's logprobs change when it is batched with two others.
"""

from __future__ import annotations

import tempfile
from dataclasses import replace
from pathlib import Path


def main() -> None:
    from epd_encoder.client import EncodeClient, image_item
    from epd_encoder.integrations import vllm_multi_modal_data
    from epd_encoder.models.tiny import write_tiny_model
    from tests.e2e.harness import Server, png, serve_config
    from tests.integrations.test_vllm_embeds import IMAGE, chat, image_files, tensor_refs
    from tests.integrations.vllm_harness import VllmLLM, compare, noise_tower_copy

    tmp = Path(tempfile.mkdtemp(prefix="vllm-invariance-"))
    true_dir = write_tiny_model("qwen2_5_vl", tmp / "true", vllm_compatible=True)
    noise_dir = noise_tower_copy(true_dir, tmp / "noise", "qwen2_5_vl")
    images = [png(101, (96, 128)), png(102, (150, 60)), png(103, (224, 224))]
    others = [png(201, (64, 64)), png(202, (300, 120))]
    prompt = chat("".join(f"Picture {i + 1}: {IMAGE}\n" for i in range(len(images))))
    payloads = {}
    for invariant in (False, True):
        cfg = serve_config(true_dir)
        server = Server(replace(cfg, model=replace(cfg.model, batch_invariant=invariant,
                                                   tower="reference" if invariant else cfg.model.tower))).start()
        with EncodeClient(server.url) as c:
            payloads[invariant] = tensor_refs(vllm_multi_modal_data(c.encode([image_item(b) for b in images]).items))
        server.stop()
    pixels = {"prompt": prompt, "multi_modal_data": {"image": image_files(tmp, images)}}
    extra = [{"prompt": chat(f"{IMAGE}\n"), "multi_modal_data": {"image": image_files(tmp, [o])}} for o in others]
    for mode, env in (("default", {}), ("VLLM_BATCH_INVARIANT=1", {"VLLM_BATCH_INVARIANT": "1"})):
        true, noise = VllmLLM(true_dir, env=env), VllmLLM(noise_dir, env=env)
        try:
            want = true.generate([pixels], max_tokens=8)[0]
            batched = true.generate([*extra, pixels], max_tokens=8)[-1]
            print(f"[{mode}] vLLM alone vs batched with 2 others: {compare(batched, want)}")
            for invariant, (spec, tensors) in payloads.items():
                got = noise.generate([{"prompt": prompt, "multi_modal_data": spec}], tensors, max_tokens=8)[0]
                print(f"[{mode}] our server (batch_invariant={invariant}) vs vLLM's tower: {compare(got, want)}")
        except RuntimeError as e:
            causes = [line for line in str(e).splitlines() if "Error:" in line or "failed with error" in line]
            print(f"[{mode}] failed: " + "\n".join(causes[-4:]))
        finally:
            true.close()
            noise.close()


if __name__ == "__main__":
    main()
