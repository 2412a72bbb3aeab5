"""Other code on ktcy's threads (oneDNN under torch) may release or reload the AMX tiles between
two ktcy calls; the next call must still run.  It died with SIGILL while ktcy cached the tile
configuration per thread (the hf tests on a Xeon with AMX), hence a subprocess."""
import subprocess
import sys
import textwrap

import pytest

from ktcy import _native

pytestmark = pytest.mark.skipif("amx" not in _native.available_isas(),
                                reason="ISA amx is not usable on this CPU/OS/build")

CHILD = textwrap.dedent("""
    import numpy as np
    from ktcy import _native, kernels
    rng = np.random.default_rng(0)
    for fmt in ("INT8", "BF16", "INT4"):
        packed = kernels.pack(rng.standard_normal((64, 256), np.float32), fmt)
        x = rng.standard_normal((20, 256), np.float32)
        first = kernels.linear(x, packed, "amx")
        _native.amx_release_tiles()
        assert np.array_equal(kernels.linear(x, packed, "amx"), first), fmt
    print("ok")
""")


def test_amx_call_after_a_foreign_tile_release():
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stdout.strip() == "ok", (run.returncode, run.stderr[-2000:])


def test_release_helper_refuses_without_amx(monkeypatch):
    monkeypatch.setattr(_native, "available_isas", lambda: ("ref", "amx_emu"))
    with pytest.raises(Exception, match="AMX is not usable"):
        _native.amx_release_tiles()
