"""The package's logging: every module logs to the "ktcy" logger and never prints.

`set_verbosity(level)` works like transformers': it sets the "ktcy" logger's level and, once,
gives it a stderr handler that writes "ktcy: warning: text" (a leading "ktcy: " in the text is not
repeated) and shows each distinct message once per process."""
import logging
import sys
from typing import Optional, Set, Union

logger = logging.getLogger("ktcy")

DEBUG, INFO, WARNING, ERROR = logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR
_NAMES = {"debug": DEBUG, "info": INFO, "warning": WARNING, "error": ERROR}
_handler: Optional[logging.Handler] = None


class _OncePerMessage(logging.Filter):
    """Lets each distinct (level, text) through once: a fallback notice per layer is one notice."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def filter(self, record):
        key = (record.levelno, record.getMessage())
        if key in self.seen:
            return False
        self.seen.add(key)
        return True


class _Formatter(logging.Formatter):
    def format(self, record):
        text = record.getMessage()
        if text.startswith("ktcy: "):
            text = text[len("ktcy: "):]
        line = f"ktcy: {record.levelname.lower()}: {text}"
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def _level(level):
    if isinstance(level, str):
        if level.lower() not in _NAMES:
            raise ValueError(f"unknown verbosity {level!r}; choose one of {', '.join(_NAMES)} or a logging level")
        return _NAMES[level.lower()]
    if isinstance(level, bool) or not isinstance(level, int):
        raise TypeError(f"verbosity must be a logging level (int) or a name, got {type(level).__name__}")
    return level


def set_verbosity(level: Union[int, str]) -> None:
    """Show ktcy's messages at `level` and above on stderr: logging.DEBUG/INFO/WARNING/ERROR or
    "debug"/"info"/"warning"/"error"."""
    global _handler
    logger.setLevel(_level(level))
    if _handler is None:
        _handler = logging.StreamHandler(sys.stderr)
        _handler.setFormatter(_Formatter())
        _handler.addFilter(_OncePerMessage())
        logger.addHandler(_handler)
        logger.propagate = False  # one line per message, not a second one from the root logger


def get_verbosity() -> int:
    """The "ktcy" logger's effective level."""
    return logger.getEffectiveLevel()


def quiet():
    """True when progress output should be left out (verbosity above WARNING)."""
    return logger.getEffectiveLevel() > WARNING


_warned: Set[str] = set()


def warn_once(message):
    """A WARNING on the "ktcy" logger the first time this text is seen in the process, whatever
    handlers the application set up (one notice per model, not one per layer)."""
    if message not in _warned:
        _warned.add(message)
        logger.warning(message)
