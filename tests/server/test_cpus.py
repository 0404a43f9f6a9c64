# SPDX-License-Identifier: Apache-2.0
"""The CPU budget (server/cpus.py) from fake /proc and cgroup trees built in tmp dirs."""

from __future__ import annotations

from pathlib import Path

import pytest

from epd_encoder.server import cpus
from epd_encoder.server.cpus import apply_wait_policy, budget, cgroup_quota

V2_MOUNT = "30 25 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"


def v1_mount(root: str = "/", point: str = "/sys/fs/cgroup/cpu,cpuacct") -> str:
    return f"35 25 0:30 {root} {point} rw,nosuid - cgroup cgroup rw,cpu,cpuacct\n"


def tree(tmp: Path, cgroup: str, mountinfo: str, files: dict[str, str]) -> Path:
    """A fake root: /proc/self/{cgroup,mountinfo} and the cgroup files given (absolute paths)."""
    (tmp / "proc/self").mkdir(parents=True)
    (tmp / "proc/self/cgroup").write_text(cgroup)
    (tmp / "proc/self/mountinfo").write_text(mountinfo)
    for path, text in files.items():
        f = tmp / path.lstrip("/")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return tmp


def test_v2_max_is_no_quota_so_the_affinity_mask_decides(tmp_path):
    root = tree(tmp_path, "0::/app\n", V2_MOUNT, {"/sys/fs/cgroup/app/cpu.max": "max 100000\n"})
    assert cgroup_quota(root) is None
    b = budget(root=root, affinity=6, host=64)
    assert (b.threads, b.source, b.quota, b.affinity, b.host) == (6, "affinity", None, 6, 64)


def test_v2_fractional_quota_rounds_down(tmp_path):
    root = tree(tmp_path, "0::/app\n", V2_MOUNT, {"/sys/fs/cgroup/app/cpu.max": "150000 100000\n"})
    b = budget(root=root, affinity=8, host=64)
    assert (b.threads, b.source, b.quota) == (1, "cgroup v2 cpu.max", 1.5)


def test_v2_quota_under_one_core_still_runs_one_thread(tmp_path):
    root = tree(tmp_path, "0::/\n", V2_MOUNT, {"/sys/fs/cgroup/cpu.max": "50000 100000\n"})
    assert budget(root=root, affinity=4).threads == 1


def test_v2_a_parents_quota_binds_a_child_without_one(tmp_path):
    # The Kubernetes shape: the pod's limit on the pod cgroup, the container's own cpu.max unlimited.
    pod = "/sys/fs/cgroup/kubepods.slice/pod1"
    root = tree(tmp_path, "0::/kubepods.slice/pod1/ctr\n", V2_MOUNT,
                {f"{pod}/cpu.max": "400000 100000\n", f"{pod}/ctr/cpu.max": "max 100000\n",
                 "/sys/fs/cgroup/kubepods.slice/cpu.max": "max 100000\n"})
    assert cgroup_quota(root) == (4.0, "cgroup v2 cpu.max")
    assert budget(root=root, affinity=64).threads == 4


def test_the_smallest_quota_on_the_path_wins(tmp_path):
    root = tree(tmp_path, "0::/a/b\n", V2_MOUNT,
                {"/sys/fs/cgroup/a/cpu.max": "200000 100000\n", "/sys/fs/cgroup/a/b/cpu.max": "300000 100000\n"})
    assert cgroup_quota(root) == (2.0, "cgroup v2 cpu.max")


def test_an_affinity_mask_smaller_than_the_quota_decides(tmp_path):
    root = tree(tmp_path, "0::/app\n", V2_MOUNT, {"/sys/fs/cgroup/app/cpu.max": "800000 100000\n"})
    b = budget(root=root, affinity=3, host=16)
    assert (b.threads, b.source, b.quota) == (3, "affinity", 8.0)


def test_a_namespaced_container_sees_its_own_cgroup_at_the_mount_root(tmp_path):
    # cgroupns: /proc/self/cgroup says "/" and the mount shows the container's cgroup as its root.
    root = tree(tmp_path, "0::/\n", "30 25 0:26 / /sys/fs/cgroup ro - cgroup2 cgroup2 rw\n",
                {"/sys/fs/cgroup/cpu.max": "200000 100000\n"})
    assert budget(root=root, affinity=32).threads == 2


def test_a_bind_mounted_subtree_is_found_from_its_mount_root(tmp_path):
    # Docker without cgroupns on v1: the full host path, and a mount whose root is that path.
    ctr = "/docker/abc123"
    root = tree(tmp_path, f"4:cpu,cpuacct:{ctr}\n3:memory:{ctr}\n", v1_mount(root=ctr),
                {"/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_quota_us": "300000\n",
                 "/sys/fs/cgroup/cpu,cpuacct/cpu.cfs_period_us": "100000\n"})
    b = budget(root=root, affinity=16)
    assert (b.threads, b.source, b.quota) == (3, "cgroup v1 cpu.cfs_quota_us", 3.0)


def test_v1_nested_path_under_a_host_mount(tmp_path):
    base = "/sys/fs/cgroup/cpu,cpuacct"
    root = tree(tmp_path, "5:cpuacct,cpu:/kubepods/burstable/pod9/ctr\n", v1_mount(),
                {f"{base}/kubepods/burstable/pod9/ctr/cpu.cfs_quota_us": "-1\n",
                 f"{base}/kubepods/burstable/pod9/ctr/cpu.cfs_period_us": "100000\n",
                 f"{base}/kubepods/burstable/pod9/cpu.cfs_quota_us": "250000\n",
                 f"{base}/kubepods/burstable/pod9/cpu.cfs_period_us": "100000\n"})
    assert cgroup_quota(root) == (2.5, "cgroup v1 cpu.cfs_quota_us")
    assert budget(root=root, affinity=48).threads == 2


def test_v1_unlimited_quota_is_no_bound(tmp_path):
    base = "/sys/fs/cgroup/cpu,cpuacct"
    root = tree(tmp_path, "4:cpu,cpuacct:/\n", v1_mount(),
                {f"{base}/cpu.cfs_quota_us": "-1\n", f"{base}/cpu.cfs_period_us": "100000\n"})
    assert cgroup_quota(root) is None


def test_hybrid_host_takes_the_smaller_of_v1_and_v2(tmp_path):
    root = tree(tmp_path, "1:cpu:/job\n0::/job\n",
                v1_mount(point="/sys/fs/cgroup/cpu") + "31 25 0:27 / /sys/fs/cgroup/unified rw - cgroup2 cgroup2 rw\n",
                {"/sys/fs/cgroup/cpu/job/cpu.cfs_quota_us": "500000\n",
                 "/sys/fs/cgroup/cpu/job/cpu.cfs_period_us": "100000\n",
                 "/sys/fs/cgroup/unified/job/cpu.max": "max 100000\n"})
    assert cgroup_quota(root) == (5.0, "cgroup v1 cpu.cfs_quota_us")


def test_a_v1_mount_of_other_controllers_is_not_read_for_cpu(tmp_path):
    root = tree(tmp_path, "4:memory:/m\n", "35 25 0:30 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n",
                {"/sys/fs/cgroup/memory/m/cpu.cfs_quota_us": "100000\n",
                 "/sys/fs/cgroup/memory/m/cpu.cfs_period_us": "100000\n"})
    assert cgroup_quota(root) is None


@pytest.mark.parametrize("text", ["", "garbage\n", "100000\n", "abc 100000\n", "100000 0\n"])
def test_an_unreadable_cpu_max_sets_no_bound(tmp_path, text):
    root = tree(tmp_path, "0::/\n", V2_MOUNT, {"/sys/fs/cgroup/cpu.max": text})
    assert cgroup_quota(root) is None


def test_no_proc_files_means_no_quota(tmp_path):
    assert cgroup_quota(tmp_path) is None
    assert budget(root=tmp_path, affinity=5).threads == 5


def test_threads_overrides_the_budget_and_is_named_as_the_source(tmp_path):
    root = tree(tmp_path, "0::/\n", V2_MOUNT, {"/sys/fs/cgroup/cpu.max": "100000 100000\n"})
    b = budget(3, root=root, affinity=1)
    assert (b.threads, b.source, b.quota, b.affinity) == (3, "--threads", 1.0, 1)


def test_preprocess_workers_follow_the_budget_up_to_four(tmp_path):
    small, large = budget(root=tmp_path, affinity=2), budget(root=tmp_path, affinity=32)
    assert (small.preprocess_workers(0), large.preprocess_workers(0)) == (2, 4)
    assert small.preprocess_workers(7) == 7  # --preprocess-workers set: taken as is


@pytest.mark.parametrize("threads,ranks,each", [(8, 2, 4), (7, 2, 3), (2, 3, 1), (1, 2, 1)])
def test_tensor_parallel_ranks_split_the_budget(tmp_path, threads, ranks, each):
    assert budget(threads, root=tmp_path).per_rank(ranks) == each


def test_the_spin_count_is_set_only_when_the_user_set_no_wait_setting():
    env: dict[str, str] = {}
    assert apply_wait_policy(env) == f"default (GOMP_SPINCOUNT={cpus.DEFAULT_SPINCOUNT})"
    assert env == {"GOMP_SPINCOUNT": cpus.DEFAULT_SPINCOUNT}
    env = {"OMP_WAIT_POLICY": "PASSIVE"}
    assert apply_wait_policy(env) == "PASSIVE" and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    env = {"GOMP_SPINCOUNT": "300000"}  # libgomp's default count, pinned
    assert apply_wait_policy(env) == "default (GOMP_SPINCOUNT=300000)" and env == {"GOMP_SPINCOUNT": "300000"}


def test_budget_reports_the_wait_policy_libgomp_read(tmp_path):
    assert budget(root=tmp_path, environ={}).wait_policy == "default"
    assert budget(root=tmp_path, environ={"OMP_WAIT_POLICY": "PASSIVE"}).wait_policy == "PASSIVE"


def test_this_host_budget_is_within_the_affinity_mask():
    b = budget()
    assert 1 <= b.threads <= b.affinity == cpus.affinity_cpus()
