# SPDX-License-Identifier: Apache-2.0
"""``epd-encoder proxy`` / ``vllm-args`` on the command line: ProxyConfig's flags, the repeatable
``--llm`` in its three spellings, and the one line vllm-args prints."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time

import pytest

from epd_encoder.cli import build_parser, main
from epd_encoder.config import ProxyConfig
from epd_encoder.flags import resolve


def config(argv: list[str], environ: dict | None = None, toml: str | None = None, tmp_path=None) -> ProxyConfig:
    args = build_parser().parse_args(["proxy", *argv])
    path = None
    if toml is not None:
        path = tmp_path / "proxy.toml"
        path.write_text(toml)
    return resolve(ProxyConfig, args, config_file=str(path) if path else None, environ=environ or {})[0]


def test_llm_repeats_on_the_command_line_and_is_a_list_elsewhere(tmp_path):
    c = config(["--encoder", "http://e:1", "--llm", "http://a:1", "--llm", "http://b:2"])
    assert c.llm == ("http://a:1", "http://b:2") and c.mode == "embeds" and c.encoder_down == "fail"
    assert config([], {"EPD_ENCODER_LLM": "http://a:1, http://b:2"}).llm == ("http://a:1", "http://b:2")
    assert config([], toml='llm = ["http://a:1"]\nmode = "embeds"', tmp_path=tmp_path).llm == ("http://a:1",)
    assert config(["--llm", "http://c:3"], {"EPD_ENCODER_LLM": "http://a:1"}).llm == ("http://c:3",)  # flag wins


@pytest.mark.parametrize("argv, message", [
    (["--llm", "http://a:1"], "--encoder URL is required"),
    (["--encoder", "http://e:1"], "--llm URL is required"),
    (["--encoder", "e:1", "--llm", "http://a:1"], "--encoder 'e:1': expected an http(s)://host[:port] URL"),
    (["--encoder", "http://e:1", "--llm", "ftp://a"], "--llm 'ftp://a'"),
])
def test_proxy_refuses_what_it_cannot_run_in_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["proxy", *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_vllm_args_prints_the_flags_embeds_mode_needs(capsys):
    assert main(["vllm-args", "--encoder", "http://e:1"]) == 0
    assert capsys.readouterr().out == "--enable-mm-embeds\n"


def test_vllm_args_for_uuid_mode_loads_our_connector_pointed_at_the_tier(capsys):
    import json
    import shlex

    assert main(["vllm-args", "--encoder", "http://e:1", "--mode", "uuid", "--encoder-api-key", "k",
                 "--encoder-down", "local"]) == 0
    flag, value = shlex.split(capsys.readouterr().out)
    assert flag == "--ec-transfer-config" and json.loads(value) == {
        "ec_connector": "EPDEncoderConnector", "ec_connector_module_path": "epd_encoder.integrations.vllm",
        "ec_role": "ec_consumer",
        "ec_connector_extra_config": {"encoder_url": "http://e:1", "api_key": "k", "on_missing": "local"}}


def test_vllm_args_for_the_example_connector_store_names_the_tiers_directory(capsys):
    import json
    import shlex

    argv = ["vllm-args", "--encoder", "http://e:1", "--mode", "uuid", "--uuid-delivery", "ec_store"]
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2 and "--ec-store-path DIR" in capsys.readouterr().err
    assert main([*argv, "--ec-store-path", "/shared/ec"]) == 0
    flag, value = shlex.split(capsys.readouterr().out)
    assert json.loads(value) == {"ec_connector": "ECExampleConnector", "ec_role": "ec_consumer",
                                 "ec_connector_extra_config": {"shared_storage_path": "/shared/ec"}}


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_proxy_exits_0_after_draining_on_a_signal(sig, tmp_path):
    """As ``serve`` (docs/operations.md, "Exit status after a signal"): not -15 or a traceback."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path / "proxy.log"
    proc = subprocess.Popen([sys.executable, "-m", "epd_encoder.cli", "proxy", "--port", str(port),
                             "--encoder", "http://127.0.0.1:9", "--llm", "http://127.0.0.1:9"],
                            stdout=log.open("wb"), stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 60
        while True:  # serving once the port takes a connection
            assert proc.poll() is None, log.read_text()[-2000:]
            assert time.monotonic() < deadline, "the proxy never listened"
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        proc.send_signal(sig)
        assert proc.wait(30) == 0, log.read_text()[-2000:]
        assert "Traceback" not in log.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
