"""Seccomp profiles for the container tests: a runtime default stricter than podman's about namespaces, as the
defaults of containerd (moby's profile) and CRI-O are, and that profile with exactly the calls the code sandbox needs.

podman's default profile (containers/common) allows clone, clone3, unshare, mount, umount2, pivot_root and setns to
every container. containerd's and CRI-O's allow them only to a container with CAP_SYS_ADMIN, and a clone without it
only when it creates no namespace; clone3 fails with ENOSYS, so that glibc falls back to clone. `stricter_default`
applies those rules to podman's profile (and moby's EPERM for a call the profile does not allow)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

PODMAN_DEFAULT = Path("/usr/share/containers/seccomp.json")
NAMESPACE_CALLS = ("clone", "clone3", "unshare", "mount", "umount", "umount2", "pivot_root", "setns")
NAMESPACE_CLONE_FLAGS = 0x7E020000  # CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET
ENOSYS = 38


def stricter_default(podman_default: Path = PODMAN_DEFAULT) -> dict:
    profile = copy.deepcopy(json.loads(podman_default.read_text()))
    profile["defaultErrnoRet"] = 1  # EPERM
    profile.pop("defaultErrno", None)
    kept = []
    for rule in profile["syscalls"]:
        unconditional = rule["action"] == "SCMP_ACT_ALLOW" and not rule.get("includes", {}).get("caps")
        names = [name for name in rule["names"] if not (unconditional and name in NAMESPACE_CALLS)]
        if names:
            kept.append({**rule, "names": names})
    without_admin = {"caps": ["CAP_SYS_ADMIN"]}
    profile["syscalls"] = [
        *kept,
        {
            "names": ["clone"],
            "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": NAMESPACE_CLONE_FLAGS, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}],
            "excludes": without_admin,
        },
        {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": ENOSYS, "excludes": without_admin},
        {"names": list(NAMESPACE_CALLS), "action": "SCMP_ACT_ALLOW", "includes": without_admin},
    ]
    return profile


def allowing(profile: dict, calls: tuple[str, ...]) -> dict:
    """`profile` with `calls` allowed to every container, whatever their arguments."""
    return {**profile, "syscalls": [*profile["syscalls"], {"names": list(calls), "action": "SCMP_ACT_ALLOW"}]}
