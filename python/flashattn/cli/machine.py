"""What machine this is, for the headers of `bench` and `info` (and their
--json): the CPU's model name, its cores, and the instruction-set
extensions that matter to the cpu engine, as the operating system reports
them (/proc/cpuinfo on Linux, sysctl on macOS). Nothing here is measured."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Dict, List, Optional

# The extensions the cpu engine's paths use or could use, in the names
# Linux's /proc/cpuinfo gives them (x86-64 "flags", arm64 "Features").
X86_FLAGS = ("sse2", "sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512dq", "avx512bw",
             "avx512vl", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_fp16")
ARM_FLAGS = ("asimd", "fphp", "asimdhp", "asimddp", "bf16", "i8mm", "sve", "sve2", "sme")


def _cpuinfo() -> List[Dict[str, str]]:
    """/proc/cpuinfo as one dict per logical CPU ([] where there is none)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            text = f.read()
    except OSError:
        return []
    cpus = []
    for block in text.strip().split("\n\n"):
        entry = {}
        for line in block.splitlines():
            key, sep, value = line.partition(":")
            if sep:
                entry[key.strip()] = value.strip()
        if entry:
            cpus.append(entry)
    return cpus


def _sysctl(name: str) -> Optional[str]:
    try:
        r = subprocess.run(["sysctl", "-n", name], capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else None


def describe() -> dict:
    """{'model', 'logical_cores', 'physical_cores', 'usable_cores', 'flags',
    'machine', 'system'}; a field the system does not tell is None."""
    cpus = _cpuinfo()
    model = physical = None
    flags: List[str] = []
    if cpus:
        first = cpus[0]
        model = first.get("model name") or first.get("Model") or first.get("Hardware")
        have = set((first.get("flags") or first.get("Features") or "").split())
        flags = [f for f in X86_FLAGS + ARM_FLAGS if f in have]
        cores = {(c.get("physical id", "0"), c["core id"]) for c in cpus if "core id" in c}
        physical = len(cores) or None
    elif platform.system() == "Darwin":
        model = _sysctl("machdep.cpu.brand_string")
        count = _sysctl("hw.physicalcpu")
        physical = int(count) if count and count.isdigit() else None
        if platform.machine() == "arm64":
            flags = ["asimd"] + [name for name, key in (("fphp", "FEAT_FP16"), ("bf16", "FEAT_BF16"),
                                                        ("i8mm", "FEAT_I8MM"), ("sme", "FEAT_SME"))
                                 if _sysctl(f"hw.optional.arm.{key}") == "1"]
    try:
        usable = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on macOS
        usable = os.cpu_count()
    return {"model": model or platform.processor() or None, "logical_cores": os.cpu_count(),
            "physical_cores": physical, "usable_cores": usable, "flags": flags,
            "machine": platform.machine(), "system": platform.system()}


def summary(info: dict) -> str:
    """One line: model, cores and extensions."""
    cores = f"{info['logical_cores']} logical cores"
    if info["physical_cores"] and info["physical_cores"] != info["logical_cores"]:
        cores += f" ({info['physical_cores']} physical)"
    if info["usable_cores"] and info["usable_cores"] != info["logical_cores"]:
        cores += f", {info['usable_cores']} usable by this process"
    flags = " ".join(info["flags"]) or "not reported"
    return (f"CPU: {info['model'] or 'unknown model'} ({info['system']} {info['machine']}), "
            f"{cores}; extensions: {flags}")
