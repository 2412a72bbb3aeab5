"""Expert id -1 (a slot handled elsewhere) and MoE.forward_slots, the per-slot addends of forward
that expert parallelism sums after its all-reduce: both must reproduce forward's bits."""
import numpy as np
import pytest

from conftest import ordered_slot_sum
import ktcy
from ktcy.formats import FORMATS, has_groups

E, K_TOP, H, I = 6, 3, 144, 80   # H, I not multiples of the 64-wide blocks


def isas():
    return [i for i in ktcy.available_isas() if i != "amx"] + ["amx_emu"]


def make_layer(fmt, isa, seed=3):
    rng = np.random.default_rng(seed)
    gate, up = (rng.standard_normal((E, I, H), np.float32) * 0.1 for _ in range(2))
    down = rng.standard_normal((E, H, I), np.float32) * 0.1
    group = 32 if has_groups(fmt) else None
    quant = ktcy.QuantConfig(fmt, group_size=group) if group else ktcy.QuantConfig(fmt)
    cfg = ktcy.MoeConfig(E, K_TOP, H, I, quant, isa=isa)
    return ktcy.MoE.from_weights(cfg, gate, up, down)


def routing(T, seed=5):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ids = np.stack([rng.choice(E - 1, K_TOP, replace=False) for _ in range(T)])  # expert E-1 gets no tokens
    w = rng.random((T, K_TOP)).astype(np.float32)
    return x, ids, w


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("fmt", [f for f in FORMATS if f != "FP8_PERCHANNEL"])
def test_slots_add_up_to_forward_bit_for_bit(fmt, isa):
    layer = make_layer(fmt, isa)
    for T in (1, 7, 40):  # 40 rows on one expert reach the prefill (AMX) kernel
        x, ids, w = routing(T)
        if T == 40:
            ids[:, 0] = 2
        y = layer.forward(x, ids, w)
        slots = layer.forward_slots(x, ids, w)
        assert slots.shape == (T, K_TOP, H) and slots.dtype == np.float32
        assert np.array_equal(ordered_slot_sum(slots).view(np.uint32), y.view(np.uint32))


@pytest.mark.parametrize("isa", isas())
@pytest.mark.parametrize("fmt", ["INT8", "BF16", "INT4"])
def test_id_minus_one_skips_the_slot(fmt, isa):
    layer = make_layer(fmt, isa)
    x, ids, w = routing(9)
    skipped = ids.copy()
    skipped[::2, 1] = -1
    skipped[3, :] = -1          # a token with every slot elsewhere
    # the same sum with weight 0 on a real expert in those slots: x + 0 is exact, so the bits agree
    zeroed_ids, zeroed_w = np.where(skipped < 0, 0, skipped), np.where(skipped < 0, 0, w).astype(np.float32)
    # the zeroed slots add rows to expert 0: pin its kernel, or they could move it across
    # AMX_MIN_ROWS onto a kernel that sums bf16 products in another order
    layer._engine.big_min_rows = 1
    y = layer.forward(x, skipped, w)
    assert np.array_equal(y, layer.forward(x, zeroed_ids, zeroed_w))
    assert not y[3].any()
    slots = layer.forward_slots(x, skipped, w)
    assert not slots[skipped < 0].any()
    assert np.array_equal(ordered_slot_sum(slots).view(np.uint32), y.view(np.uint32))


def test_every_slot_skipped_gives_zeros_and_other_negative_ids_are_errors():
    layer = make_layer("INT8", None)
    x, ids, w = routing(4)
    out = np.full((4, H), 7, np.float32)
    assert layer.forward(x, np.full_like(ids, -1), w, out=out) is out and not out.any()
    assert not layer.forward_slots(x, np.full_like(ids, -1), w).any()
    ids[1, 2] = -2
    with pytest.raises(ValueError, match="-2"):
        layer.forward(x, ids, w)
    ids[1, 2] = E
    with pytest.raises(ValueError, match=str(E)):
        layer.forward_slots(x, ids, w)


def test_forward_slots_checks_out():
    layer = make_layer("BF16", None)
    x, ids, w = routing(3)
    good = np.empty((3, K_TOP, H), np.float32)
    assert layer.forward_slots(x, ids, w, out=good) is good
    assert np.array_equal(good, layer.forward_slots(x, ids, w))
    for bad in (np.empty((3, H), np.float32), np.empty((3, K_TOP, H), np.float64),
                np.empty((3, K_TOP, H + 1), np.float32)):
        with pytest.raises(ValueError, match="out"):
            layer.forward_slots(x, ids, w, out=bad)
