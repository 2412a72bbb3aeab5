"""`ktcy launch`: NUMA plans, the bindings each rank reports (a fake 2-node /sys tree, and this
machine's real one), the numactl command line, rank failures and bad input."""
import argparse
import json
import logging
import os
import signal
import socket
import stat
import subprocess
import sys
import time

import pytest

from ktcy.distributed import launch, numa

from conftest import time_limit

REPORT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "dist_rank_report.py")
two_cpus = pytest.mark.skipif(not {0, 1} <= os.sched_getaffinity(0), reason="needs CPUs 0 and 1")


def parse(*argv):
    parser = argparse.ArgumentParser()
    launch.add_arguments(parser)
    return parser.parse_args(list(argv))


def fake_tree(root, nodes):
    """nodes: {id: (cpulist text, MemTotal kB)} as /sys/devices/system/node lays them out."""
    for node, (cpus, mem_kb) in nodes.items():
        d = root / f"node{node}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
        (d / "meminfo").write_text(f"Node {node} MemTotal:       {mem_kb} kB\nNode {node} MemFree: 0 kB\n")
    return str(root)


def reports(folder, n):
    return [json.load(open(os.path.join(folder, f"rank{r}.json"))) for r in range(n)]


def report_command(folder, *extra):
    return ["--", sys.executable, REPORT, str(folder), *extra]


@two_cpus
def test_numa_ranks_report_the_bindings_of_a_two_node_tree(tmp_path):
    # node 1 has CPUs but no memory (as on some VMs and CXL systems): its memory stays unbound
    tree = fake_tree(tmp_path / "sys", {0: ("0", 1 << 20), 1: ("1", 0)})
    with time_limit(30):
        assert launch.run(parse("--numa", *report_command(tmp_path)), node_dir=tree) == 0
    r0, r1 = reports(tmp_path, 2)
    assert (r0["node"], r0["cpus"], r0["memory_policy"], r0["memory_nodes"]) == ("0", [0], "bind", [0])
    assert (r1["node"], r1["cpus"], r1["memory_policy"]) == ("1", [1], "default")
    for r, rep in enumerate((r0, r1)):
        assert rep["env"]["RANK"] == rep["env"]["LOCAL_RANK"] == str(r)
        assert rep["env"]["WORLD_SIZE"] == "2" and rep["env"]["KTCY_NUM_THREADS"] == "1"
    # the launcher itself is left as it was
    assert numa.get_memory_policy() == ("default", [])
    assert len(os.sched_getaffinity(0)) >= 2


@two_cpus
def test_nodes_option_picks_nodes(tmp_path):
    tree = fake_tree(tmp_path / "sys", {0: ("0", 1), 1: ("1", 0)})
    with time_limit(30):
        assert launch.run(parse("--numa", "--nodes", "1", *report_command(tmp_path)), node_dir=tree) == 0
    (only,) = reports(tmp_path, 1)
    assert (only["node"], only["cpus"], only["env"]["WORLD_SIZE"]) == ("1", [1], "1")


@two_cpus
def test_one_node_machine_runs_the_ranks_asked_and_says_so(tmp_path, caplog):
    """This machine's real /sys (one node): 2 ranks share node 0, one CPU each, and join a gloo
    group from the environment the launcher set."""
    pytest.importorskip("torch")
    nodes = numa.read_nodes()
    if len(nodes) != 1:
        pytest.skip("this machine has several NUMA nodes")
    with caplog.at_level(logging.INFO, logger="ktcy"), time_limit(60):
        assert launch.run(parse("--numa", "--nproc", "2", *report_command(tmp_path, "--gloo")), numactl=None) == 0
    assert any("one NUMA node (0) on this machine: running 2 ranks" in m for m in caplog.messages)
    r0, r1 = reports(tmp_path, 2)
    assert r0["cpus"] and r1["cpus"] and not set(r0["cpus"]) & set(r1["cpus"])
    assert r0["memory_policy"] == r1["memory_policy"] == "bind" and r0["memory_nodes"] == [0]
    assert r0["gathered"] == r1["gathered"] == [0, 1]


def test_numactl_is_used_when_installed(tmp_path):
    """A stand-in numactl records its arguments and runs the command after --."""
    fake = tmp_path / "numactl"
    fake.write_text('#!/bin/sh\necho "$@" > "$FAKE_NUMACTL_LOG.$RANK"\nwhile [ "$1" != "--" ]; do shift; done\n'
                    'shift\nexec "$@"\n')
    fake.chmod(fake.stat().st_mode | stat.S_IXUSR)
    tree = fake_tree(tmp_path / "sys", {0: ("0-1", 1), 1: ("2-3", 0)})
    os.environ["FAKE_NUMACTL_LOG"] = str(tmp_path / "args")
    try:
        with time_limit(30):
            code = launch.run(parse("--numa", "--", sys.executable, "-c", "pass"), node_dir=tree, numactl=str(fake))
    finally:
        del os.environ["FAKE_NUMACTL_LOG"]
    assert code == 0
    # the plan keeps the CPUs this process may use: here only those the test machine has
    allowed = os.sched_getaffinity(0)
    if {0, 1, 2, 3} <= allowed:
        assert (tmp_path / "args.0").read_text().split()[:3] == ["--physcpubind=0-1", "--membind=0", "--"]
        assert (tmp_path / "args.1").read_text().split()[:2] == ["--physcpubind=2-3", "--"]
    else:
        assert "--membind=0" in (tmp_path / "args.0").read_text()


def test_a_failing_rank_stops_the_others(tmp_path):
    script = "import os, sys, time\nif os.environ['RANK'] == '1': sys.exit(3)\ntime.sleep(60)\n"
    start = time.monotonic()
    with time_limit(30):
        assert launch.run(parse("--nproc", "2", "--", sys.executable, "-c", script)) == 3
    assert time.monotonic() - start < launch.STOP_GRACE_SECONDS + 10


def test_plan_splits_nodes_between_ranks():
    nodes = [numa.Node(0, (0, 1, 2, 3), True), numa.Node(1, (4, 5, 6, 7), True), numa.Node(2, (), True)]
    allowed = range(8)
    assert [(b.node, b.cpus) for b in numa.plan(nodes, allowed=allowed)] == [(0, (0, 1, 2, 3)), (1, (4, 5, 6, 7))]
    four = numa.plan(nodes, 4, allowed=allowed)
    assert [(b.node, b.cpus, b.memory_node) for b in four] == [(0, (0, 1), 0), (0, (2, 3), 0), (1, (4, 5), 1),
                                                                (1, (6, 7), 1)]
    assert [b.cpus for b in numa.plan(nodes, 3, [0], allowed=allowed)] == [(0, 1), (2,), (3,)]
    assert [b.cpus for b in numa.plan(nodes, allowed=[1, 2, 5])] == [(1, 2), (5,)]  # the affinity mask counts
    with pytest.raises(ValueError, match="node 9 does not exist"):
        numa.plan(nodes, chosen=[9], allowed=allowed)
    with pytest.raises(ValueError, match="node 2 has no CPU"):
        numa.plan(nodes, chosen=[2], allowed=allowed)
    with pytest.raises(ValueError, match="only 4 usable CPUs"):
        numa.plan(nodes, 10, [0], allowed=allowed)
    assert numa.parse_cpulist("0-2,5,7-8\n", "x") == (0, 1, 2, 5, 7, 8)
    assert numa.cpulist_text((0, 1, 2, 5, 7, 8)) == "0-2,5,7-8"
    for bad in ("0-", "a", "3-1", "99999999"):
        with pytest.raises(ValueError, match="where"):
            numa.parse_cpulist(bad, "where")


def test_bad_launches_are_one_clear_error(tmp_path):
    tree = fake_tree(tmp_path / "sys", {0: ("0", 1)})
    cases = [(parse("--numa"), "give the command"),
             (parse("--nodes", "0", "--", "true"), "needs --numa"),
             (parse("--numa", "--nodes", "0,x", "--", "true"), "comma-separated"),
             (parse("--numa", "--nodes", "3", "--", "true"), "node 3 does not exist"),
             (parse("--nproc", "0", "--", "true"), "--nproc must be a positive integer"),
             (parse("--master-port", "70000", "--", "true"), "--master-port"),
             (parse("--", str(tmp_path / "no-such-program")), "cannot start")]
    for args, message in cases:
        with pytest.raises(ValueError, match=message):
            launch.run(args, node_dir=tree, numactl=None)
    (tmp_path / "sys" / "node0" / "cpulist").write_text("zero\n")
    with pytest.raises(ValueError, match="cpulist"):
        launch.run(parse("--numa", "--", "true"), node_dir=tree, numactl=None)


# ---- the fifty-ninth session's review ----

def _running_with(marker):
    """pids whose command line holds marker (a process a test started and must not leave)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if marker.encode() in f.read():
                    found.append(int(pid))
        except OSError:
            pass
    return found


def _ignoring_sigterm(pids, launcher):
    """The pids (the launcher's left out: its command line holds the ranks') that ignore SIGTERM."""
    out = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                ignored = next(int(line.split()[1], 16) for line in f if line.startswith("SigIgn:"))
        except (OSError, StopIteration):
            continue
        if pid != launcher and ignored >> (signal.SIGTERM - 1) & 1:
            out.append(pid)
    return out


def test_stopping_a_rank_stops_what_it_started(tmp_path):
    """A rank that is a wrapper (a shell running the real program) left that program running when
    the launcher stopped it; each rank is now a process group of its own, stopped whole."""
    marker = "3141.5926"
    script = f'if [ "$RANK" = 1 ]; then sleep 1; exit 5; fi; sleep {marker}; echo done'
    try:
        with time_limit(30):
            assert launch.run(parse("--nproc", "2", "--", "bash", "-c", script)) == 5
        time.sleep(0.3)
        assert _running_with(f"sleep {marker}") == []
    finally:
        for pid in _running_with(f"sleep {marker}"):
            os.kill(pid, 9)


def test_a_second_signal_while_stopping_still_stops_every_rank(tmp_path):
    """Ranks slow to leave on SIGTERM (they ignore it) and a launcher sent SIGTERM twice: the
    second one used to cut the grace period short, and the ranks stayed."""
    marker = "2718.2818"
    rank = f"import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep({marker})"
    p = subprocess.Popen([sys.executable, "-m", "ktcy", "launch", "--nproc", "2", "--", sys.executable, "-c", rank],
                         stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while len(_ignoring_sigterm(_running_with(f"time.sleep({marker})"), p.pid)) < 2:
            assert time.monotonic() < deadline, "the ranks did not start"
            time.sleep(0.05)
        p.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 130 and p.stderr.read().strip() == "ktcy: interrupted"
        time.sleep(0.3)
        assert _running_with(f"time.sleep({marker})") == []
    finally:
        p.kill()
        for pid in _running_with(f"time.sleep({marker})"):
            os.kill(pid, 9)


def test_an_ipv6_master_address_gets_a_port():
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    assert 0 < launch._free_port("::1") < 65536
    with pytest.raises(ValueError, match="--master-addr 'no.such.host.invalid': cannot bind"):
        launch._free_port("no.such.host.invalid")


@pytest.mark.parametrize("env, words", [
    ({"RANK": "5"}, "RANK='5' must be an integer in 0..1"), ({"RANK": "-1"}, "RANK='-1'"),
    ({"WORLD_SIZE": "abc"}, "WORLD_SIZE='abc' must be an integer"), ({"WORLD_SIZE": "-1"}, "WORLD_SIZE='-1'"),
    ({"MASTER_PORT": "abc"}, "MASTER_PORT='abc'"), ({"MASTER_PORT": "70000"}, "MASTER_PORT='70000'"),
    ({"BUSY": "1"}, "cannot join the process group at 127.0.0.1:"),
])
def test_bad_rank_variables_and_a_busy_port_are_one_distributed_error(env, words):
    """A rank past the world waited out the whole timeout; a busy port or a word for a number
    came out of torch as a traceback."""
    pytest.importorskip("torch")
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        base = {"RANK": "0", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(busy.getsockname()[1]) if "BUSY" in env else "29999"}
        env = {k: v for k, v in env.items() if k != "BUSY"}
        code = ("from ktcy.distributed import DistributedError, init_process_group\n"
                "try:\n    init_process_group(timeout=10)\nexcept DistributedError as e:\n    print(e)\n")
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                           env={**os.environ, **base, **env})
    assert r.returncode == 0 and words in r.stdout, r.stdout + r.stderr
