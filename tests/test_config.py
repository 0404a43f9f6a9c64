# SPDX-License-Identifier: Apache-2.0
from __future__ import annotations

import dataclasses

import pytest

from epd_encoder.cli import build_parser
from epd_encoder.config import ModelConfig, ServeConfig, from_namespace
from epd_encoder.flags import leaves


def parse(*argv):
    ns = build_parser().parse_args(["serve", *argv])
    return from_namespace(ServeConfig, ns)


def test_cli_turns_a_bad_value_into_a_usage_error(capsys):
    from epd_encoder.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["serve", "--max-batch-cost", "0"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("epd-encoder serve: error: --max-batch-cost must be > 0, got 0")


def test_defaults_come_from_the_tree():
    assert parse() == ServeConfig()


def test_flags_reach_the_right_leaves_and_the_tree_is_frozen():
    cfg = parse("--max-batch-cost", "4096", "--cache-mb", "64", "--api-key", "k", "--port", "0",
                "--allow-url-fetch", "--admission", "lru", "--tower", "reference")
    assert cfg.engine.scheduler.max_batch_cost == 4096 and cfg.engine.cache.l1_bytes == 64 << 20
    assert cfg.auth.api_key == "k" and cfg.port == 0 and cfg.fetch.allow_url_fetch
    assert cfg.engine.cache.admission == "lru" and cfg.model.tower == "reference"
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.port = 1


def test_every_leaf_has_a_flag_with_help(capsys):
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--help"])
    text = capsys.readouterr().out
    for leaf in leaves(ServeConfig):
        assert leaf.flag in text and leaf.help, leaf.name


@pytest.mark.parametrize("argv", [["--max-batch-cost", "0"], ["--request-timeout", "-1"],
                                  ["--max-items", "0"], ["--attention-weight", "-1"], ["--pull-ttl", "0"],
                                  ["--port", "70000"], ["--cache-mb", "-1"], ["--max-pending-cost", "0"],
                                  ["--fetch-timeout", "0"], ["--max-rooms-per-peer", "0"],
                                  ["--ec-store-mooncake", "h:1"],  # no --ec-store-namespace
                                  ["--ec-store-path", "/d", "--ec-store-mooncake", "h:1", "--ec-store-namespace", "n"]])
def test_invalid_values_are_refused(argv):
    with pytest.raises(ValueError):
        parse(*argv)


def test_bad_choice_is_an_argparse_error():
    with pytest.raises(SystemExit):
        parse("--admission", "fifo")


@pytest.mark.parametrize("device", ["auto", "cpu", "cuda", "cuda:0", "cuda:12"])
def test_device_accepts_the_documented_forms(device):
    assert ModelConfig(device=device).device == device


@pytest.mark.parametrize("device", ["tpu", "cuda:", "cuda:x", "CPU", "cuda:0 "])
def test_device_refuses_anything_else_naming_the_flag(device):
    with pytest.raises(ValueError, match="--device must be auto, cpu, cuda or cuda:N"):
        ModelConfig(device=device)
