"""`ktcy doctor`: what a user needs to judge this machine for MoE inference (versions, memory,
NUMA, huge pages, frequency governor, SMT, AMX permission, the kernel per format and why not a
faster one, a verdict per KTransformers backend).  Every value is read, never assumed: a field
that this system does not expose is None, with the reason in "notes"."""
import glob
import os
import platform
import re
import shutil
import subprocess
import sysconfig

import numpy as np

from ktcy import _native, report
from ktcy.distributed.numa import cpulist_text, parse_cpulist
from ktcy.errors import UnsupportedISAError
from ktcy.formats import FORMATS
from ktcy.threads import get_num_threads
from ktcy.version import __version__

_LADDER = ("amx", "avx512", "avx2", "ref")
_ENV = ("KTCY_ISA", "KTCY_TILES", "KTCY_NUM_THREADS", "CPUINFER_ENABLE_AMX", "OMP_NUM_THREADS", "OMP_PROC_BIND")


def _read(path):
    try:
        with open(path, errors="replace") as f:
            return f.read().strip()
    except OSError:
        return None


def _meminfo(path="/proc/meminfo"):
    """{key: bytes} (kB entries scaled; HugePages_* counts kept as counts)."""
    out = {}
    text = _read(path) or ""
    for line in text.splitlines():
        m = re.match(r"(?:Node \d+ )?(\w+(?:\(\w+\))?):\s+(\d+)(\s*kB)?", line)
        if m:
            out[m.group(1)] = int(m.group(2)) * (1024 if m.group(3) else 1)
    return out


def _selected(text):
    """The bracketed choice of a sysfs switch such as "always [madvise] never"."""
    if text is None:
        return None
    m = re.search(r"\[(\w+)\]", text)
    return m.group(1) if m else text


def versions():
    so = _native.__file__
    return {
        "ktcy": __version__, "numpy": np.__version__, "python": platform.python_version(),
        "python_implementation": platform.python_implementation(), "platform": platform.platform(),
        "extension": so, "built_with": _build_compiler(so), "cc": _cc(),
    }


def _build_compiler(path):
    """The compiler that built the extension, from its .comment section (e.g. "GCC: (Debian
    12.2.0-14) 12.2.0"), or None."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return None
    found = re.findall(rb"(GCC: \([^)\x00]*\) [\w.\-]+|clang version [\w.\-]+)", data)
    return found[-1].decode("ascii", "replace") if found else None


def _cc():
    """sysconfig's CC (what pip builds with) and the first line of its --version."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()
    name = os.environ.get("CC", "").split() or cc
    exe = shutil.which(name[0])
    version = None
    if exe:
        try:
            r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10)
            version = (r.stdout or r.stderr).splitlines()[0] if (r.stdout or r.stderr) else None
        except (OSError, subprocess.SubprocessError):
            version = None
    return {"command": " ".join(name), "path": exe, "version": version}


def memory():
    info = _meminfo()
    return {"total_bytes": info.get("MemTotal"), "available_bytes": info.get("MemAvailable"),
            "free_bytes": info.get("MemFree")}


def numa():
    nodes = []
    for path in sorted(glob.glob("/sys/devices/system/node/node[0-9]*"), key=lambda p: int(p.rsplit("node", 1)[1])):
        info = _meminfo(os.path.join(path, "meminfo"))
        nodes.append({"node": int(path.rsplit("node", 1)[1]), "cpus": parse_cpulist(_read(os.path.join(path, "cpulist")), path),
                      "memory_total_bytes": info.get("MemTotal"), "memory_free_bytes": info.get("MemFree")})
    return nodes


def huge_pages():
    info = _meminfo()
    base = "/sys/kernel/mm/transparent_hugepage/"
    return {"hugepages_total": info.get("HugePages_Total"), "hugepages_free": info.get("HugePages_Free"),
            "hugepage_size_bytes": info.get("Hugepagesize"),
            "thp_enabled": _selected(_read(base + "enabled")), "thp_defrag": _selected(_read(base + "defrag"))}


def cpu():
    governors = {}
    for path in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/cpufreq/scaling_governor"):
        governors.setdefault(_read(path), []).append(int(re.search(r"cpu(\d+)/cpufreq", path).group(1)))
    siblings = {_read(p) for p in glob.glob("/sys/devices/system/cpu/cpu[0-9]*/topology/thread_siblings_list")}
    threads_per_core = max((len(parse_cpulist(s, "thread_siblings_list")) for s in siblings if s), default=None)
    return {
        "model": _native.cpu_model_name() or None, "logical_cpus": os.cpu_count(), "usable_cpus": _native.usable_cpus(),
        "governor": {g: sorted(c) for g, c in governors.items()} or None,
        "smt_active": {"1": True, "0": False}.get(_read("/sys/devices/system/cpu/smt/active")),
        "smt_control": _read("/sys/devices/system/cpu/smt/control"), "threads_per_core": threads_per_core,
        "ktcy_threads": get_num_threads(),
    }


def amx():
    f = _native.cpu_features()
    requested = bool(f["amx_tile"] and f["os_amx"])  # the probe asks only when CPU and OS have AMX
    return {"cpu_has_amx": bool(f["amx_tile"] and (f["amx_int8"] or f["amx_bf16"])), "os_enables_amx": f["os_amx"],
            "permission_requested": requested, "permission_granted": f["amx_permitted"],
            "enabled_by_policy": _native._policy["amx_enabled"]}


def _why_not(fmt, isa):
    try:
        _native.resolve(fmt, isa)
    except (UnsupportedISAError, ValueError) as e:
        return str(e).split(". Available")[0]
    return None


def kernels():
    """Per format: the kernel the policy picks and, for each faster ISA or variant, why not."""
    all_variants = _native.variants()
    out = {}
    for fmt in FORMATS:
        row = {}
        try:
            isa, variant = _native.resolve(fmt)
            row.update(isa=isa, variant=variant, reason=_native._policy["reasons"].get(fmt, ""))
        except (UnsupportedISAError, ValueError) as e:  # ValueError: an invalid KTCY_ISA
            row.update(isa=None, variant=None, reason=str(e))
        faster = []
        for better in _LADDER[:_LADDER.index(isa)] if row["isa"] in _LADDER else ():
            why = _why_not(fmt, better)
            if better == "amx" and why is None and not _native._policy["amx_enabled"]:
                why = "AMX is disabled by CPUINFER_ENABLE_AMX=OFF"
            if why is None and _native._policy["forced"]:
                why = f"KTCY_ISA={_native._policy['forced']} forces {isa}"
            if why:
                faster.append({"isa": better, "why_not": why})
        for v in all_variants:  # a faster variant of the same ISA (listed first in the registry)
            if v["isa"] == row["isa"] and fmt in v["formats"] and v["name"] != row["variant"]:
                if v["runnable"]:
                    continue
                faster.append({"variant": v["name"], "why_not": "this CPU lacks " + ", ".join(v["needs"])})
            if v["name"] == row["variant"]:
                break
        row["faster_options"] = faster
        out[fmt] = row
    return out


def environment_problems():
    """Messages about environment variables ktcy could not honour (an invalid KTCY_ISA, KTCY_TILES
    or KTCY_NUM_THREADS does not stop `import ktcy`; it is reported here)."""
    from ktcy import threads
    problems = list(getattr(threads, "ENV_PROBLEMS", []))
    if _native.AMX_SWITCH_PROBLEM:
        problems.append(_native.AMX_SWITCH_PROBLEM)
    if _native.TILES_PROBLEM:
        problems.append(_native.TILES_PROBLEM)
    error = _native._policy.get("error")
    if error:
        problems.append(str(error))
    return problems


def advice(data):
    """Plain sentences about settings that cost speed."""
    notes = []
    hp = data["huge_pages"]
    if hp["thp_enabled"] == "never":
        notes.append("transparent huge pages are off: large weight arrays pay more TLB misses "
                     "(echo madvise > /sys/kernel/mm/transparent_hugepage/enabled)")
    gov = data["cpu"]["governor"]
    if gov is None:
        notes.append("CPU frequency governor not exposed (no cpufreq driver, common in VMs)")
    elif any(g not in ("performance",) for g in gov):
        notes.append(f"frequency governor {', '.join(gov)}: 'performance' gives steadier timings")
    if data["cpu"]["threads_per_core"] and data["cpu"]["threads_per_core"] > 1:
        notes.append("SMT is on: one ktcy thread per physical core is usually fastest (KTCY_NUM_THREADS)")
    if len(data["numa"]) > 1:
        notes.append(f"{len(data['numa'])} NUMA nodes: bind a process to one node (numactl --cpunodebind=N "
                     "--membind=N) or use one rank per node")
    a = data["amx"]
    if a["cpu_has_amx"] and not a["permission_granted"]:
        notes.append("the CPU has AMX but the kernel did not grant tile-data permission (Linux >= 5.16 needed)")
    if data["cpu"]["ktcy_threads"] > (data["cpu"]["usable_cpus"] or 1):
        notes.append("more ktcy threads than usable CPUs: threads will share cores")
    mx, a8 = data["kernels"].get("MXFP4", {}), data["kernels"].get("MXFP4_A8", {})
    if mx.get("isa") in ("avx2", "ref") and a8.get("isa") in ("avx2", "avx512", "amx"):
        notes.append(f"MXFP4 runs on {mx['isa']} here, without a bf16 dot product: MXFP4_A8 (method=\"MXFP4_A8\") "
                     "keeps the same codes and runs about twice as fast with int8 activations (a MoE output "
                     "about 2% from float64 instead of 0.3%, more with outlier activations)")
    return notes


def collect():
    """Every field of `ktcy doctor --json`."""
    data = {
        "versions": versions(), "memory": memory(), "numa": numa(), "huge_pages": huge_pages(),
        "cpu": cpu(), "amx": amx(), "features": _native.cpu_features(),
        "available_isas": _native.available_isas(), "build": _native.build_info(),
        "environment": {k: os.environ.get(k) for k in _ENV}, "environment_problems": environment_problems(),
        "kernels": kernels(),
        "backends": report.backend_readiness(),
    }
    data["advice"] = advice(data)
    return data


def _gib(n):
    return "unknown" if n is None else f"{n / 2**30:.1f} GiB"


def format_text(d):
    v, m, c, a, hp = d["versions"], d["memory"], d["cpu"], d["amx"], d["huge_pages"]
    yes = {True: "yes", False: "no", None: "unknown"}
    lines = [
        f"ktcy {v['ktcy']}  numpy {v['numpy']}  Python {v['python']} ({v['platform']})",
        f"Extension built with: {v['built_with'] or 'unknown'};  cc: {v['cc']['version'] or 'not found'} "
        f"({v['cc']['command']})",
        "",
        f"CPU: {c['model'] or 'unknown'}; {c['usable_cpus']} usable of {c['logical_cpus']} logical CPUs; "
        f"threads per core {c['threads_per_core'] or 'unknown'}; SMT active {yes[c['smt_active']]}; "
        f"ktcy threads {c['ktcy_threads']}",
        "Frequency governor: " + (", ".join(f"{g} (CPUs {cpulist_text(cs) or 'none'})" for g, cs in c["governor"].items())
                                  if c["governor"] else "not exposed"),
        f"Memory: {_gib(m['total_bytes'])} total, {_gib(m['available_bytes'])} available",
        f"Huge pages: {hp['hugepages_total']} reserved ({hp['hugepages_free']} free, "
        f"{hp['hugepage_size_bytes'] // 2**10 if hp['hugepage_size_bytes'] else '?'} kB each); "
        f"THP {hp['thp_enabled'] or 'unknown'} (defrag {hp['thp_defrag'] or 'unknown'})",
        "NUMA: " + ("; ".join(f"node {n['node']}: CPUs {cpulist_text(n['cpus']) or 'none'}, {_gib(n['memory_total_bytes'])}"
                              for n in d["numa"]) if d["numa"] else "not exposed"),
        f"AMX: in CPU {yes[a['cpu_has_amx']]}, enabled by OS {yes[a['os_enables_amx']]}, permission requested "
        f"{yes[a['permission_requested']]}, granted {yes[a['permission_granted']]}",
        "Environment: " + (", ".join(f"{k}={val}" for k, val in d["environment"].items() if val is not None)
                           or "no ktcy/OpenMP variables set"),
        *(f"  problem: {p}" for p in d["environment_problems"]),
        "",
        "Kernel per format:",
    ]
    for fmt, row in d["kernels"].items():
        lines.append(f"  {fmt:15s} {row['isa'] or '-':8s} {row['variant'] or row['reason']}")
        for opt in row["faster_options"]:
            lines.append(f"  {'':15s}   not {opt.get('isa') or opt.get('variant')}: {opt['why_not']}")
    lines += ["", "KTransformers backends:"]
    for backend, row in d["backends"].items():
        state = "ideal" if row["ideal"] else "works" if row["isa"] else "cannot run"
        where = f"{row['isa']} ({row['variant']})" if row["isa"] else row["variant"]
        missing = f"; the ideal path needs {', '.join(row['missing'])}" if row["missing"] else \
            "; the ideal path is not the one chosen (KTCY_ISA / CPUINFER_ENABLE_AMX)" if row["isa"] and not row["ideal"] \
            else ""
        lines.append(f"  {backend:15s} {state:10s} -> {row['format']} on {where}{missing}")
    if d["advice"]:
        lines += ["", "Advice:"] + [f"  - {n}" for n in d["advice"]]
    return "\n".join(lines)
