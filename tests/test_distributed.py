"""Expert parallelism over 2 gloo ranks on 127.0.0.1 (ranks spawned by the test, every run
bounded in time): outputs against single-process MoE.forward, converted folders and checkpoint
blocks, inputs that differ across ranks, a rank that dies or stalls."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

pytest.importorskip("torch")

import ktcy  # noqa: E402
from ktcy.convert import convert  # noqa: E402

from test_model import build  # noqa: E402
from dist_helpers import CHECKPOINT, E, FORMATS, H, I, K, TOKENS, layer_weights, routing, run_ranks, skip_routing  # noqa: E402


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype == np.float32 and np.array_equal(a.view(np.uint32), b.view(np.uint32))


@pytest.fixture(scope="module")
def correctness(tmp_path_factory):
    """One 2-rank run holding every check that needs healthy ranks (each spawn costs seconds)."""
    folder = tmp_path_factory.mktemp("dist")
    ckpt, converted = folder / "ckpt", folder / "converted"
    build(str(ckpt), "deepseek")
    convert(str(ckpt), str(converted), method="INT8")
    ranks = run_ranks("correctness", folder, extra=(ckpt, converted))
    for r, (code, text, _, _) in enumerate(ranks):
        assert code == 0, f"rank {r} exited with {code}:\n{text[-3000:]}"
    return ranks, ckpt, converted


def single(fmt):
    return ktcy.MoE.from_weights(ktcy.MoeConfig(E, K, H, I, ktcy.QuantConfig(fmt)), *layer_weights())


@pytest.mark.parametrize("fmt", FORMATS)
def test_bit_identical_to_single_process(correctness, fmt):
    ranks = correctness[0]
    moe = single(fmt)
    cases = {f"T{T}": routing(T, seed=T) for T in TOKENS}
    cases["skips"] = skip_routing(7, seed=3)
    cases["rank0_only"] = routing(5, seed=4, experts=[0, 1, 2])
    assert np.any(cases["skips"][1] == -1)
    for name, args in cases.items():
        want = moe.forward(*args)
        for r, (_, _, arrays, _) in enumerate(ranks):
            assert same_bits(arrays[f"{fmt}/{name}"], want), f"{fmt} {name}: rank {r} differs from MoE.forward"


@pytest.mark.parametrize("fmt", FORMATS)
def test_replicated_experts(correctness, fmt):
    """Integer formats stay bit-identical when a replicated expert's rows are split between
    ranks; BF16/FP8 kernels may take another path for fewer rows (within 1e-6 relative)."""
    ranks = correctness[0]
    moe = single(fmt)
    for T in (1, 7, 512):
        want = moe.forward(*routing(T, seed=T))
        for _, _, arrays, _ in ranks:
            got = arrays[f"{fmt}/replicated_T{T}"]
            if fmt in ("INT8", "INT4"):
                assert same_bits(got, want), f"{fmt} replicated T={T}"
            else:
                assert np.max(np.abs(got - want)) <= 1e-6 * np.max(np.abs(want)), f"{fmt} replicated T={T}"
        assert same_bits(ranks[0][2][f"{fmt}/replicated_T{T}"], ranks[1][2][f"{fmt}/replicated_T{T}"])


@pytest.mark.parametrize("fmt", FORMATS)
def test_partial_sum_reduce_is_close(correctness, fmt):
    ranks = correctness[0]
    want = single(fmt).forward(*routing(512, seed=512))
    for _, _, arrays, _ in ranks:
        got = arrays[f"{fmt}/sum_T512"]
        assert np.max(np.abs(got - want)) <= 1e-6 * np.max(np.abs(want))
    assert same_bits(ranks[0][2][f"{fmt}/sum_T512"], ranks[1][2][f"{fmt}/sum_T512"])


def test_each_rank_packs_only_its_experts(correctness):
    ranks = correctness[0]
    reports = [rep for _, _, _, rep in ranks]
    assert [rep["INT8/local"] for rep in reports] == [[0, 1, 2], [3, 4, 5]]
    assert [rep["INT8/replicated_local"] for rep in reports] == [[0, 1, 2, 4], [0, 1, 3, 5]]
    assert reports[0]["INT8/nbytes"] + reports[1]["INT8/nbytes"] == single("INT8").nbytes
    assert [rep["converted_local"] for rep in reports] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert reports[0]["converted_isa"] == ktcy.load_experts(str(correctness[2]), 1).isa
    assert [rep["block_describe"]["format"] for rep in reports] == ["INT8", "INT8"]
    assert [rep["from_checkpoint_local"] for rep in reports] == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_torch_tensors_in_and_out(correctness):
    ranks = correctness[0]
    x, ids, w = routing(7, seed=7)
    moe = single("INT8")
    import ml_dtypes
    want_bf16 = moe.forward(x.astype(ml_dtypes.bfloat16), ids, w).astype(ml_dtypes.bfloat16).astype(np.float32)
    for _, _, arrays, report in ranks:
        assert report["torch_dtype"] == "torch.bfloat16"
        assert same_bits(arrays["torch_bf16"], want_bf16)
        assert same_bits(arrays["torch_out"], moe.forward(x, ids, w))


def test_ranks_that_disagree_all_raise(correctness):
    ranks = correctness[0]
    msgs = [rep["messages"] for _, _, _, rep in ranks]
    for m in msgs:
        assert "rank 1 differs from rank 0 in T" in m["T differs"]
        assert "topk_ids" in m["ids differ"] and "ValueError" in m["ids differ"]
        assert "in x" in m["x differs"]
        assert "different expert placements" in m["placements differ"]
    assert "x must be [T, 256]" in msgs[1]["rank 1 rejects"]
    assert "rank(s) [1] rejected their inputs" in msgs[0]["rank 1 rejects"]
    assert msgs[1]["local failure"] == "RuntimeError: experts failed on purpose"
    assert "DistributedError" in msgs[0]["local failure"] and "1 peer rank(s) failed" in msgs[0]["local failure"]
    x, ids, w = routing(7, seed=7)
    for _, _, arrays, _ in ranks:  # the group still works after every refusal
        assert same_bits(arrays["after_errors"], single("INT8").forward(x, ids, w))


def test_converted_folder_and_checkpoint_block(correctness):
    ranks, ckpt, converted = correctness
    moe = ktcy.load_experts(str(converted), 1)
    x, ids, w = routing(7, seed=11, **CHECKPOINT)
    want = moe.forward(x, ids, w)
    block = ktcy.MoEModel.from_pretrained(str(ckpt), backend="INT8", layers=[1]).blocks["model.layers.1.mlp.experts"]
    assert block.shared is not None  # the block's output adds its shared experts
    h = np.random.default_rng(12).standard_normal((9, CHECKPOINT["hidden"])).astype(np.float32)
    for _, _, arrays, _ in ranks:
        assert same_bits(arrays["converted"], want)
        assert same_bits(arrays["from_checkpoint"], want)  # packed from the checkpoint, local experts only
        assert same_bits(arrays["block"], block.forward(h))


@pytest.mark.parametrize("scenario", ["killed", "stalled"])
def test_a_failed_rank_makes_the_other_raise_within_the_timeout(tmp_path, scenario):
    ranks = run_ranks(scenario, tmp_path, limit=40, wait_for=(0,))
    code, text, _, report = ranks[0]
    assert code == 0, text[-3000:]
    assert report["error"].startswith("DistributedError: rank 0 of 2: "), report
    assert "failed: a peer rank exited or did not answer within the process group's timeout" in report["error"]
    assert report["seconds"] < 4.0 + 3.0  # the group's timeout (dist_worker.GROUP_TIMEOUT) plus slack
    assert ranks[1][0] != 0  # killed: by its own SIGKILL, or by the runner once rank 0 was done


def test_placement_api_is_validated():
    from ktcy.distributed import Placement
    p = Placement.balanced([10, 1, 1, 8], 2)
    assert p.local_experts(0) == (0, 2) and p.local_experts(1) == (1, 3)  # loads 11 and 9, two experts each
    assert Placement.from_trace([[0, 3], [0, 1], [3, -1]], 4, 2) == Placement.balanced([2, 1, 0, 2], 2)
    for bad in ([(0,), ()], [(0,), (2,)], "ab"):
        with pytest.raises((ValueError, TypeError)):
            Placement(bad, 2)
    with pytest.raises(ValueError, match="frequencies"):
        Placement.balanced([1.0, float("nan")], 2)
    with pytest.raises(ValueError, match="outside"):
        Placement.from_trace([[0, 4]], 4, 2)
    ids = np.array([[0, 3, -1], [1, 2, 0]])
    routed = [Placement([(0, 1), (0,), (1,), (0, 1)], 2).route(ids, r) for r in range(2)]
    # every routed slot is computed by exactly one rank
    assert np.array_equal((routed[0] >= 0).astype(int) + (routed[1] >= 0), (ids >= 0).astype(int))


def _every_slot_has_one_rank(data, max_experts):
    from ktcy.distributed import Placement
    W = data.draw(st.integers(1, 4))
    E = data.draw(st.integers(1, max_experts))
    owners = [data.draw(st.sets(st.integers(0, W - 1), min_size=1)) for _ in range(E)]
    T, k = data.draw(st.integers(0, 9)), data.draw(st.integers(1, 4))
    ids = np.array(data.draw(st.lists(st.lists(st.integers(-1, E - 1), min_size=k, max_size=k), min_size=T, max_size=T)),
                   np.int64).reshape(T, k)
    p = Placement(owners, W)
    computed = np.zeros(ids.shape, np.int64)
    for r in range(W):
        local = p.route(ids, r)
        held = p.local_experts(r)
        mine = local >= 0
        assert all(held[i] == e for i, e in zip(local[mine], ids[mine]))  # the local index names the right expert
        computed += mine
    assert np.array_equal(computed, (ids >= 0).astype(np.int64))


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_route_gives_every_slot_to_exactly_one_owner(data):
    _every_slot_has_one_rank(data, 8)


@pytest.mark.fuzz
@settings(max_examples=3000, deadline=None)
@given(st.data())
def test_route_gives_every_slot_to_exactly_one_owner_fuzz(data):
    _every_slot_has_one_rank(data, 64)
