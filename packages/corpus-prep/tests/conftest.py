"""One local Ray instance for every Ray test of this package (it takes half a minute to start
on a loaded machine): started by the first test that asks for it, shut down at the end."""

from __future__ import annotations

import importlib.util
import os

import pytest

START_ATTEMPTS = 2


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray instance with 2 CPUs; the test is skipped where one cannot start."""
    if importlib.util.find_spec("ray") is None:
        pytest.skip("ray is not installed")
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_agent_register_timeout_ms", "180000")
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
