"""Thread count of the OpenMP kernels: KTCY_NUM_THREADS, else every core this process may use."""
import os

from ktcy import _native


def default_num_threads():
    env = os.environ.get("KTCY_NUM_THREADS")
    if env:
        try:
            n = int(env)
        except ValueError:
            raise ValueError(f"KTCY_NUM_THREADS={env!r} is not a whole number") from None
        if n < 1:
            raise ValueError(f"KTCY_NUM_THREADS={env!r} must be >= 1")
        return n
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def set_num_threads(n):
    """Threads used by every kernel from now on (the calling thread is one of them)."""
    _native.set_num_threads(int(n))


def get_num_threads():
    return _native.get_num_threads()
