"""Exceptions raised by ktcy."""


class UnsupportedISAError(RuntimeError):
    """An ISA was forced (KTCY_ISA, isa=...) that this CPU, OS or build cannot run."""


class TileError(RuntimeError):
    """The emulated AMX tile unit met an instruction that real hardware would fault on."""
