"""`--engine`, `--ray-address`, `--ray-connect-timeout`: the flags of every command that runs
on Ray too (`tokenize`, `clean`, `dedup`), and their checks. Light: no `ray` import."""

from __future__ import annotations

import argparse
import importlib.util

from mg.corpus_prep.commands import UserError

DEFAULT_CONNECT_TIMEOUT = 30.0  # ray_cluster's default, repeated here to keep --help light


class RayAddressError(ValueError):
    """--ray-address is not an address; the message is the user's one line."""


def host_and_port(address: str) -> tuple[str, int] | None:
    """`(host, port)` of a `host:port` or `ray://host:port` address; None for `auto`/`local`."""
    if address in ("auto", "local"):
        return None
    rest = address.split("://", 1)[1] if "://" in address else address
    host, _, port = rest.rpartition(":")
    if not host or not port.isdigit():
        raise RayAddressError(
            f"--ray-address {address}: not an address; give auto, HOST:PORT "
            "(the head's GCS port, 6379 by default) or ray://HOST:PORT"
        )
    return host.strip("[]"), int(port)


def add_ray_arguments(group: argparse._ArgumentGroup, engine_help: str) -> None:
    group.add_argument("--engine", choices=("local", "ray"), default="local", help=engine_help)
    group.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="with --engine ray: the cluster to join (auto, HOST:PORT as `ray start --head` "
        "prints it, or ray://HOST:10001); default: a local Ray instance on this machine's CPUs",
    )
    group.add_argument(
        "--ray-connect-timeout",
        type=float,
        default=DEFAULT_CONNECT_TIMEOUT,
        metavar="SECONDS",
        help="with --ray-address: give up joining the cluster after this long "
        "(default: %(default)g)",
    )


def check_ray_arguments(args: argparse.Namespace) -> None:
    """The Ray flags make sense together, and ray is installed when --engine ray asks for it."""
    if args.ray_address is not None and args.engine != "ray":
        raise UserError(f"--ray-address {args.ray_address}: only with --engine ray")
    if args.ray_connect_timeout != DEFAULT_CONNECT_TIMEOUT and args.ray_address is None:
        raise UserError(
            f"--ray-connect-timeout {args.ray_connect_timeout:g}: only with --ray-address "
            "(a local instance is started, not joined)"
        )
    if args.ray_address is not None:
        try:
            host_and_port(args.ray_address)
        except RayAddressError as err:
            raise UserError(str(err)) from None
    if args.ray_connect_timeout <= 0:
        raise UserError(f"--ray-connect-timeout {args.ray_connect_timeout:g}: must be above 0")
    if args.engine == "ray" and importlib.util.find_spec("ray") is None:
        raise UserError(
            "--engine ray: the ray package is not installed; install mg-corpus-prep[ray]"
        )
