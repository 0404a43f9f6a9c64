# SPDX-License-Identifier: Apache-2.0
import numpy as np
import pytest
import torch
from transformers.image_transforms import normalize, rescale

from epd_encoder.errors import ConfigError
from epd_encoder.preprocess.base import DecodeLimits, PixelNormalizer

MEAN, STD = [0.48145466, 0.4578275, 0.40821073], [0.26862954, 0.26130258, 0.27577711]
ALL_LEVELS = np.stack([np.arange(256, dtype=np.uint8)] * 3)[:, None, :]  # [C, 1, 256]: every byte per channel


@pytest.mark.parametrize("do_rescale,do_normalize", [(True, True), (True, False), (False, True), (False, False)])
def test_pil_table_is_bit_identical_to_reference(do_rescale, do_normalize):
    """The PIL backend's numpy chain; the torchvision table is checked end to end in test_qwen/test_internvl."""
    norm = PixelNormalizer(do_rescale=do_rescale, do_normalize=do_normalize, image_mean=MEAN, image_std=STD,
                           backend="pil")
    ref = ALL_LEVELS
    if do_rescale:
        ref = rescale(ref, 1 / 255, input_data_format="channels_first")
    if do_normalize:
        ref = normalize(ref, MEAN, STD, input_data_format="channels_first")
    ref = np.asarray(ref, dtype=np.float32)[:, 0, :]
    assert np.array_equal(norm.table, ref)


@pytest.mark.parametrize("backend", ["torchvision", "pil"])
def test_numpy_and_torch_lookups_agree_with_table(backend):
    norm = PixelNormalizer(image_mean=MEAN, image_std=STD, backend=backend)
    rng = np.random.default_rng(0)
    u8 = rng.integers(0, 256, (5, 3, 4, 4), dtype=np.uint8)
    expected = np.stack([norm.table[c][u8[:, c]] for c in range(3)], axis=1)
    assert np.array_equal(norm.apply_numpy(u8), expected)
    rep = norm.apply_numpy(u8, repeat=2)
    assert rep.shape == (5, 3, 2, 4, 4) and np.array_equal(rep[:, :, 1], expected)
    assert np.array_equal(rep[:, :, 0], expected)
    t = norm.apply_torch(torch.from_numpy(u8), torch.device("cpu"), repeat=2)
    assert t.is_contiguous() and np.array_equal(t.numpy(), rep)


@pytest.mark.parametrize("do_rescale,do_normalize", [(True, True), (True, False), (False, True), (False, False)])
def test_torchvision_cpu_arithmetic_equals_its_table(do_rescale, do_normalize):
    norm = PixelNormalizer(do_rescale=do_rescale, do_normalize=do_normalize, image_mean=MEAN, image_std=STD)
    u8 = torch.from_numpy(np.random.default_rng(1).integers(0, 256, (4, 3, 16, 16), dtype=np.uint8))
    u8[0] = torch.arange(256, dtype=torch.uint8).view(16, 16)  # every byte value on every channel
    host = norm.apply(u8, None, repeat=2)
    assert host.dtype == torch.float32 and host.is_contiguous()
    assert torch.equal(host, torch.from_numpy(norm.apply_numpy(u8.numpy(), repeat=2)))
    assert torch.equal(norm.apply(u8, None), norm.apply_torch(u8, torch.device("cpu")))


def test_backends_round_differently():
    tv = PixelNormalizer(image_mean=MEAN, image_std=STD)
    pil = PixelNormalizer(image_mean=MEAN, image_std=STD, backend="pil")
    assert tv.backend == "torchvision" and tv.params() == pil.params()
    assert not np.array_equal(tv.table, pil.table) and np.abs(tv.table - pil.table).max() < 1e-5
    with pytest.raises(ConfigError):
        PixelNormalizer(backend="cv2")


def test_scalar_mean_and_bad_std():
    assert PixelNormalizer(image_mean=0.5, image_std=0.5).params()["image_mean"] == [0.5, 0.5, 0.5]
    with pytest.raises(ConfigError):
        PixelNormalizer(image_std=[0.5, 0.0, 0.5])
    with pytest.raises(ConfigError):
        PixelNormalizer(image_mean=[0.5, 0.5])


def test_decode_limits_validation():
    with pytest.raises(ConfigError):
        DecodeLimits(max_bytes=0)
    with pytest.raises(ConfigError):
        DecodeLimits(max_aspect_ratio=0.5)
