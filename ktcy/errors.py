"""Exceptions raised by ktcy, and how an error from deeper down is given its context."""
import contextlib


class UnsupportedISAError(RuntimeError):
    """An ISA was forced (KTCY_ISA, isa=...) that this CPU, OS or build cannot run."""


class TileError(RuntimeError):
    """The emulated AMX tile unit met an instruction that real hardware would fault on."""


@contextlib.contextmanager
def naming(where, value_error=ValueError):
    """A plain ValueError or TypeError raised in the block (a weight refused by a packer, say)
    raised again with `where: ` in front - the ValueError as value_error.  ktcy's own subclasses
    (CheckpointError, RuleError, ...) already say where they come from and pass unchanged."""
    try:
        yield
    except (TypeError, ValueError) as e:
        if type(e) is TypeError:
            raise TypeError(f"{where}: {e}") from None
        if type(e) is ValueError:
            raise value_error(f"{where}: {e}") from None
        raise
