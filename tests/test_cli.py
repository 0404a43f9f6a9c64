# SPDX-License-Identifier: Apache-2.0
"""The command line, environment and TOML layers of the config tree, and the docs that name flags."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from epd_encoder.cli import build_parser, main, version
from epd_encoder.config import ServeConfig
from epd_encoder.flags import FlagError, leaves, markdown, resolve

ROOT = Path(__file__).resolve().parents[1]


def layered(*argv, env=None, toml: str | None = None, tmp_path=None):
    ns = build_parser().parse_args(["serve", *argv])
    path = None
    if toml is not None:
        path = tmp_path / "epd.toml"
        path.write_text(toml)
    return resolve(ServeConfig, ns, config_file=ns.config or (str(path) if path else None), environ=env or {})


def test_sources_merge_defaults_then_toml_then_environment_then_command_line(tmp_path):
    toml = "max-batch-cost = 1000\ncache_mb = 7\nlookahead = 3\nallow-url-fetch = true\n"
    env = {"EPD_ENCODER_MAX_BATCH_COST": "2000", "EPD_ENCODER_CACHE_MB": "9"}
    cfg, warnings = layered("--max-batch-cost", "3000", env=env, toml=toml, tmp_path=tmp_path)
    assert cfg.engine.scheduler.max_batch_cost == 3000  # command line over all
    assert cfg.engine.cache.cache_mb == 9  # environment over TOML
    assert cfg.engine.scheduler.lookahead == 3  # TOML over default
    assert cfg.fetch.allow_url_fetch is True and cfg.port == 8000 and warnings == []


def test_config_file_may_come_from_the_environment(tmp_path):
    (tmp_path / "c.toml").write_text('device = "cpu"\n')
    cfg, _ = layered(env={"EPD_ENCODER_CONFIG": str(tmp_path / "c.toml")})
    assert cfg.model.device == "cpu"


@pytest.mark.parametrize("raw,expected", [("1", True), ("true", True), ("ON", True), ("no", False), ("0", False)])
def test_boolean_environment_values(raw, expected):
    cfg, _ = layered(env={"EPD_ENCODER_PUBLIC_DOCS": raw})
    assert cfg.auth.public_docs is expected


def test_command_line_negation_beats_the_environment():
    cfg, _ = layered("--no-public-docs", env={"EPD_ENCODER_PUBLIC_DOCS": "true"})
    assert cfg.auth.public_docs is False


def test_empty_environment_value_counts_as_unset():
    cfg, _ = layered(env={"EPD_ENCODER_API_KEY": "", "EPD_ENCODER_PORT": " "})
    assert cfg.auth.api_key is None and cfg.port == 8000


@pytest.mark.parametrize("env,needle", [
    ({"EPD_ENCODER_PORT": "eighty"}, "EPD_ENCODER_PORT='eighty': invalid int value"),
    ({"EPD_ENCODER_ADMISSION": "fifo"}, "EPD_ENCODER_ADMISSION: 'fifo' is not one of lru, tinylfu"),
    ({"EPD_ENCODER_ALLOW_URL_FETCH": "maybe"}, "EPD_ENCODER_ALLOW_URL_FETCH='maybe'"),
    ({"EPD_ENCODER_MAX_ITEMS": "0"}, "--max-items must be > 0, got 0 (--max-items from EPD_ENCODER_MAX_ITEMS)"),
])
def test_bad_environment_values_name_the_variable(env, needle):
    with pytest.raises(FlagError) as exc:
        layered(env=env)
    assert needle in str(exc.value)


def test_unknown_epd_variables_are_warned_about_not_ignored_silently():
    _, warnings = layered(env={"EPD_ENCODER_MAX_BATCH_COSTS": "1", "EPD_ENCODER_CACHE": "/tmp/x", "HOME": "/"})
    assert warnings == ["ignoring unknown environment variable EPD_ENCODER_MAX_BATCH_COSTS"]


@pytest.mark.parametrize("toml,needle", [
    ("max-batch-costs = 1\n", "unknown key 'max-batch-costs'"),
    ("[limits]\nmax_items = 8\n", "sections are not used"),
    ('port = "80"\n', "port = '80': expected int"),
    ("lookahead = 1.5\n", "expected int"),
    ("public-docs = 1\n", "expected bool"),
    ("max-items = 4\nmax_items = 5\n", "are the same setting"),
    ("port = \n", "not valid TOML"),
    ("max-items = 0\n", "(--max-items from "),
])
def test_bad_toml_is_an_error_naming_the_file_and_key(tmp_path, toml, needle):
    with pytest.raises(FlagError) as exc:
        layered(toml=toml, tmp_path=tmp_path)
    assert needle in str(exc.value)


def test_float_leaves_take_toml_integers(tmp_path):
    cfg, _ = layered(toml="request-timeout = 5\n", tmp_path=tmp_path)
    assert cfg.request_timeout == 5.0 and isinstance(cfg.request_timeout, float)


def test_missing_config_file_is_a_usage_error(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--config", str(tmp_path / "nope.toml")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.startswith("epd-encoder serve: error: --config ") and "No such file" in err


@pytest.mark.parametrize("argv,first", [
    (["serve", "--max-batch-cost", "x"], "epd-encoder serve: error: argument --max-batch-cost: invalid int value: 'x'"),
    (["serve", "--device", "tpu"], "epd-encoder serve: error: --device must be auto, cpu, cuda or cuda:N, got 'tpu'"),
    (["serve", "--admission", "fifo"], "epd-encoder serve: error: argument --admission: invalid choice"),
    (["frobnicate"], "epd-encoder: error: argument command: invalid choice"),
    # The subcommand's parser reports an unknown flag, and its --help is the one to read.
    (["serve", "--bogus-flag"], "epd-encoder serve: error: unrecognized arguments: --bogus-flag"),
    (["serve", "--port", "0", "--bogus-flag", "x"], "epd-encoder serve: error: unrecognized arguments: --bogus-flag x"),
    (["proxy", "--bogus-flag"], "epd-encoder proxy: error: unrecognized arguments: --bogus-flag"),
    (["vllm-args", "--bogus-flag"], "epd-encoder vllm-args: error: unrecognized arguments: --bogus-flag"),
    (["flags", "--bogus-flag"], "epd-encoder flags: error: unrecognized arguments: --bogus-flag"),
    (["bench", "--bogus-flag"], "epd-encoder bench: error: unrecognized arguments: --bogus-flag"),
    (["make-tiny-model", "out", "--bogus-flag"], "epd-encoder make-tiny-model: error: unrecognized arguments: --bogus-flag"),
])
def test_parse_errors_lead_with_the_error(capsys, argv, first):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and err.splitlines()[0].startswith(first), err
    assert "usage:" not in err
    prog = first.split(": error:")[0]
    assert err.splitlines()[1] == f"Run '{prog} --help' for the flags."


def test_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0 and capsys.readouterr().out.strip() == f"epd-encoder {version()}"
    assert version() != "unknown"


def test_help_names_each_flags_environment_variable_and_default(capsys):
    with pytest.raises(SystemExit):
        main(["serve", "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for leaf in leaves(ServeConfig):
        assert f"[env: {leaf.env}]" in text, leaf.name
    assert "(default: false) [env: EPD_ENCODER_BATCH_INVARIANT]" in text  # on/off flags too
    assert "--device {auto,cpu,cuda,cuda:N}" in text


def test_make_tiny_model_help_covers_every_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["make-tiny-model", "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0
    for flag in ("--family", "--seed", "--shards", "--lm-scale"):
        line = out[out.index(f"  {flag} "):]
        assert "(default: " in line.split("\n  -")[0], flag


def test_docs_flags_md_is_generated_from_the_tree():
    assert (ROOT / "docs" / "flags.md").read_text() == markdown(ServeConfig, "epd-encoder serve"), \
        "docs/flags.md is stale: run `epd-encoder flags --markdown > docs/flags.md`"


def _known_flags() -> set[str]:
    from epd_encoder.models import tiny

    from epd_encoder.config import ProxyConfig  # epd-encoder proxy | vllm-args (docs/proxy.md)
    from epd_encoder.config.router import RouterConfig  # epd-encoder route (docs/router.md, deployment.md)

    tree = [*leaves(ServeConfig), *leaves(ProxyConfig), *leaves(RouterConfig)]
    known = {leaf.flag for leaf in tree}
    known |= {f"--no-{leaf.key}" for leaf in tree if leaf.kind is bool}
    known |= {"--config", "--version", "--help", "--markdown"}
    src = Path(tiny.__file__).read_text()
    known |= set(re.findall(r'add_argument\("(--[a-z0-9-]+)"', src))
    from epd_encoder.bench.cli import build_parser as bench_parser  # docs/bench.md names its flags

    known |= {o for a in bench_parser()._actions for o in a.option_strings}
    for script in (ROOT / "benchmarks").glob("*.py"):  # docs/benchmarks.md names their flags
        known |= set(re.findall(r'add_argument\(\s*"(--[a-z0-9-]+)"', script.read_text()))
    return known


# Other programs' flags that the docs quote, with the program; everything else must be ours.
FOREIGN = {"--data-binary": "curl", "--enable-mm-embeds": "vllm serve", "--ec-transfer-config": "vllm serve",
           **dict.fromkeys(("--language-only", "--encoder-urls", "--model-path", "--encoder-transfer-backend",
                            "--encoder-register-urls", "--epd-disaggregation"), "sglang.launch_server / smg"),
           "--no-deps": "pip"}


def test_every_flag_the_docs_name_exists():
    known = _known_flags() | set(FOREIGN)
    missing = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", doc.read_text()):
            ok = flag in known or (flag.endswith("-") and any(k.startswith(flag) for k in known))
            if not ok:
                missing.append(f"{doc.name}: {flag}")
    assert not missing, missing


def test_bench_is_a_subcommand_with_its_own_flags(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0 and "bench" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and "usage: epd-encoder bench" in out and "--baseline" in out
