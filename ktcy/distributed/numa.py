"""NUMA nodes as ranks: the nodes of this machine (from /sys/devices/system/node), a plan that
gives each rank a node's CPUs and memory, and the system calls that apply it (sched_setaffinity;
set_mempolicy(MPOL_BIND) through libnuma, or the raw system call where libnuma is missing).
No torch here: `ktcy launch` uses it before any rank starts.  `python -m ktcy.distributed.numa`
prints this process's binding as JSON (what a rank was given)."""
from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import List, Optional, Sequence, Set

from ktcy.ranges import ranges_text as cpulist_text  # (0, 1, 2, 5) -> "0-2,5"

NODE_DIR = "/sys/devices/system/node"
_MAX_CPU = 1 << 16          # far above any machine; bounds what an untrusted cpulist may claim
_MAX_NODES = 1024           # bits of the node masks passed to the kernel
_MPOL_DEFAULT, _MPOL_BIND = 0, 2
_MODES = {0: "default", 1: "preferred", 2: "bind", 3: "interleave", 4: "local"}
_SYS_SET_MEMPOLICY, _SYS_GET_MEMPOLICY = 238, 239  # x86-64 system call numbers


@dataclass(frozen=True)
class Node:
    id: int
    cpus: tuple
    has_memory: bool


@dataclass(frozen=True)
class Binding:
    """What one rank gets: a node's CPUs (all of them, or its share when ranks share a node) and
    that node's memory (memory_node None: the node has none, the policy stays the default)."""
    rank: int
    node: int
    cpus: tuple
    memory_node: Optional[int]


def parse_cpulist(text: str, where: str) -> tuple:
    """"0-3,8,10-11" (the kernel's list format) -> (0, 1, 2, 3, 8, 10, 11); ValueError naming `where`."""
    cpus: Set[int] = set()
    text = text.strip()
    for part in filter(None, text.split(",")):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", part.strip())
        if not m:
            raise ValueError(f"{where}: {text!r:.80} is not a CPU list")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if lo > hi or hi >= _MAX_CPU:
            raise ValueError(f"{where}: range {part!r} is not a CPU range below {_MAX_CPU}")
        cpus.update(range(lo, hi + 1))
    return tuple(sorted(cpus))


def _read_small(path):
    with open(path, "rb") as f:
        return f.read(1 << 16).decode("ascii", "replace")


def read_nodes(node_dir: str = NODE_DIR) -> List[Node]:
    """The NUMA nodes under node_dir, by id.  A kernel without NUMA support has no such folder:
    then the machine is one node 0 with every CPU this process may use."""
    if not os.path.isdir(node_dir):
        return [Node(0, tuple(sorted(os.sched_getaffinity(0))), True)]
    nodes = []
    for name in os.listdir(node_dir):
        m = re.fullmatch(r"node(\d+)", name)
        if not m or int(m.group(1)) >= _MAX_NODES:
            continue
        folder = os.path.join(node_dir, name)
        cpulist = os.path.join(folder, "cpulist")
        try:
            cpus = parse_cpulist(_read_small(cpulist), cpulist) if os.path.exists(cpulist) else ()
        except OSError as e:
            raise ValueError(f"{cpulist}: cannot read ({e.strerror})") from None
        nodes.append(Node(int(m.group(1)), cpus, _has_memory(os.path.join(folder, "meminfo"))))
    if not nodes:
        raise ValueError(f"{node_dir}: no NUMA node folders (node0, node1, ...)")
    return sorted(nodes, key=lambda n: n.id)


def _has_memory(meminfo):
    """A node's meminfo says "Node 1 MemTotal: 0 kB" when it has CPUs but no memory."""
    try:
        m = re.search(r"MemTotal:\s*(\d+)", _read_small(meminfo))
    except OSError:
        return True  # unknown: assume it has memory, as nearly every node does
    return m is None or int(m.group(1)) > 0


def plan(nodes: Sequence[Node], nproc: Optional[int] = None, chosen: Optional[Sequence[int]] = None,
         allowed: Optional[Sequence[int]] = None) -> List[Binding]:
    """One rank per chosen node (default: every node with CPUs this process may use), or nproc
    ranks: the first nproc nodes when fewer, else the ranks in consecutive blocks per node with
    each node's CPUs split between its ranks, so no two ranks share a CPU."""
    allowed_cpus = set(os.sched_getaffinity(0) if allowed is None else allowed)
    usable = {n.id: tuple(c for c in n.cpus if c in allowed_cpus) for n in nodes}
    by_id = {n.id: n for n in nodes}
    if chosen is None:
        chosen = [n.id for n in nodes if usable[n.id]]
        if not chosen:
            raise ValueError("no NUMA node has a CPU this process may use")
    else:
        for node in chosen:
            if node not in by_id:
                raise ValueError(f"--nodes: node {node} does not exist (nodes: {', '.join(str(n) for n in by_id)})")
            if not usable[node]:
                raise ValueError(f"--nodes: node {node} has no CPU this process may use")
        if len(set(chosen)) != len(chosen):
            raise ValueError(f"--nodes names a node twice: {','.join(map(str, chosen))}")
    n = len(chosen)
    nproc = n if nproc is None else nproc
    if isinstance(nproc, bool) or not isinstance(nproc, int) or nproc < 1:
        raise ValueError(f"--nproc must be a positive integer, got {nproc!r}")
    on_node = [chosen[r] for r in range(nproc)] if nproc <= n else [chosen[r * n // nproc] for r in range(nproc)]
    bindings = []
    for r, node in enumerate(on_node):
        peers = [q for q in range(nproc) if on_node[q] == node]
        cpus = usable[node]
        if len(peers) > len(cpus):
            raise ValueError(f"{len(peers)} ranks on node {node} but it has only {len(cpus)} usable CPUs")
        i, share = peers.index(r), len(cpus) // len(peers)
        extra = len(cpus) % len(peers)
        start = i * share + min(i, extra)
        mine = cpus[start:start + share + (i < extra)]
        bindings.append(Binding(r, node, mine, node if by_id[node].has_memory else None))
    return bindings


# ---- memory policy through libnuma's set_mempolicy/get_mempolicy, else the system calls ------

def _policy_calls():
    """(set_mempolicy, get_mempolicy, source) as ctypes callables with the libnuma signatures."""
    name = ctypes.util.find_library("numa")
    if name:
        try:
            lib = ctypes.CDLL(name, use_errno=True)
            return lib.set_mempolicy, lib.get_mempolicy, "libnuma"
        except (OSError, AttributeError):
            pass
    libc = ctypes.CDLL(None, use_errno=True)

    def set_policy(mode, mask, maxnode):
        return libc.syscall(ctypes.c_long(_SYS_SET_MEMPOLICY), mode, mask, maxnode)

    def get_policy(mode, mask, maxnode, addr, flags):
        return libc.syscall(ctypes.c_long(_SYS_GET_MEMPOLICY), mode, mask, maxnode, addr, flags)
    return set_policy, get_policy, "the set_mempolicy system call"


_WORDS = _MAX_NODES // 64
_Mask = ctypes.c_ulong * _WORDS


def _mask(nodes):
    mask = _Mask()
    for n in nodes:
        mask[n // 64] |= 1 << (n % 64)
    return mask


def get_memory_policy():
    """(mode, nodes) of the calling thread: ("default", []) or ("bind", [0]), ..."""
    _, get_policy, _ = _policy_calls()
    mode, mask = ctypes.c_int(), _Mask()
    if get_policy(ctypes.byref(mode), mask, ctypes.c_ulong(_MAX_NODES), None, ctypes.c_ulong(0)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"get_mempolicy failed: {os.strerror(err)}")
    nodes = [w * 64 + b for w in range(_WORDS) for b in range(64) if mask[w] >> b & 1]
    return _MODES.get(mode.value & 0xFF, str(mode.value)), nodes


def set_memory_policy(mode: str, nodes=()):
    """"bind" to nodes, or "default"; OSError if the kernel refuses (no such node, no permission)."""
    set_policy, _, source = _policy_calls()
    code = {"bind": _MPOL_BIND, "default": _MPOL_DEFAULT}[mode]
    mask = _mask(nodes) if nodes else None
    if set_policy(ctypes.c_int(code), mask, ctypes.c_ulong(_MAX_NODES + 1 if nodes else 0)) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"set_mempolicy({mode}, nodes {list(nodes)}) through {source} failed: {os.strerror(err)}")
    return source


def current_binding() -> dict:
    """What this process runs on: its CPUs and memory policy, and the node `ktcy launch` gave it."""
    mode, nodes = get_memory_policy()
    return {"rank": os.environ.get("RANK"), "node": os.environ.get("KTCY_NUMA_NODE"),
            "cpus": sorted(os.sched_getaffinity(0)), "memory_policy": mode, "memory_nodes": nodes}


if __name__ == "__main__":
    json.dump(current_binding(), sys.stdout)
    print()
