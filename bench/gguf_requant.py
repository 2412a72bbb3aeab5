"""What quantizing a GGUF model's values again costs, per ggml type and ktcy format.

    python bench/gguf_requant.py          (needs the gguf package: the test extra)

A 768 x 2048 weight (normal, std 0.02, one value in a thousand 8x larger, as outliers) is
quantized by the gguf package in each type it can write; "own" is that type's relative error
(Frobenius norm) against the weight, and each ktcy column the error ktcy's packing adds against
the GGUF values it is given (what `load_experts(gguf, L, method=...)` packs).  0 means kept.
Values are quantized again here even where `method=None` keeps the codes (Q8_0 and Q5_0 as
INT8_GROUP, Q5_1 as INT8_MIN, Q4_0 as INT4, Q4_1 as INT4_MIN: 0 added)."""
import numpy as np
from gguf import GGMLQuantizationType, quants

from ktcy import kernels

TARGETS = (("INT4", 32), ("INT4_ZP", 32), ("INT4_MIN", 32), ("INT8", None), ("INT8_GROUP", 16), ("INT8_GROUP", 32),
           ("INT8_MIN", 32), ("BF16", None))


def relative(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    rng = np.random.default_rng(0)
    w = (rng.standard_normal((768, 2048)) * 0.02).astype(np.float32)
    w[rng.random(w.shape) < 1e-3] *= 8
    print(f"{'type':8}{'own':>8}" + "".join(f"{f'{fmt} g{g}' if g else fmt:>16}" for fmt, g in TARGETS))
    for name in ("Q8_0", "Q5_1", "Q5_0", "Q4_1", "Q4_0", "MXFP4"):
        t = GGMLQuantizationType[name]
        values = np.asarray(quants.dequantize(quants.quantize(w, t), t), np.float32).reshape(w.shape)
        added = [relative(kernels.pack(values, fmt, group_size=g).dequantize(np.float32), values)
                 for fmt, g in TARGETS]
        print(f"{name:8}{relative(values, w):8.4f}" + "".join(f"{a:16.4f}" for a in added))


if __name__ == "__main__":
    main()
