"""Progress of long steps (packing, converting, benchmarking) for the whole package.

    bar = progress.reporter("packing INT8", total=128, unit="expert")
    for e in range(128): ...; bar.update(e + 1, 128)
    bar.close()

On a terminal (stderr) it is a tqdm bar with rate and ETA; elsewhere (logs, CI, pipes) one plain
line when the step ends; nothing when ktcy's verbosity is above WARNING (`-q`)."""
import sys
import time

from ktcy import log


class _Reporter:
    def __init__(self, desc, total, unit, stream):
        self.desc, self.total, self.unit, self.done = desc, int(total), unit, 0
        self.stream = stream
        self.start = time.perf_counter()
        self.closed = False
        self.bar = None
        if not log.quiet() and _isatty(stream):
            from tqdm import tqdm
            self.bar = tqdm(total=self.total, desc=desc, unit=unit, file=stream, leave=True, dynamic_ncols=True)

    def update(self, done, total=None):
        """Absolute progress: `done` of `total` units (the signature of ktcy's progress callbacks)."""
        if total is not None and int(total) != self.total:
            self.total = int(total)
            if self.bar is not None:
                self.bar.total = self.total
        self.done = int(done)
        if self.bar is not None:
            self.bar.update(self.done - self.bar.n)

    __call__ = update

    def close(self):
        if self.closed:
            return
        self.closed = True
        if self.bar is not None:
            self.bar.close()
        elif not log.quiet():
            seconds = time.perf_counter() - self.start
            self.stream.write(f"{self.desc}: {self.done}/{self.total} {self.unit} in {seconds:.1f} s\n")
            self.stream.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False


def _isatty(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def reporter(desc: str, total: int, unit: str = "it", stream=None):
    """A progress reporter: update(done, total) as work advances, close() at the end (or use it
    as a context manager).  stream: where it writes, sys.stderr by default."""
    return _Reporter(desc, total, unit, stream if stream is not None else sys.stderr)
