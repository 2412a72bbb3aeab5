"""Two builds of ktcy side by side: one MoE layer per format in each of two Python environments,
timed in interleaved rounds so that both see the same machine load (this host's neighbours move
its read bandwidth between runs by up to 1.7x; a before/after pair measured minutes apart is
noise).  Not part of CI.

    python bench/ab_moe.py BEFORE_PYTHON AFTER_PYTHON --formats FP8_PERCHANNEL,MXFP4 --tokens 1,32

Each environment has its own ktcy installed (e.g. a venv per commit).  The layer is the Qwen3
shape with 64 experts (about 0.3-1.2 GB per format, larger than the caches), fresh random
routing every call; prints the median per-call time of each and after/before.  KTCY_ISA is
passed through to both; --before-tiles/--after-tiles give each its own KTCY_TILES (tile choices,
registry.h), so one build measures a choice its CPU does not make:

    python bench/ab_moe.py $(which python) $(which python) --after-tiles plain_fetch_l2=1"""
import argparse
import json
import os
import subprocess
import sys

H, I, EXPERTS, TOP_K = 2048, 768, 64, 8


def worker(formats):
    import time
    try:
        import numpy as np
        import ktcy
    except ImportError as e:
        print(f"error cannot import ktcy ({e})", flush=True)
        return
    problem = getattr(ktcy._native, "TILES_PROBLEM", None)
    if problem:  # a side that silently kept its CPU's choices would compare nothing
        print(f"error {problem}", flush=True)
        return
    rng = np.random.default_rng(0)
    gate = rng.standard_normal((EXPERTS, I, H), np.float32) * 0.02
    up = rng.standard_normal((EXPERTS, I, H), np.float32) * 0.02
    down = rng.standard_normal((EXPERTS, H, I), np.float32) * 0.02
    try:
        layers = {f: ktcy.MoE.from_weights(ktcy.MoeConfig(EXPERTS, TOP_K, H, I, ktcy.QuantConfig(f)), gate, up, down)
                  for f in formats}
    except ValueError as e:  # an unknown format: one line for the driver to show
        print(f"error {e}", flush=True)
        return
    del gate, up, down
    print("ready", flush=True)
    for line in sys.stdin:
        fmt, tokens, reps = line.split()
        tokens, reps = int(tokens), int(reps)
        x = rng.standard_normal((tokens, H), np.float32)
        w = rng.random((tokens, TOP_K), np.float32)
        routing = lambda: np.argsort(rng.random((tokens, EXPERTS)), axis=1)[:, :TOP_K]
        layers[fmt].forward(x, routing(), w)  # warm: arena, pages
        times = []
        for _ in range(reps):
            ids = routing()
            t = time.perf_counter()
            layers[fmt].forward(x, ids, w)
            times.append(time.perf_counter() - t)
        print(json.dumps(times), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("before")
    ap.add_argument("after")
    ap.add_argument("--formats", default="BF16,INT8,INT4,FP8_PERCHANNEL,MXFP4")
    ap.add_argument("--tokens", default="1,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--before-tiles", default=None, metavar="SPEC",
                    help="KTCY_TILES for the before environment (e.g. plain_fetch_l2=0)")
    ap.add_argument("--after-tiles", default=None, metavar="SPEC",
                    help="KTCY_TILES for the after environment: one Python twice measures a tile choice")
    args = ap.parse_args()
    formats = args.formats.split(",")
    try:
        tokens = [int(t) for t in args.tokens.split(",")]
    except ValueError:
        ap.error(f"--tokens {args.tokens!r}: comma-separated positive integers")
    if min(tokens) < 1 or args.rounds < 1:
        ap.error("--tokens and --rounds must be positive")
    procs = {}
    for name, py, tiles in (("before", args.before, args.before_tiles), ("after", args.after, args.after_tiles)):
        env = {k: v for k, v in os.environ.items() if k != "KTCY_TILES"}
        if tiles is not None:
            env["KTCY_TILES"] = tiles
        try:
            procs[name] = subprocess.Popen([py, __file__, "--worker", args.formats], stdin=subprocess.PIPE,
                                           stdout=subprocess.PIPE, text=True, cwd="/", env=env)
        except OSError as e:
            ap.error(f"{name} interpreter {py!r}: {e.strerror}")
    for name, p in procs.items():
        line = p.stdout.readline().strip()
        if line != "ready":
            for other in procs.values():
                other.kill()
            sys.exit(f"ab_moe: the {name} environment did not start: "
                     f"{line[len('error '):] if line.startswith('error ') else 'is ktcy installed there?'}")
    times = {}
    for rnd in range(args.rounds):
        order = list(procs.items()) if rnd % 2 == 0 else list(reversed(procs.items()))
        for fmt in formats:
            for t in tokens:
                for name, p in order:
                    p.stdin.write(f"{fmt} {t} {20 if t == 1 else 3}\n")
                    p.stdin.flush()
                    times.setdefault((fmt, t, name), []).extend(json.loads(p.stdout.readline()))
    for p in procs.values():
        p.stdin.close()
        p.wait()
    import numpy as np
    print(f"{'format':16s} {'T':>4s} {'before ms':>10s} {'after ms':>10s} {'after/before':>12s}")
    for fmt in formats:
        for t in tokens:
            b, a = (np.median(times[(fmt, t, n)]) * 1e3 for n in ("before", "after"))
            print(f"{fmt:16s} {t:4d} {b:10.2f} {a:10.2f} {a / b:12.3f}")


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        worker(sys.argv[2].split(","))
    else:
        main()
