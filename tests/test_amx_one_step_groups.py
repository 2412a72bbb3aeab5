"""The AMX kernels' path for formats whose scale group is one K step (INT4 g32/g64, INT4_ZP,
MXFP4_A8: gemm_amx_tpl.h, one_step_groups).  Its edges: an odd and an even number of groups (the
C tiles and buffers alternate per group), a one-panel tail (one thread: the last of 3 panels runs
alone), row counts that leave the second 16-row half empty, partial or full, and more rows than
one packed activation chunk (128).  The integer formats equal their documented epilogue from
integers bit for bit.  MXFP4 (bf16 activations, scaled in its decode: the 2 x 2 path) on real
tiles agrees with amx_emu to the last bits (a real TDPBF16PS rounds its sums otherwise than the
SDM's sequential model that amx_emu follows: about one output in 12 of a 1536 x 2048 MXFP4
projection, every one of a BF16 one, differs in its last bits) and with float64 to the bf16
activations' error."""
import numpy as np
import pytest

from conftest import int4_exact_reference, mxfp4_a8_exact_reference
from ktcy import _native, kernels

AMX_ISAS = [v["isa"] for v in _native.variants() if v["name"] in ("amx_int4", "amx_emu_int4")]
ROWS = (1, 15, 16, 17, 32, 33, 129)


def _skip_unless_runnable(isa, fmt):
    names = [v["name"] for v in _native.variants() if v["isa"] == isa and fmt in v["formats"]]
    if not names or not next(v for v in _native.variants() if v["name"] == names[0])["runnable"]:
        pytest.skip(f"{isa}: this CPU cannot run it")
    return names[0]


@pytest.mark.parametrize("isa", AMX_ISAS)
@pytest.mark.parametrize("fmt, group, k", [
    ("INT4", 64, 192),      # 3 groups: odd
    ("INT4", 64, 256),      # 4 groups: even
    ("INT4", 32, 96),       # 32-K steps (K padded to 128: 4 groups; 32-K groups always come in pairs)
    ("INT4", 128, 320),     # two steps per group: the 2 x 2 blocking, beside the others
    ("INT4_ZP", 64, 192),
    ("INT4_ZP", 32, 128),
    ("INT4_MIN", 64, 192),
    ("INT4_MIN", 32, 96),
    ("INT4_MIN", 128, 320),
    ("MXFP4_A8", None, 96),   # 32-K blocks over a padded K: 4 steps after padding to 128
    ("MXFP4_A8", None, 160),
])
def test_integer_formats_equal_their_epilogue_from_integers(isa, fmt, group, k, one_thread):
    variant = _skip_unless_runnable(isa, fmt)
    rng = np.random.default_rng(group or k)
    n = 16 * 2 + 7  # a pair of panels, then a partial third alone
    w = rng.standard_normal((n, k)).astype(np.float32)
    packed = kernels.pack(w, fmt, group_size=group) if group else kernels.pack(w, fmt)
    exact = int4_exact_reference if fmt.startswith("INT4") else mxfp4_a8_exact_reference
    for m in ROWS:
        x = rng.standard_normal((m, k)).astype(np.float32)
        y = kernels.linear_variant(x, packed, variant)
        assert y.tobytes() == exact(x, packed).tobytes(), f"{fmt} g{group} K={k} {variant} m={m}"


def test_mxfp4_real_tiles_agree_with_the_emulated_ones_and_float64():
    real = _skip_unless_runnable("amx", "MXFP4")
    rng = np.random.default_rng(11)
    for n, k in ((16 * 3 + 7, 96), (40, 160)):
        w = rng.standard_normal((n, k)).astype(np.float32)
        packed = kernels.pack(w, "MXFP4")
        reference = packed.dequantize(np.float64)
        for m in ROWS:
            x = rng.standard_normal((m, k)).astype(np.float32)
            y = kernels.linear_variant(x, packed, real)
            emulated = kernels.linear_variant(x, packed, "amx_emu_mxfp4")
            exact = x.astype(np.float64) @ reference.T
            assert np.abs(y - emulated).max() <= 1e-5 * np.abs(exact).max(), f"n={n} K={k} m={m}"
            assert np.abs(y - exact).max() <= 0.01 * np.abs(exact).max(), f"n={n} K={k} m={m}"  # bf16 activations
