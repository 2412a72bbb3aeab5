"""ktcy.hf keeps expert weights once: packed by ktcy, never also as torch tensors."""
import json
import subprocess
import sys
import textwrap

import pytest

import hf_checkpoints as ckpts

pytest.importorskip("torch")  # CI installs the hf extra: this never skips there

H, I, E, LAYERS = 256, 512, 32, 2
EXPERT_BYTES = LAYERS * E * 3 * H * I * 2  # BF16 as stored: 50 MiB, packed BF16 is the same size

MEASURE = textwrap.dedent("""\
    import json, sys
    import torch, transformers, ktcy, ktcy.hf

    def anon():
        with open("/proc/self/status") as f:
            return next(int(l.split()[1]) * 1024 for l in f if l.startswith("RssAnon:"))

    # the first load imports transformers' modeling code (~100 MB): a tiny model of the same
    # architecture takes that before the baseline
    ktcy.hf.from_pretrained(sys.argv[1], dtype=torch.float32)
    before = anon()
    model = ktcy.hf.from_pretrained(sys.argv[2], dtype=torch.float32)
    with torch.no_grad():
        model(torch.tensor([[3, 4, 5, 6]]))
    print(json.dumps({"grew": anon() - before,
                      "packed": sum(m.moe.nbytes for m in model.ktcy_experts().values()),
                      "torch": sum(p.numel() * p.element_size() for p in model.parameters())}))
    """)


def test_loading_holds_expert_weights_once(tmp_path):
    """RssAnon growth over the load must stay below 1.5x the experts' bytes: the packed experts
    (1x, anonymous memory) plus the small non-expert weights and allocator slack.  Materialising
    the experts in torch as well (float32 here: 2x more) would take it past 3x, and even a BF16
    copy past 2x.  The checkpoint's own pages are a file mapping (RssFile), not counted."""
    folder = ckpts.build("qwen3_moe", tmp_path / "m", hidden_size=H, num_experts=E, moe_intermediate_size=I,
                         num_hidden_layers=LAYERS)
    warm = ckpts.build("qwen3_moe", tmp_path / "tiny")
    r = subprocess.run([sys.executable, "-c", MEASURE, warm, folder], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.loads(r.stdout.strip().splitlines()[-1])
    assert m["packed"] == EXPERT_BYTES
    assert m["torch"] < EXPERT_BYTES / 20  # what torch holds is the small non-expert part
    assert m["grew"] < 1.5 * EXPERT_BYTES, m
    assert m["grew"] > 0.8 * EXPERT_BYTES, m  # the packed experts are there: the measure sees them
