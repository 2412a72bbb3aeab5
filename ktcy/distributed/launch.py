"""`ktcy launch [--numa] [--nodes 0,1] [--nproc N] -- <command>`: starts the ranks of one machine
as torchrun does (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), with
--numa one rank per NUMA node, its threads bound to the node's CPUs and its memory to the node's
memory, so no thread reads another socket's memory.  Binding: `numactl` when installed, else
this process binds itself (sched_setaffinity, set_mempolicy) just before starting each rank,
which inherits it, and restores itself after.  If a rank fails the others are stopped, and the
launch returns that rank's exit status.  Several hosts: torchrun (ktcy.distributed works with it).

The CLI wires `add_arguments(parser)` and `run(args) -> int`; user errors raise ValueError."""
from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import socket
import subprocess
import time

from ktcy.distributed import numa
from ktcy.interrupts import signals_deferred, termination_as_interrupt

log = logging.getLogger("ktcy")
STOP_GRACE_SECONDS = 5.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--numa", action="store_true",
                        help="one rank per NUMA node, bound to that node's CPUs and memory")
    parser.add_argument("--nodes", help="with --numa: the NUMA nodes to use, e.g. 0,1 (default: every node with CPUs)")
    parser.add_argument("--nproc", type=int,
                        help="ranks to start (default: one per node with --numa, else 1); with --numa and more "
                             "ranks than nodes, a node's CPUs are split between its ranks")
    parser.add_argument("--master-addr", default="127.0.0.1", help="address of rank 0 (default 127.0.0.1)")
    parser.add_argument("--master-port", type=int, default=0, help="port of rank 0 (default: a free one)")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- then the command every rank runs")


def run(args: argparse.Namespace, node_dir: str = numa.NODE_DIR, numactl: str | None = "auto") -> int:
    """Start the ranks and wait for them; the exit status is 0 or the first failing rank's.
    node_dir: where the NUMA nodes are described (a test passes a fake tree); numactl: its path,
    None to bind without it, "auto" to use it when installed and node_dir is the machine's."""
    command = list(args.command or [])
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        raise ValueError("give the command every rank runs after --, e.g. ktcy launch --numa -- python app.py")
    if not 0 <= args.master_port <= 65535:
        raise ValueError(f"--master-port must be in 0..65535, got {args.master_port}")
    if args.nodes is not None and not args.numa:
        raise ValueError("--nodes chooses NUMA nodes: it needs --numa")
    if numactl == "auto":
        numactl = shutil.which("numactl") if node_dir == numa.NODE_DIR else None
    bindings = _bindings(args, node_dir) if args.numa else None
    nproc = len(bindings) if bindings else (1 if args.nproc is None else args.nproc)
    if isinstance(nproc, bool) or nproc < 1:
        raise ValueError(f"--nproc must be a positive integer, got {nproc!r}")
    port = args.master_port or _free_port(args.master_addr)
    base = dict(os.environ, WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc), MASTER_ADDR=args.master_addr,
                MASTER_PORT=str(port))
    unbound_threads = str(max(1, len(os.sched_getaffinity(0)) // nproc))
    procs = []
    with termination_as_interrupt():  # SIGTERM/SIGHUP to the launcher stop the ranks too
        try:
            for r in range(nproc):
                env = dict(base, RANK=str(r), LOCAL_RANK=str(r))
                if bindings:
                    b = bindings[r]
                    env.update(KTCY_NUM_THREADS=str(len(b.cpus)), OMP_NUM_THREADS=str(len(b.cpus)),
                               KTCY_NUMA_NODE=str(b.node))
                    procs.append(_start_bound(command, env, b, numactl))
                else:  # unbound ranks share the machine: split the thread count, not the CPUs
                    env.setdefault("KTCY_NUM_THREADS", unbound_threads)
                    env.setdefault("OMP_NUM_THREADS", unbound_threads)
                    procs.append(_start(command, env))
            return _supervise(procs)
        except BaseException:
            _stop(procs)
            raise


def _bindings(args, node_dir):
    nodes = numa.read_nodes(node_dir)
    chosen = None
    if args.nodes is not None:
        try:
            chosen = [int(n) for n in args.nodes.split(",")]
        except ValueError:
            raise ValueError(f"--nodes takes comma-separated node numbers, got {args.nodes!r}") from None
    bindings = numa.plan(nodes, args.nproc, chosen)
    used = sorted({b.node for b in bindings})
    if len(used) == 1 and len(bindings) > 1:
        log.warning("one NUMA node (%d) %s: running %d ranks on it, its CPUs split between them", used[0],
                    "on this machine" if len(nodes) == 1 else "chosen", len(bindings))
    for b in bindings:
        memory = f"memory node {b.memory_node}" if b.memory_node is not None else "memory not bound (node has none)"
        log.info("rank %d: NUMA node %d, CPUs %s, %s", b.rank, b.node, numa.cpulist_text(b.cpus), memory)
    return bindings


def _free_port(addr):
    """A port free at addr now (IPv4 or IPv6, as the address resolves)."""
    try:
        family, kind, proto, _, where = socket.getaddrinfo(addr, 0, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as s:
            s.bind(where)
            return s.getsockname()[1]
    except OSError as e:  # socket.gaierror included
        raise ValueError(f"--master-addr {addr!r}: cannot bind a port there ({e.strerror or e})") from None


def _start(command, env):
    """A rank, in the launcher's process group: a kill of the group (a scheduler's, a shell's job
    control, Ctrl-C) reaches the ranks as it reaches the launcher."""
    try:
        return subprocess.Popen(command, env=env)
    except OSError as e:
        raise ValueError(f"cannot start {command[0]!r}: {e.strerror}") from None


def _start_bound(command, env, b, numactl):
    if numactl:
        prefix = [numactl, f"--physcpubind={numa.cpulist_text(b.cpus)}"]
        if b.memory_node is not None:
            prefix.append(f"--membind={b.memory_node}")
        return _start(prefix + ["--"] + command, env)
    # bind this process, start the rank (it inherits both), then undo
    saved_cpus, saved_policy = os.sched_getaffinity(0), numa.get_memory_policy()
    try:
        try:
            os.sched_setaffinity(0, b.cpus)
        except OSError as e:
            raise ValueError(f"rank {b.rank}: cannot bind to CPUs {numa.cpulist_text(b.cpus)} ({e.strerror})") from None
        if b.memory_node is not None:
            try:
                numa.set_memory_policy("bind", [b.memory_node])
            except OSError as e:
                raise ValueError(f"rank {b.rank}: cannot bind memory to NUMA node {b.memory_node} ({e})") from None
        return _start(command, env)
    finally:
        os.sched_setaffinity(0, saved_cpus)
        # a launcher under another policy (preferred, interleave) returns to the default: it
        # allocates little, and every rank it starts gets its own policy anyway
        mode, nodes = saved_policy
        numa.set_memory_policy(mode if mode == "bind" else "default", nodes if mode == "bind" else ())


def _supervise(procs):
    """Wait for every rank; when one fails, stop the others and return its exit status."""
    while True:
        codes = [p.poll() for p in procs]
        failed = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            rank, code = failed[0]
            log.error("rank %d exited with status %d; stopping the other ranks", rank, code)
            _stop(procs)
            return code if code > 0 else 128 - code  # killed by signal N: 128 + N, as a shell says
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.05)


def _stop(procs):
    """SIGTERM to every running rank and all it started (a wrapper rank, `bash run.sh`, runs the
    real program as its child), SIGKILL to those still there after STOP_GRACE_SECONDS.  Signals to
    the launcher wait until this is done: a second Ctrl-C or SIGTERM must not cut the grace period
    short and leave ranks running.  (The children of a rank that already exited belong to init:
    they cannot be traced to it any more.)"""
    with signals_deferred():
        tree = [proc for p in procs if p.poll() is None for proc in _process_tree(p.pid)]
        for pid, start in tree:
            _signal(pid, start, signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_SECONDS
        for p in procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        while time.monotonic() < deadline and any(_start_time(pid) == start for pid, start in tree):
            time.sleep(0.05)
        for pid, start in tree:
            _signal(pid, start, signal.SIGKILL)
        for p in procs:
            p.wait()


def _stat(pid):
    """(start time in ticks since boot, parent pid) of process pid, None if there is none: with
    the pid, the start time names one process, never a later one given the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # the command may hold ")"
        return int(fields[19]), int(fields[1])
    except (OSError, ValueError, IndexError):
        return None


def _start_time(pid):
    stat = _stat(pid)
    return None if stat is None else stat[0]


def _process_tree(root):
    """(pid, start time) of root and of every process descended from it now, from /proc."""
    children, started = {}, {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = _stat(int(name))
            if stat is not None:
                started[int(name)] = stat[0]
                children.setdefault(stat[1], []).append(int(name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in started:
            tree.append((pid, started[pid]))
            todo.extend(children.get(pid, ()))
    return tree


def _signal(pid, start, sig):
    if _start_time(pid) == start:  # still that process (a pid can be given again)
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
