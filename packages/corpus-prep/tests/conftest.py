"""One local Ray instance for every Ray test of this package (it takes half a minute or more to
start on a loaded machine): started by the first test that asks for it, shut down at the end.

Ray's raylet gives its Python agents fixed times to report their ports (15 s for the
dashboard agent's files, 30 s for the node to register), not configurable, and aborts when
they are missed; on a busy test machine the agents import more slowly than that. So the
test instance is started with every agent port chosen up front (the raylet then does not
wait for those files), the listen-port file the raylet still waits for written beforehand
with the same port, and the node look-up polled for longer. `mg-prep` itself starts Ray
plainly; this only makes the tests' own instance start where the machine is slow.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import os
import socket
import time
from collections.abc import Iterator

import pytest

START_ATTEMPTS = 2
NODE_WAIT_S = 300.0
AGENT_PORTS = (
    "metrics_agent_port",
    "metrics_export_port",
    "dashboard_agent_listen_port",
    "runtime_env_agent_port",
)


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray instance with 2 CPUs; the test is skipped where one cannot start."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed")
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_agent_register_timeout_ms", "180000")
    os.environ.setdefault("RAY_worker_register_timeout_seconds", "300")  # slow imports too
    with _patient_start():
        _start(ray)
    yield ray
    ray.shutdown()


def _start(ray) -> None:
    for attempt in range(START_ATTEMPTS):
        try:
            ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
            return
        except Exception as err:  # Ray gives its raylet and agents fixed times to start
            ray.shutdown()
            if attempt + 1 == START_ATTEMPTS:
                pytest.skip(f"a local Ray instance did not start: {str(err).splitlines()[0]}")


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def _patient_start() -> Iterator[None]:
    """Ray's start-up with the agent ports chosen up front (see the module docstring)."""
    try:
        import ray._private.parameter as parameter
        import ray._private.services as services

        init, start_raylet, get_node = (
            parameter.RayParams.__init__,
            services.start_raylet,
            services.get_node,
        )
        names = list(inspect.signature(start_raylet).parameters)
    except (ImportError, AttributeError, ValueError):  # another Ray: start it plainly
        yield
        return

    def params_with_ports(self, *args, **kwargs) -> None:
        init(self, *args, **kwargs)
        for name in AGENT_PORTS:
            if not getattr(self, name, None):
                setattr(self, name, _free_port())

    def raylet_with_listen_port(*args, **kwargs):
        bound = {**dict(zip(names, args, strict=False)), **kwargs}
        port = bound.get("dashboard_agent_listen_port")
        if port and "session_dir" in bound and "node_id" in bound:
            name = f"dashboard_agent_listen_port_{bound['node_id']}"
            with open(os.path.join(bound["session_dir"], name), "w") as out:
                out.write(str(port))
        return start_raylet(*args, **kwargs)

    def patient_get_node(*args, **kwargs):
        deadline = time.monotonic() + NODE_WAIT_S
        while True:
            try:
                return get_node(*args, **kwargs)
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)

    parameter.RayParams.__init__ = params_with_ports
    services.start_raylet = raylet_with_listen_port
    services.get_node = patient_get_node
    try:
        yield
    finally:
        parameter.RayParams.__init__ = init
        services.start_raylet = start_raylet
        services.get_node = get_node
