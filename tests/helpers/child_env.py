"""The environment of a Python child process a test starts (`python -c CODE`): the repository root
first on PYTHONPATH, so the child imports this checkout's qcompress and the tests package as the
test process does (pytest.ini's `pythonpath = .`), whatever its working directory."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env(**extra: str) -> dict:
    """os.environ plus `extra`, with ROOT prepended to PYTHONPATH."""
    env = dict(os.environ, **extra)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH", "")) if p)
    return env
