# SPDX-License-Identifier: Apache-2.0
"""``epd-encoder``: serve | proxy | vllm-args | route | bench | make-tiny-model | flags. Flags come from the config tree.

Exit status: 0 after a clean shutdown; 2 for a setting that is wrong before anything
loads (a bad flag, environment variable or TOML key, a --model that is not there,
--device cuda without CUDA), printed as one ``error:`` line; 1 when the model fails
to load, 3 when the port cannot be bound (uvicorn's), each logged as one ERROR line. Tracebacks only at
--log-level debug: a supervisor's log should show the cause, not a stack.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from epd_encoder.config import ServeConfig
from epd_encoder.flags import CONFIG_ENV, ArgumentParser, FlagError, add_arguments, markdown, resolve

log = logging.getLogger("epd_encoder.cli")


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as dist_version

    try:
        return dist_version("epd-encoder")
    except PackageNotFoundError:  # a source tree that was never installed
        return "unknown"


def preflight(config: ServeConfig) -> str | None:
    """What is wrong before anything loads, as one line naming the cause; None if nothing.

    Kept small: the loader (models/loading/hub.py ``resolve``) makes the same checks and more
    (a file, a Hub id it cannot fetch); these run first only because they are cheap and
    transformers' own messages for them name the wrong cause ("Repo id must use ...").
    """
    from epd_encoder.models.loading.hub import is_hub_id

    m = config.model
    if m.model is not None:
        path = Path(m.model).expanduser()
        if path.is_dir() and not (path / "config.json").is_file():
            what = "is empty" if not any(path.iterdir()) else "has no config.json"
            return f"--model {m.model}: the directory {what}, so it is not a Hugging Face checkpoint"
        if not path.exists() and not is_hub_id(m.model):
            return f"--model {m.model}: no such directory, and not a Hugging Face Hub id (org/name)"
    if m.device.startswith("cuda"):
        import torch

        index = int(m.device.partition(":")[2] or 0)
        if not torch.cuda.is_available():
            return (f"--device {m.device}: CUDA is not available (torch {torch.__version__}, "
                    f"built for CUDA {torch.version.cuda or 'none'}); use --device cpu or auto")
        if index >= torch.cuda.device_count():
            return f"--device {m.device}: only {torch.cuda.device_count()} CUDA device(s) are visible"
    return None


def _serve(args: argparse.Namespace) -> int:
    parser: ArgumentParser = args.parser
    try:
        config, warnings = resolve(ServeConfig, args, config_file=args.config)
    except FlagError as e:
        parser.error(str(e))
    from epd_encoder.server.cpus import apply_wait_policy

    # Before torch loads (preflight may import it): libgomp reads this once, when it loads,
    # and TP ranks inherit it. The user's own setting wins (docs/operations.md, "Shared CPUs").
    apply_wait_policy(os.environ)
    problem = preflight(config)
    if problem:
        parser.error(problem)
    from epd_encoder.server.logs import configure_logging

    configure_logging(config.log)
    for warning in warnings:
        log.warning(warning)

    from epd_encoder.api.app import create_app
    from epd_encoder.server.http import run
    from epd_encoder.server.runtime import Runtime

    return run(create_app(config, Runtime), config)


def _proxy_config(args: argparse.Namespace, need_llm: bool):
    from epd_encoder.config.proxy import ProxyConfig

    try:
        config, warnings = resolve(ProxyConfig, args, config_file=args.config)
    except FlagError as e:
        args.parser.error(str(e))
    problem = config.missing(need_llm)
    if problem:
        args.parser.error(problem)
    return config, warnings


def _proxy(args: argparse.Namespace) -> int:
    config, warnings = _proxy_config(args, need_llm=True)
    for warning in warnings:
        log.warning(warning)
    from epd_encoder.integrations.proxy_app import run

    return run(config)


def _vllm_args(args: argparse.Namespace) -> int:
    config, _ = _proxy_config(args, need_llm=False)
    from epd_encoder.integrations.proxy_vllm_args import vllm_args_line

    try:
        print(vllm_args_line(config))
    except ValueError as e:
        args.parser.error(str(e))
    return 0


def _route(args: argparse.Namespace) -> int:
    from epd_encoder.config.router import RouterConfig

    try:
        config, warnings = resolve(RouterConfig, args, config_file=args.config)
    except FlagError as e:
        args.parser.error(str(e))
    problem = config.missing()
    if problem:
        args.parser.error(problem)
    for warning in warnings:
        log.warning(warning)
    from epd_encoder.router.app import run
    from epd_encoder.router.envoy import EnvoyMissing, find_envoy
    from epd_encoder.router.membership import Backend

    try:  # no binary; a --backend URL the router cannot use
        find_envoy(config.envoy_path)
        [Backend.from_url(url) for url in config.backend]
    except (EnvoyMissing, ValueError) as e:
        args.parser.error(str(e))
    return run(config)


def _make_tiny(argv: list[str]) -> int:
    from epd_encoder.models.tiny import make_tiny_model_main

    return make_tiny_model_main(argv) or 0


def _bench(argv: list[str]) -> int:
    from epd_encoder.bench.cli import main as bench_main

    return bench_main(argv)


def _flags(args: argparse.Namespace) -> int:
    if args.markdown:
        sys.stdout.write(markdown(ServeConfig, "epd-encoder serve"))
        return 0
    from epd_encoder.flags import leaves, show

    for leaf in leaves(ServeConfig):
        print(f"{leaf.flag:32} {leaf.env:44} {show(leaf.default)}")
    return 0


def build_parser() -> ArgumentParser:
    parser = ArgumentParser(
        prog="epd-encoder",
        description="The encode tier for EPD-disaggregated vision-language model serving.",
    )
    parser.add_argument("--version", action="version", version=f"epd-encoder {version()}")
    subs = parser.add_subparsers(dest="command", required=True)
    serve = subs.add_parser(
        "serve", help="Run the encoder on a model (the built-in tiny model by default).",
        description="Run the encoder. Every flag can also be set by the environment variable "
        "shown with it, or by its name as a key of a TOML file (--config); later sources win: "
        "defaults < TOML file < environment < command line (docs/operations.md, 'Configuration').",
    )
    serve.add_argument("--config", metavar="FILE", default=None,
                       help=f"TOML file of settings: flat keys named like the flags, e.g. "
                       f"max-batch-cost = 16384; an unknown key is an error. [env: {CONFIG_ENV}]")
    add_arguments(serve, ServeConfig)
    serve.set_defaults(func=_serve, parser=serve)
    from epd_encoder.config.proxy import ProxyConfig

    for name, func, text in (
        ("proxy", _proxy, "Serve vLLM's OpenAI API in front of vLLM, media encoded by the encode tier "
         "(docs/proxy.md)."),
        ("vllm-args", _vllm_args, "Print the vLLM server flags a proxy --mode needs, to append to "
         "the vLLM command."),
    ):
        sub = subs.add_parser(name, help=text, description=text)
        sub.add_argument("--config", metavar="FILE", default=None,
                         help=f"TOML file of settings, flat keys named like the flags. [env: {CONFIG_ENV}]")
        add_arguments(sub, ProxyConfig)
        sub.set_defaults(func=func, parser=sub)
    from epd_encoder.config.router import RouterConfig

    text = "Route the API over a fleet of servers: Envoy hashing each item's key (docs/router.md)."
    route = subs.add_parser("route", help=text, description=text)
    route.add_argument("--config", metavar="FILE", default=None,
                       help=f"TOML file of settings, flat keys named like the flags. [env: {CONFIG_ENV}]")
    add_arguments(route, RouterConfig)
    route.set_defaults(func=_route, parser=route)
    subs.add_parser("bench", add_help=False,
                    help="Load a server and measure it beside baselines (see bench --help).")
    subs.add_parser("make-tiny-model", add_help=False,
                    help="Write a tiny random checkpoint (see make-tiny-model --help).")
    flags = subs.add_parser("flags", help="List every serve flag with its environment variable and default.")
    flags.add_argument("--markdown", action="store_true", help="Write the reference docs/flags.md holds.")
    flags.set_defaults(func=_flags, parser=flags)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv[:1] == ["make-tiny-model"]:
        return _make_tiny(argv[1:])
    if argv[:1] == ["bench"]:
        return _bench(argv[1:])
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # argparse leaves these to the top parser, whose error names no subcommand
        args.parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
