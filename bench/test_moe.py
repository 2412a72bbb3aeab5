"""MoE forward per format x ISA x T on the shapes of `ktcy bench` (Qwen3-30B-A3B by default;
KTCY_BENCH_SHAPE=deepseek-v3|mixtral|H,I,E,k picks another)."""
import os

import numpy as np
import pytest

import ktcy
from support import isa_list, record, routing_pool
from ktcy.bench import parse_shape

H, I, E, K, NOTE = parse_shape(os.environ.get("KTCY_BENCH_SHAPE", "qwen3-30b"))
FORMATS = ["BF16", "INT8", "INT4", "FP8_PERCHANNEL"]


@pytest.fixture(scope="module")
def weights(rng):
    return tuple((rng.standard_normal(shape, np.float32) * 0.02) for shape in ((E, I, H), (E, I, H), (E, H, I)))


@pytest.fixture(scope="module")
def layers(weights):
    cache = {}

    def get(fmt, isa):
        if (fmt, isa) not in cache:
            cache.clear()  # one packed layer in memory at a time
            cache[fmt, isa] = ktcy.MoE.from_weights(ktcy.MoeConfig(E, K, H, I, ktcy.QuantConfig(fmt), isa=isa),
                                                    *weights)
        return cache[fmt, isa]
    return get


@pytest.mark.parametrize("tokens", [1, 32, 512])
@pytest.mark.parametrize("isa", isa_list())
@pytest.mark.parametrize("fmt", FORMATS)
def test_moe_forward(benchmark, roof, layers, rng, fmt, isa, tokens):
    layer = layers(fmt, isa)
    x = rng.standard_normal((tokens, H), np.float32)
    routes = routing_pool(rng, tokens, E, K, layer.nbytes / E)
    w = rng.random((tokens, K), np.float32)
    state = {"i": 0}

    def step():  # cycles a pool too long for the LLC to keep any routing's experts between uses
        state["i"] += 1
        return layer.forward(x, routes[state["i"] % len(routes)], w)

    benchmark.group = f"moe {NOTE} {fmt} T={tokens}"
    benchmark(step)
    active = np.mean([len(np.unique(r)) for r in routes])
    record(benchmark, roof, fmt, isa, active * layer.nbytes / E, 2 * 3 * H * I * tokens * K)
    benchmark.extra_info["kernel"] = layer.kernel
