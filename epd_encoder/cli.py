# SPDX-License-Identifier: Apache-2.0
"""``epd-encoder``: serve | make-tiny-model. Flags come from the config tree."""

from __future__ import annotations

import argparse
import logging
import sys

from epd_encoder.config import ServeConfig, add_arguments, from_namespace


def _serve(args: argparse.Namespace) -> int:
    import uvicorn

    from epd_encoder.api.app import create_app
    from epd_encoder.server.http import uvicorn_config
    from epd_encoder.server.runtime import Runtime

    try:
        config: ServeConfig = from_namespace(ServeConfig, args)
    except ValueError as e:
        args.parser.error(str(e))
    server = uvicorn.Server(uvicorn_config(create_app(config, Runtime), config))
    server.run()
    return 0 if server.started else 3  # uvicorn's STARTUP_FAILURE


def _make_tiny(argv: list[str]) -> int:
    from epd_encoder.models.tiny import make_tiny_model_main

    return make_tiny_model_main(argv) or 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="epd-encoder",
        description="The encode tier for EPD-disaggregated vision-language model serving.",
    )
    subs = parser.add_subparsers(dest="command", required=True)
    serve = subs.add_parser(
        "serve",
        help="Run the encoder on a model (the built-in tiny model by default).",
    )
    add_arguments(serve, ServeConfig)
    serve.set_defaults(func=_serve, parser=serve)
    subs.add_parser("make-tiny-model", add_help=False,
                    help="Write a tiny random checkpoint (see make-tiny-model --help).")
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if argv[:1] == ["make-tiny-model"]:
        return _make_tiny(argv[1:])
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    raise SystemExit(main())
