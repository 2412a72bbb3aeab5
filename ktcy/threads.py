"""Thread count of the OpenMP kernels: KTCY_NUM_THREADS, else every core this process may use.

The count is bounded by the CPUs in the affinity mask (more threads never help these kernels,
and libgomp aborts or crashes the process when asked for tens of thousands).  A bad
KTCY_NUM_THREADS does not fail `import ktcy` (the CLI's info/convert must still run): it is
logged once and the default is used; `ktcy.threads.ENV_PROBLEMS` keeps the message."""
import logging
import os
from typing import List

from ktcy import _native

log = logging.getLogger("ktcy")
ENV_PROBLEMS: List[str] = []


def default_num_threads() -> int:
    cpus = _native.usable_cpus()
    env = os.environ.get("KTCY_NUM_THREADS", "").strip()
    if not env:
        return cpus
    try:
        n = int(env)
    except ValueError:
        return _env_problem(f"KTCY_NUM_THREADS={env!r} is not a whole number; using {cpus} threads", cpus)
    if n < 1:
        return _env_problem(f"KTCY_NUM_THREADS={env!r} must be >= 1; using {cpus} threads", cpus)
    if n > cpus:
        return _env_problem(f"KTCY_NUM_THREADS={n} exceeds the {cpus} CPUs this process may use; using {cpus}", cpus)
    return n


def _env_problem(message: str, fallback: int) -> int:
    ENV_PROBLEMS.append(message)
    log.warning(message)
    return fallback


def set_num_threads(n: int) -> None:
    """Threads used by every kernel from now on (the calling thread is one of them): an integer
    (TypeError otherwise, bools included) between 1 and the CPUs this process may use (else
    ValueError)."""
    _native.set_num_threads(n)


def get_num_threads() -> int:
    return _native.get_num_threads()
