"""Signals as the command-line tools take them: SIGTERM and SIGHUP as Ctrl-C, so that cleanup
code (publish()'s temporary files, launch's ranks) runs on kill, timeout, docker stop or a closed
terminal too, and signals held back while such cleanup must finish.  Main thread only: Python
runs signal handlers there; elsewhere these change nothing."""
import signal
import threading
from contextlib import contextmanager


def _main_thread():
    return threading.current_thread() is threading.main_thread()


def _not_ignored(*signals):
    """The signals this process does not ignore: `nohup` (SIGHUP) or a background job (SIGINT)
    keep theirs ignored."""
    return [sig for sig in signals if signal.getsignal(sig) is not signal.SIG_IGN]


@contextmanager
def termination_as_interrupt():
    """SIGTERM and SIGHUP raise KeyboardInterrupt, as SIGINT does (Python's default for them ends
    the process on the spot, past every finally)."""
    if not _main_thread():
        yield
        return

    def interrupt(*_):
        raise KeyboardInterrupt
    old = {sig: signal.signal(sig, interrupt) for sig in _not_ignored(signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)


@contextmanager
def signals_deferred():
    """SIGINT/SIGTERM/SIGHUP arriving meanwhile are noted, not raised, and raised as
    KeyboardInterrupt once the block is done.  Blocking them with pthread_sigmask is not enough:
    the process's other threads (BLAS, OpenMP) would take them."""
    if not _main_thread():
        yield
        return
    arrived = []
    old = {sig: signal.signal(sig, lambda number, _: arrived.append(number))
           for sig in _not_ignored(signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if arrived:
        raise KeyboardInterrupt
