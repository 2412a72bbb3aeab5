"""Helpers of the 2-rank tests: the layers and routings both the ranks and the test build (from
seeds), and a runner that starts the ranks of tests/dist_worker.py on 127.0.0.1 and collects
what each saved, every rank bounded in time."""
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_worker.py")

# a small layer: 6 experts over 2 ranks is 3 each, fewer than top-4 (the padding path)
E, K, H, I = 6, 4, 256, 128
FORMATS = ("INT8", "INT4", "BF16", "FP8")
TOKENS = (1, 7, 512)


def layer_weights(seed=0):
    rng = np.random.default_rng(seed)
    gate, up = ((rng.standard_normal((E, I, H)) * 0.05).astype(np.float32) for _ in range(2))
    down = (rng.standard_normal((E, H, I)) * 0.05).astype(np.float32)
    return gate, up, down


def routing(T, seed, num_experts=E, k=K, experts=None, hidden=H):
    """x [T, hidden], distinct ids per token drawn from `experts` (default all), softmax-like weights."""
    rng = np.random.default_rng(seed)
    pool = np.arange(num_experts) if experts is None else np.asarray(experts)
    ids = np.stack([rng.choice(pool, size=k, replace=len(pool) < k) for _ in range(T)]).astype(np.int64)
    w = rng.random((T, k)).astype(np.float32)
    w /= w.sum(axis=1, keepdims=True)
    x = rng.standard_normal((T, hidden)).astype(np.float32)
    return x, ids, w


def skip_routing(T, seed):
    """As routing, with about a quarter of the slots -1 (skipped)."""
    x, ids, w = routing(T, seed)
    ids[np.random.default_rng(seed + 1).random(ids.shape) < 0.25] = -1
    return x, ids, w


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(scenario, folder, world=2, limit=90.0, extra=(), wait_for=None):
    """Runs `world` ranks of the worker for `scenario`; returns [(returncode, output text,
    {saved arrays} , {saved json})] by rank.  Once the ranks in wait_for (default: all) have
    exited, or `limit` seconds have passed, the others are killed (their returncode is None)."""
    port = free_port()
    env = dict(os.environ, KTCY_NUM_THREADS="1", OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(port), WORLD_SIZE=str(world))
    procs = []
    for r in range(world):
        log = open(os.path.join(folder, f"rank{r}.log"), "w")
        procs.append((subprocess.Popen([sys.executable, WORKER, scenario, str(folder), *map(str, extra)],
                                       env=dict(env, RANK=str(r), LOCAL_RANK=str(r)), stdout=log,
                                       stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + limit
    waited = range(world) if wait_for is None else wait_for
    while time.monotonic() < deadline and any(procs[r][0].poll() is None for r in waited):
        time.sleep(0.05)
    codes = []
    for p, log in procs:
        code = p.poll()
        if code is None:
            p.kill()
            p.wait()
        codes.append(code)
        log.close()
    out = []
    for r, code in enumerate(codes):
        with open(os.path.join(folder, f"rank{r}.log")) as f:
            text = f.read()
        arrays = os.path.join(folder, f"rank{r}.npz")
        report = os.path.join(folder, f"rank{r}.json")
        out.append((code, text, dict(np.load(arrays)) if os.path.exists(arrays) else {},
                    json.load(open(report)) if os.path.exists(report) else {}))
    return out


# the checkpoint of test_model.build("deepseek"): 8 experts, top-2, H 128, grouped router, shared experts
CHECKPOINT = dict(num_experts=8, k=2, hidden=128)
