# SPDX-License-Identifier: Apache-2.0
"""--shared-cache and its options (epd_encoder/config/shared_cache.py), through the CLI."""

from __future__ import annotations

import pytest

from epd_encoder.config import ServeConfig
from epd_encoder.config.shared_cache import SharedCacheConfig
from epd_encoder.flags import ArgumentParser, FlagError, add_arguments, resolve


def test_off_by_default():
    assert not SharedCacheConfig().enabled


@pytest.mark.parametrize("url, master, metadata", [
    ("mooncake://10.0.0.5:50051", "10.0.0.5:50051", "P2PHANDSHAKE"),
    ("mooncake://master:50051/?metadata=http://meta:8080/metadata", "master:50051", "http://meta:8080/metadata"),
])
def test_the_url_names_the_master_and_metadata_server(url, master, metadata):
    c = SharedCacheConfig(shared_cache=url)
    assert (c.enabled, c.master, c.metadata_server) == (True, master, metadata)


@pytest.mark.parametrize("url", ["redis://h:1", "mooncake://h", "mooncake://:50051", "mooncake://h:port",
                                 "mooncake://h:1/path", "mooncake://h:1?meta=x", "mooncake://h:1?metadata=a&metadata=b"])
def test_a_bad_url_fails_at_startup(url):
    with pytest.raises(ValueError, match="--shared-cache"):
        SharedCacheConfig(shared_cache=url)


@pytest.mark.parametrize("change", [dict(shared_cache_deadline_ms=0), dict(shared_cache_write_queue=0),
                                    dict(shared_cache_segment_mb=-1), dict(shared_cache_namespace=""),
                                    dict(shared_cache_namespace="a@id:b")])
def test_out_of_range_options_are_refused(change):
    with pytest.raises(ValueError):
        SharedCacheConfig(**change)


def parse(argv: list[str]) -> ServeConfig:
    parser = ArgumentParser()
    add_arguments(parser, ServeConfig)
    return resolve(ServeConfig, parser.parse_args(argv), environ={})[0]


def test_the_flags_reach_the_tree():
    config = parse(["--shared-cache", "mooncake://127.0.0.1:50051", "--shared-cache-namespace", "fleet",
                                 "--shared-cache-deadline-ms", "250"])
    assert (config.shared.master, config.shared.shared_cache_namespace, config.shared.shared_cache_deadline_ms) == (
        "127.0.0.1:50051", "fleet", 250)
    with pytest.raises(FlagError):
        parse(["--shared-cache", "mooncake://nohost"])
