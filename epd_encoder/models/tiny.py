# SPDX-License-Identifier: Apache-2.0
"""Tiny random but complete checkpoints for every supported family.

A tiny checkpoint is what ``from_pretrained`` expects of a real one: config.json,
generation_config.json, preprocessor_config.json, a tokenizer (with the family's chat
template where the real checkpoints carry one) and safetensors
(one file, or shards plus ``model.safetensors.index.json`` with the vision and
language-model tensors in different shards). Tensor names are exactly what
``save_pretrained`` of the installed transformers writes. The same family and
seed always give byte-identical safetensors.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterable, Sequence

import torch

from epd_encoder.models.tiny_configs import (  # noqa: F401  (re-exported)
    CHECKPOINT_VISION_PREFIXES,
    FAMILIES,
    VLLM_FAMILIES,
    image_processor_config,
    tiny_config,
    tokenizer_specials,
    video_processor_config,
)
from epd_encoder.models.tiny_templates import CHAT_TEMPLATES


# Bump when the tiny configs or the file layout change: it keys default_model_dir.
TINY_VERSION = 3

_DTYPES = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
    torch.uint8: "U8", torch.bool: "BOOL",
}


def _byte_symbols() -> list[str]:
    # The GPT-2 byte-level alphabet: printable bytes map to themselves, the rest to 256+.
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def _tokenizer(family: str):
    from transformers import Qwen2Tokenizer

    specials, extra, eos, pad = tokenizer_specials(family)
    vocab = {s: i for i, s in enumerate(_byte_symbols())}
    vocab.update({s: 256 + i for i, s in enumerate(specials)})
    return Qwen2Tokenizer(
        vocab=vocab, merges=[], eos_token=eos, pad_token=pad, extra_special_tokens=extra, model_max_length=4096,
    )


def _write_safetensors(path: Path, tensors: Sequence[tuple[str, torch.dtype, tuple, torch.Tensor | None]]) -> int:
    """Write one safetensors file; a ``None`` tensor is zeros left as a sparse hole."""
    order = sorted(tensors, key=lambda t: (-torch.empty((), dtype=t[1]).element_size(), t[0]))
    header: dict = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, dtype, shape, _ in order:
        n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
        header[name] = {"dtype": _DTYPES[dtype], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for name, dtype, shape, t in order:
            lo, hi = header[name]["data_offsets"]
            if t is None:
                f.seek(hi - lo, os.SEEK_CUR)
            else:
                f.write(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
        f.truncate(8 + len(raw) + offset)
    return offset


def _split(items: list, parts: int) -> list[list]:
    """Contiguous split into at most ``parts`` non-empty groups, balanced by bytes."""
    parts = min(parts, len(items))
    sizes = [torch.Size(s).numel() * torch.empty((), dtype=d).element_size() for _, d, s, _ in items]
    total, groups, cur, acc = sum(sizes), [], [], 0
    for i, (item, size) in enumerate(zip(items, sizes)):
        cur.append(item)
        acc += size
        left_groups = parts - len(groups) - 1
        if left_groups and (acc * parts >= total * (len(groups) + 1) or len(items) - i - 1 == left_groups):
            groups.append(cur)
            cur = []
    return groups + [cur]


def _model_tensors(family: str, seed: int, lm_scale: int | None, scratch: Path, vllm_compatible: bool = False):
    """``(name, dtype, shape, tensor|None)`` as saved, plus the config to write."""
    from safetensors import safe_open
    from transformers import AutoModelForImageTextToText

    config = tiny_config(family, vllm_compatible=vllm_compatible)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForImageTextToText.from_config(config)
    model.save_pretrained(scratch)
    with safe_open(scratch / "model.safetensors", "pt") as f:
        saved = {k: f.get_tensor(k) for k in f.keys()}
    entries = {k: (k, t.dtype, tuple(t.shape), t) for k, t in saved.items()}
    if lm_scale is None:
        return list(entries.values()), config
    big = tiny_config(family, lm_scale=lm_scale, vllm_compatible=vllm_compatible)
    from transformers.core_model_loading import revert_weight_conversion

    with torch.device("meta"):
        meta = AutoModelForImageTextToText.from_config(big)
    renamed = revert_weight_conversion(meta, dict(meta.state_dict()))
    missing = set(saved) - set(renamed)
    if missing:
        raise RuntimeError(f"cannot scale the LM: saved names not reproduced: {sorted(missing)[:5]}")
    vision = CHECKPOINT_VISION_PREFIXES[family]
    for k in saved:
        if not k.startswith(vision):
            entries[k] = (k, saved[k].dtype, tuple(renamed[k].shape), None)
    return list(entries.values()), big


def write_tiny_model(
    family: str, out_dir, *, seed: int = 0, num_shards: int = 1, lm_scale: int | None = None,
    vllm_compatible: bool = False,
) -> Path:
    """Write the tiny ``family`` checkpoint into ``out_dir`` (created) and return it.

    ``num_shards > 1`` writes ``model-0000i-of-0000n.safetensors`` plus the index;
    vision tensors and LM tensors never share a shard (vision first). With
    ``lm_scale`` the LM is widened and written as zeros (sparse on disk), while
    the vision tensors equal those of the unscaled model with the same seed.
    ``vllm_compatible`` gives the LM the dimensions vLLM's CPU backend runs (head_dim
    64; Qwen families only; see ``tiny_config``).
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown tiny family {family!r}; choose from {', '.join(FAMILIES)}")
    if num_shards < 1:
        raise ValueError(f"num_shards must be >= 1, got {num_shards}")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=out, prefix=".scratch-") as tmp:
        tensors, config = _model_tensors(family, seed, lm_scale, Path(tmp), vllm_compatible)
        shutil.copyfile(Path(tmp) / "generation_config.json", out / "generation_config.json")
    config.save_pretrained(out)
    _save_processor(family, out)
    for stale in [*out.glob("model*.safetensors"), out / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # a previous layout's files would shadow this one
    vision_names = CHECKPOINT_VISION_PREFIXES[family]
    if num_shards == 1:
        _write_safetensors(out / "model.safetensors", tensors)
        return out
    vis = sorted((t for t in tensors if t[0].startswith(vision_names)), key=lambda t: t[0])
    lm = sorted((t for t in tensors if not t[0].startswith(vision_names)), key=lambda t: t[0])
    n_vis = max(1, num_shards // 3)
    groups = _split(vis, n_vis) + _split(lm, num_shards - n_vis)
    weight_map, total = {}, 0
    for i, group in enumerate(groups, 1):
        name = f"model-{i:05d}-of-{len(groups):05d}.safetensors"
        total += _write_safetensors(out / name, group)
        weight_map.update({t[0]: name for t in group})
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return out


def _save_processor(family: str, out: Path) -> None:
    # Written as JSON, as save_pretrained of the processor classes writes it (Kimi's image
    # processor and every video processor need torchvision to be instantiated).
    files = {"preprocessor_config.json": image_processor_config(family),
             "video_preprocessor_config.json": video_processor_config(family)}
    for name, value in files.items():
        if value is not None:
            (out / name).write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")
    tok = _tokenizer(family)
    template = CHAT_TEMPLATES.get(family)
    if template is not None:
        # As the real Qwen-VL checkpoints carry it: chat_template.json (the processor's)
        # and "chat_template" in tokenizer_config.json, not transformers 5's .jinja file.
        tok.chat_template = template
        (out / "chat_template.json").write_text(json.dumps({"chat_template": template}, indent=2) + "\n")
    tok.save_pretrained(out, save_jinja_files=False)


def default_model_dir(
    family: str = "qwen2_5_vl", seed: int = 0, *, cache_dir=None, vllm_compatible: bool = False
) -> Path:
    """The tiny checkpoint in the cache, generated on first use.

    The cache root is ``cache_dir``, else ``$EPD_ENCODER_CACHE``, else
    ``~/.cache/epd-encoder``; the model lives in ``tiny/<family>-s<seed>-v<N>``
    (``-vllm`` appended for ``vllm_compatible``).
    Concurrent first uses are safe: each writes a temp dir and renames it.
    """
    from epd_encoder.flags import cache_root  # the one place the environment is read

    root = Path(cache_dir or cache_root())
    final = root / "tiny" / f"{family}-s{seed}-v{TINY_VERSION}{'-vllm' if vllm_compatible else ''}"
    if final.is_dir():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".{final.name}-"))
    try:
        write_tiny_model(family, tmp, seed=seed, vllm_compatible=vllm_compatible)
        os.rename(tmp, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final


def make_tiny_model_main(argv: Iterable[str] | None = None) -> int:
    """``epd-encoder make-tiny-model``: write a tiny checkpoint and print its path."""
    from epd_encoder.flags import ArgumentParser

    p = ArgumentParser(prog="epd-encoder make-tiny-model", description=__doc__.splitlines()[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out_dir", help="directory to write (created if missing)")
    p.add_argument("--family", choices=FAMILIES, default="qwen2_5_vl",
                   help="model family whose config, processor and tensor names are written")
    p.add_argument("--seed", type=int, default=0, help="weights are a pure function of the seed")
    p.add_argument("--shards", type=int, default=1, help="safetensors shards (>1 writes an index)")
    p.add_argument("--lm-scale", type=int, default=None,
                   help="widen the LM MLPs by this factor (zeros), for loader tests of large shards")
    p.add_argument("--vllm-compatible", action="store_true",
                   help="LM head size 64 (hidden 128), which vLLM's CPU attention runs (it refuses the "
                        "default 24); Qwen families only. The tower is unchanged but for its output width")
    args = p.parse_args(None if argv is None else list(argv))
    if args.shards < 1:
        p.error(f"--shards must be >= 1, got {args.shards}")
    if args.vllm_compatible and args.family not in VLLM_FAMILIES:
        p.error(f"--vllm-compatible is for {', '.join(VLLM_FAMILIES)}")
    path = write_tiny_model(args.family, args.out_dir, seed=args.seed, num_shards=args.shards,
                            lm_scale=args.lm_scale, vllm_compatible=args.vllm_compatible)
    print(path)
    return 0
