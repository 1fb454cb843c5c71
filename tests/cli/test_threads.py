"""How many CPU threads the hf-rocketkv command gives torch (cli/threads.py): physical cores less the busy ones,
``--threads`` and ``OMP_NUM_THREADS`` first, and the CPU topology and cgroup quota read from hand-written files."""

from __future__ import annotations

from hf_rocketkv.cli.threads import cgroup_cpu_quota, choose_threads, default_threads, physical_cores


def test_default_threads_follow_idle_cores(monkeypatch):
    monkeypatch.setattr("hf_rocketkv.cli.threads.usable_cpus", lambda: 8)
    monkeypatch.setattr("hf_rocketkv.cli.threads.physical_cores", lambda: 4)
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert default_threads(load_average=0.0).count == 4  # physical cores, not hyper-threads
    assert default_threads(load_average=5.0).count == 3  # 3 CPUs idle
    assert default_threads(load_average=7.6).count == 1  # never below 1
    assert default_threads(load_average=40.0).count == 1
    assert "load average 5.0" in default_threads(load_average=5.0).reason


def test_choose_threads_precedence():
    assert choose_threads(3) == choose_threads(3, {"OMP_NUM_THREADS": "2"})
    assert choose_threads(3).count == 3 and choose_threads(3).reason == "--threads"
    assert choose_threads(None, {"OMP_NUM_THREADS": "2"}) is None  # torch already follows the variable
    assert choose_threads(None, {}).count >= 1


def test_cpu_topology_files(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    blocks = [f"processor\t: {i}\nphysical id\t: 0\ncore id\t\t: {i % 2}\n" for i in range(4)]  # 2 cores x 2 threads
    cpuinfo.write_text("\n".join(blocks))
    assert physical_cores(cpuinfo) == 2
    assert physical_cores(tmp_path / "missing") is None
    quota = tmp_path / "cpu.max"
    quota.write_text("150000 100000\n")
    assert cgroup_cpu_quota(quota) == 2
    quota.write_text("max 100000\n")
    assert cgroup_cpu_quota(quota) is None
