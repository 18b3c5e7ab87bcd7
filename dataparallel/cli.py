"""``dataparallel`` command line.

dataparallel serve zmq://0.0.0.0:29500 --token-env DP_TOKEN   # standalone coordinator
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys

from . import __version__
from .errors import ConfigError
from .registry import parse_url, transport_class


def _serve(args: argparse.Namespace) -> int:
    url = parse_url(args.url)
    cls = transport_class(url.scheme)
    serve = getattr(cls, "serve", None)
    if serve is None:
        raise ConfigError(f"transport {url.scheme!r} has no standalone coordinator to serve")
    token = os.environ.get(args.token_env) if args.token_env else None
    # SIGTERM ends the server like Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)

    def ready(port: int) -> None:
        print(
            f"dataparallel {__version__}: serving {args.url} on port {port} (token {'set' if token else 'not set'})",
            flush=True,
        )

    try:
        serve(url, token, ready)
    except KeyboardInterrupt:
        pass
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dataparallel",
        description="Data-parallel PyTorch training over a pluggable control channel.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="example:\n  DP_TOKEN=s3cret dataparallel serve zmq://0.0.0.0:29500 --token-env DP_TOKEN",
    )
    parser.add_argument("--version", action="version", version=f"dataparallel {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log coordinator events")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="run a standalone coordinator (zmq)")
    serve.add_argument("url", help="where to listen, e.g. zmq://0.0.0.0:29500[?curve=1]")
    serve.add_argument(
        "--token-env", default="DP_TOKEN", help="environment variable holding the job token (default DP_TOKEN)"
    )
    serve.set_defaults(run=_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(message)s")
    try:
        return args.run(args)
    except ConfigError as err:
        print(f"dataparallel: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
