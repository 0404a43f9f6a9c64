# SPDX-License-Identifier: Apache-2.0
"""The CPUs this process may really use, and the threads sized from them.

A container sees every host core (``os.cpu_count()``, and torch's default pool), but it may
run only on its affinity mask and only for its cgroup's CPU quota: cgroup v2 ``cpu.max``
(``"max 100000"`` or ``"150000 100000"``), v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``.
The quota that binds is the smallest on the path from the process's cgroup (``/proc/self/cgroup``)
up to the root of the mount (``/proc/self/mountinfo``): a pod's limit holds its containers too.

Every path is read under ``root`` so tests build fake trees; nothing here imports torch.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass
from pathlib import Path

# libgomp's wait when the user sets none (cli.py applies it before torch loads): spin this many
# turns, then sleep. Chosen by benchmarks/bench_wait_policy.py (docs/operations.md, "Shared CPUs").
DEFAULT_SPINCOUNT = "100000"
MAX_AUTO_PREPROCESS_WORKERS = 4  # the tower, not decoding, is a CPU server's bottleneck


@dataclass(frozen=True)
class CpuBudget:
    """What the process may use and what it runs with. ``threads`` sizes torch's intra-op pool
    (split over the ranks under ``--tp``); ``source`` says which bound chose it."""

    threads: int
    source: str  # "--threads" | "affinity" | "cgroup v2 cpu.max" | "cgroup v1 cpu.cfs_quota_us"
    affinity: int  # CPUs in the affinity mask
    quota: float | None  # the cgroup CPU limit in cores; None when unlimited or not found
    host: int  # what os.cpu_count() reports (and torch would size its pool from)
    wait_policy: str = "default"  # libgomp's OMP_WAIT_POLICY as the process started

    def preprocess_workers(self, configured: int) -> int:
        """``--preprocess-workers``, or when it is 0 the budget (at most 4)."""
        return configured or max(1, min(MAX_AUTO_PREPROCESS_WORKERS, self.threads))

    def per_rank(self, ranks: int) -> int:
        """Each tensor-parallel rank's intra-op threads: the budget split, never oversubscribed."""
        return max(1, self.threads // ranks)

    def describe(self) -> str:
        quota = "none" if self.quota is None else f"{self.quota:g}"
        return (f"{self.threads} intra-op threads ({self.source}; affinity {self.affinity} CPUs, "
                f"cgroup quota {quota}, host {self.host} CPUs), OMP_WAIT_POLICY={self.wait_policy}")


def affinity_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:  # absent (no such controller, root cgroup) or unreadable: no bound from it
        return None


def _under(root: Path, absolute: str) -> Path:
    return root / absolute.lstrip("/")


def _mounts(root: Path) -> list[tuple[str, str, str, set[str]]]:
    """``(fstype, mount root, mount point, super options)`` of every cgroup mount."""
    text = _read(root / "proc/self/mountinfo") or ""
    out = []
    for line in text.splitlines():
        pre, sep, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        out.append((tail[0], fields[3], fields[4], set(tail[2].split(","))))
    return out


def _cgroup_dirs(root: Path) -> list[tuple[str, Path, Path]]:
    """``(version, the process's cgroup dir, the mount point)`` for v2 and the v1 cpu controller."""
    groups: dict[str, str] = {}  # "v2" or "v1" -> the process's path in that hierarchy
    for line in (_read(root / "proc/self/cgroup") or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if parts[0] == "0" and controllers == "":
            groups["v2"] = path
        elif "cpu" in controllers.split(","):
            groups["v1"] = path
    mounts = _mounts(root)
    if not mounts:  # no mountinfo: the usual mount points
        mounts = [("cgroup2", "/", "/sys/fs/cgroup", set()), ("cgroup", "/", "/sys/fs/cgroup/cpu", {"cpu"})]
    out = []
    for fstype, mount_root, point, options in mounts:
        version = "v2" if fstype == "cgroup2" else "v1"
        mine = groups.get(version)
        if mine is None or (version == "v1" and "cpu" not in options):
            continue
        # The mount shows the hierarchy from mount_root down (a container's bind mount, or
        # its cgroup namespace, where the path is already relative: "/").
        rel = os.path.relpath(mine, mount_root) if mine.startswith(mount_root) else "."
        if rel.startswith(".."):
            rel = "."
        point_dir = _under(root, point)
        out.append((version, point_dir / rel if rel != "." else point_dir, point_dir))
    return out


def _quota_v2(d: Path) -> float | None:
    text = _read(d / "cpu.max")
    if text is None:
        return None
    fields = text.split()
    if len(fields) != 2 or fields[0] == "max" or not all(f.isdigit() for f in fields) or fields[1] == "0":
        return None
    return int(fields[0]) / int(fields[1])


def _quota_v1(d: Path) -> float | None:
    quota, period = _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
    if quota is None or period is None or not period.strip().isdigit() or int(period) == 0:
        return None
    try:
        q = int(quota)
    except ValueError:
        return None
    return q / int(period) if q > 0 else None  # -1: unlimited


def cgroup_quota(root: Path = Path("/")) -> tuple[float, str] | None:
    """The smallest CPU quota, in cores, on the path from this process's cgroup up to its
    mount's root, and which file set it; None when no level sets one."""
    best: tuple[float, str] | None = None
    for version, d, top in _cgroup_dirs(root):
        read, name = (_quota_v2, "cgroup v2 cpu.max") if version == "v2" else (_quota_v1, "cgroup v1 cpu.cfs_quota_us")
        while True:
            q = read(d)
            if q is not None and (best is None or q < best[0]):
                best = (q, name)
            if d == top or top not in d.parents:
                break
            d = d.parent
    return best


def budget(threads: int = 0, *, root: Path = Path("/"), affinity: int | None = None,
           host: int | None = None, environ: Mapping[str, str] = os.environ) -> CpuBudget:
    """The intra-op threads to run with: ``threads`` when set (``--threads``), else the
    affinity mask's size capped by the cgroup quota rounded down (at least 1: the fraction
    left over runs HTTP and preprocessing, and a pool wider than the quota is throttled
    mid-forward)."""
    cpus = affinity_cpus() if affinity is None else affinity
    host = (os.cpu_count() or cpus) if host is None else host
    found = cgroup_quota(root)
    quota, policy = None if found is None else found[0], wait_policy(environ)
    if threads > 0:
        return CpuBudget(threads, "--threads", cpus, quota, host, policy)
    if found is not None and math.floor(found[0]) < cpus:
        return CpuBudget(max(1, math.floor(found[0])), found[1], cpus, quota, host, policy)
    return CpuBudget(cpus, "affinity", cpus, quota, host, policy)


def apply_wait_policy(environ: MutableMapping[str, str]) -> str:
    """Set libgomp's ``GOMP_SPINCOUNT`` unless the user set it or ``OMP_WAIT_POLICY``; the
    policy in effect. It must run before torch is imported: libgomp reads both once, when it
    loads (and an explicit spin count overrides the policy's)."""
    if "GOMP_SPINCOUNT" not in environ and "OMP_WAIT_POLICY" not in environ:
        environ["GOMP_SPINCOUNT"] = DEFAULT_SPINCOUNT
    return wait_policy(environ)


def wait_policy(environ: Mapping[str, str]) -> str:
    """The policy libgomp runs with ("default": spin about 300k turns, then sleep)."""
    policy = environ.get("OMP_WAIT_POLICY") or "default"
    spins = environ.get("GOMP_SPINCOUNT")
    return policy if spins is None else f"{policy} (GOMP_SPINCOUNT={spins})"
