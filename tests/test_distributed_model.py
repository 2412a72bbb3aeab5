"""Whole models expert-parallel: MoEModel(group=), ktcy.hf.from_pretrained(group=) and `ktcy
generate` under `ktcy launch --nproc 2` (2 gloo ranks on 127.0.0.1), against one process."""
import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")  # CI installs the hf extra: this never skips there

import hf_checkpoints as hf_ckpts  # noqa: E402
from test_gguf_model import ROUTING_CASES, write_block_model  # noqa: E402
from ktcy.convert import convert  # noqa: E402
from test_model import build  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def launch(argv, timeout=240):
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-m", "ktcy", "launch", "--nproc", "2", "--"] + argv,
                          capture_output=True, text=True, env=env, timeout=timeout)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("distmodel")
    moe_ckpt = root / "moe"
    build(str(moe_ckpt), "deepseek")   # grouped router, shared experts
    hf = hf_ckpts.build("qwen3_moe", root / "hf", seed=hf_ckpts.GREEDY_SEEDS["qwen3_moe"])
    gguf_model = str(root / "model.gguf")  # a DeepSeek-V3-like GGUF: grouped sigmoid router, shared experts,
    # down in another type than gate and up (as Q4_K_M): kept as stored without a backend
    write_block_model(gguf_model, "deepseek2", ROUTING_CASES["deepseek2 sigmoid, groups, renormalised, scaled"][1],
                      bias=True, shared=32, layers=(1, 2), blocks=3,
                      expert_type={"gate": "Q4_0", "up": "Q4_0", "down": "Q8_0"})
    convert(gguf_model, str(root / "gguf_packed"), progress=None)
    return root, str(moe_ckpt), str(hf), gguf_model


def test_models_expert_parallel_equal_one_process(folders):
    root, moe_ckpt, hf, gguf_model = folders
    run = launch([sys.executable, os.path.join(HERE, "dist_model_rank.py"), moe_ckpt, hf, str(root), gguf_model,
                  str(root / "gguf_packed")])
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [np.load(root / f"rank{r}.npz") for r in (0, 1)]
    keys = [k[:-len(":parallel")] for k in ranks[0].files if k.endswith(":parallel")]
    assert len(keys) >= 5 and any(k.startswith("gguf:") for k in keys)   # INT8 and BF16 blocks of both, the hf model
    assert any(k.startswith("gguf:None:") for k in keys)   # the GGUF as stored: gate and up INT4, down INT8_GROUP
    assert any(k.startswith("gguf:converted:None:") for k in keys)   # and from its converted folder
    for res in ranks:
        for key in keys:
            # the slots' all_reduce adds exact zeros, and the k slots are summed in forward's order
            assert np.array_equal(res[key + ":parallel"], res[key + ":single"]), key
            if key.startswith("gguf:converted:"):  # the folder's layers are the GGUF's, byte for byte
                assert np.array_equal(res[key + ":single"], res[key.replace(":converted", "") + ":single"]), key
    local = next(k for k in ranks[0].files if k.endswith(":local"))
    owned = [set(ranks[r][local].tolist()) for r in (0, 1)]
    assert owned[0] and owned[1] and not owned[0] & owned[1]   # each rank holds its own experts


def test_generate_under_ktcy_launch_gives_the_single_process_tokens(folders):
    _, _, hf, _ = folders
    argv = ["generate", "--model", hf, "--backend", "INT8", "--input-ids", "3,4,5,6", "--max-new-tokens", "5",
            "--threads", "1"]
    single = subprocess.run([sys.executable, "-m", "ktcy"] + argv, capture_output=True, text=True, timeout=240,
                            env=dict(os.environ, OMP_WAIT_POLICY="PASSIVE"))
    assert single.returncode == 0, single.stderr[-2000:]
    ranked = launch([sys.executable, "-m", "ktcy"] + argv)
    assert ranked.returncode == 0, ranked.stderr[-3000:]
    tokens = single.stdout.splitlines()[0].split()
    assert len(tokens) == 5
    assert ranked.stdout.splitlines()[0].split() == tokens   # rank 0 prints, rank 1 stays quiet
    assert ranked.stdout.count("decode:") == 1
