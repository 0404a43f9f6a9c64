# SPDX-License-Identifier: Apache-2.0
"""Every reader of checkpoint files, on each family's checkpoint as its real Hub repository
lays it out (tests/models/hub_layouts.py): the checkpoint reader and the loader, the TP
identity and the TP shard loader. The processors are in tests/preprocess/test_registry.py."""

from __future__ import annotations

import pytest

from epd_encoder.models.loading.checkpoint import read_checkpoint
from epd_encoder.models.registry import load_vision_model, read_family
from tests.models import hub_layouts

pytestmark = pytest.mark.skipif(hub_layouts.missing_reason() is not None, reason=str(hub_layouts.missing_reason()))


@pytest.mark.parametrize("family", sorted(hub_layouts.HUB_FILES))
def test_loads_every_family_from_its_hub_layout(family):
    path = hub_layouts.hub_checkpoint(family)
    info = read_checkpoint(path)
    assert info.model_type == family and info.weight_map
    source = load_vision_model(hub_layouts.source_checkpoint(family), progress=False)
    model = load_vision_model(path, progress=False)
    assert model.family.name == source.family.name and model.weights_digest == source.weights_digest


@pytest.mark.parametrize("family", sorted(hub_layouts.HUB_FILES))
def test_tp_identity_and_shard_loader_read_the_hub_layout(family):
    from epd_encoder.server.parallel import vision_identity
    from epd_encoder.tp.shard import load_vision_shard

    path = hub_layouts.hub_checkpoint(family)
    fam, config, digest = vision_identity(path)
    assert fam is read_family(path)[0] and config.model_type == family
    assert digest == load_vision_model(path, progress=False).weights_digest
    model, report = load_vision_shard(path, 0, 1, progress=False)
    assert report.tensors > 0 and model.family is fam
