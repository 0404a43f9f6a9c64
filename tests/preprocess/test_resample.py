# SPDX-License-Identifier: Apache-2.0
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from epd_encoder.errors import ConfigError
from epd_encoder.preprocess import resample
from epd_encoder.preprocess.resample import PilResampler, TorchResampler, make_resampler

from .conftest import rgb_array


def test_factory_and_unsupported_filters():
    assert isinstance(make_resampler("pil", 3), PilResampler)
    assert isinstance(make_resampler("torchvision", 3), TorchResampler)
    for box_or_hamming in (4, 5):
        with pytest.raises(ConfigError):
            make_resampler("torchvision", box_or_hamming)
        make_resampler("pil", box_or_hamming)
    with pytest.raises(ConfigError):
        make_resampler("PIL", 3)


def test_torch_resize_layout_and_identity():
    img = Image.fromarray(rgb_array(37, 23, 1))
    r = make_resampler("torchvision", 3)
    src = r.prepare(img)
    assert src.shape == (1, 3, 23, 37) and src.is_contiguous(memory_format=torch.channels_last)
    assert np.array_equal(r.resize(src, 23, 37), np.asarray(img))  # same size: returned as is
    out = r.resize(src, 56, 84)
    assert out.shape == (56, 84, 3) and out.dtype == np.uint8
    want = F.interpolate(src, size=[56, 84], mode="bicubic", align_corners=False, antialias=True)[0]
    assert np.array_equal(out, want.permute(1, 2, 0).numpy())


def test_bilinear_without_native_uint8_rounds_a_float_resize(monkeypatch):
    # torchvision's rule: no AVX2 means a float32 resize, rounded; kept so results follow the reference's CPU.
    monkeypatch.setattr(resample, "_native_uint8", lambda mode: False)
    r = make_resampler("torchvision", 2)
    src = r.prepare(Image.fromarray(rgb_array(40, 30, 2)))
    want = F.interpolate(src.float(), size=[17, 23], mode="bilinear", align_corners=False, antialias=True)
    assert np.array_equal(r.resize(src, 17, 23), want.round()[0].to(torch.uint8).permute(1, 2, 0).numpy())


def test_backends_resize_differently():
    img = Image.fromarray(rgb_array(517, 333, 3))
    tv, pil = make_resampler("torchvision", 3), make_resampler("pil", 3)
    a, b = tv.resize(tv.prepare(img), 224, 336), pil.resize(pil.prepare(img), 224, 336)
    diff = np.abs(a.astype(int) - b.astype(int))
    assert diff.max() > 0 and diff.mean() < 2


def test_the_package_never_imports_torchvision():
    code = (
        "import sys\n"
        "from PIL import Image\n"
        "from epd_encoder.preprocess.registry import load_preprocessor\n"
        "img = Image.new('RGB', (300, 200))\n"
        "load_preprocessor({}, 'qwen2_vl').preprocess(img)\n"
        "tiles = {'crop_to_patches': True, 'size': {'height': 448, 'width': 448}}\n"
        "load_preprocessor(tiles, 'internvl').preprocess(img)\n"
        "assert 'torchvision' not in sys.modules, 'torchvision was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
