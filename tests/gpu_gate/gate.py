#!/usr/bin/env python3
"""The GPU resource gate: compiles every Metal kernel instantiation through
the proxy <metal_stdlib> (tests/gpu_gate/proxy) with clang for amdgcn
gfx1100 (wave32) and nvptx sm_80 at -O3, with the plan's threadgroup size
as launch bound, reads each kernel's registers and scratch, prints a table,
and fails if a kernel uses scratch / local memory or more than 128 VGPRs.

A proxy, not Apple's compiler: passing is a necessary condition for a
kernel that keeps its tiles in registers on an Apple GPU, not a sufficient
one (docs/gpu-gate.md).

Which kernels: every entry of metal-sim's kernel table (cpp/sim/kernels.cpp,
`make_kernel("host name", &function)`, read from the preprocessed file, so
macro-generated entries count), each with every threadgroup size the plan
gives it (the plan-threads program); every FA_HOST_NAME of the .metal
sources must be in that table. Or, with --kernel, an explicit list (the
planted kernels that prove the gate can fail).
"""
import argparse
import os
import re
import subprocess
import sys

MAX_VGPRS = 128
TARGETS = {
    "amdgcn": ["-x", "hip", "--cuda-device-only", "--offload-arch=gfx1100", "-mno-wavefrontsize64",
               "-nogpulib", "-nogpuinc", "-Rpass-analysis=kernel-resource-usage"],
    "nvptx": ["-x", "cuda", "--cuda-device-only", "--cuda-gpu-arch=sm_80", "-nocudainc", "-nocudalib",
              "-Wno-unknown-cuda-version"],
}


def run(cmd, **kw):
    return subprocess.run(cmd, capture_output=True, text=True, **kw)


def fail(msg):
    print("gpu gate: " + msg, file=sys.stderr)
    sys.exit(2)  # a broken gate, not a verdict on the kernels


def joined_literals(text):
    return "".join(re.findall(r'"((?:[^"\\]|\\.)*)"', text))


def sim_table(clang, root):
    """(host name, function) pairs of metal-sim's kernel table."""
    src = os.path.join(root, "cpp", "sim", "kernels.cpp")
    inc = ["-I" + os.path.join(root, d) for d in ("cpp/sim/shim", "cpp", "shaders")]
    r = run([clang, "-E", "-P", "-x", "c++", "-std=c++20"] + inc + [src])
    if r.returncode != 0:
        fail("cannot preprocess %s:\n%s" % (src, r.stderr))
    body = r.stdout[r.stdout.find("build_table"):]
    entries = re.findall(r'make_kernel\(\s*((?:"(?:[^"\\]|\\.)*"\s*)+),\s*&\s*([^;]+?)\s*\)\s*\)\s*;', body)
    if not entries:
        fail("no make_kernel(\"name\", &function) entries found in " + src)
    return [(joined_literals(names), fn) for names, fn in entries]


def metallib_functions(clang, root, sources, proxy):
    """The Metal names of the kernels the .metal sources put in the metallib:
    the FA_HOST_NAME of each explicit instantiation, and the name of each
    kernel that is not a template (read from the sources preprocessed with
    `kernel` and FA_HOST_NAME spelled as markers)."""
    names = set()
    for src in sources:
        r = run([clang, "-E", "-P", "-DFA_GATE_LIST_HOST_NAMES"] + TARGETS["nvptx"] +
                ["-I" + proxy, "-I" + os.path.join(root, "shaders"), src])
        if r.returncode != 0:
            fail("cannot preprocess %s:\n%s" % (src, r.stderr))
        text = r.stdout
        for m in re.finditer(r"fa_gate_host_name\(((?:\s*\"[^\"]*\")+)\s*\)", text):
            names.add(joined_literals(m.group(1)))
        for m in re.finditer(r"fa_gate_kernel\s+void\s+(\w+)\s*\(", text):
            before = text[:m.start()].rstrip()
            # `template <...>` before it: a template; `...")` : an instantiation.
            if not before.endswith(">") and not before.endswith(")"):
                names.add(m.group(1))
    return names


def planned_threads(plan_threads):
    r = run([plan_threads])
    if r.returncode != 0:
        fail("%s failed:\n%s" % (plan_threads, r.stderr))
    threads = {}
    for line in r.stdout.split("\n"):
        if line.strip():
            name, n = line.split()
            threads.setdefault(name, []).append(int(n))
    return threads


def symbol(name, threads):
    return "gate_%s_t%d" % (name, threads)


def compile_target(clang, target, work, proxy, root, extra_includes):
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gate_kernels.cu")
    out = os.path.join(work, "gate_kernels.%s.s" % target)
    cmd = ([clang] + TARGETS[target] + ["-O3", "-std=c++17", "-S", "-o", out, "-I" + work, "-I" + proxy,
           "-I" + os.path.dirname(src), "-I" + os.path.join(root, "shaders")] +
           ["-I" + d for d in extra_includes] + ["-Wno-unknown-attributes", src])
    r = run(cmd)
    if r.returncode != 0:
        fail("%s compile failed:\n%s\n%s" % (target, " ".join(cmd), r.stderr))
    with open(out) as f:
        return f.read(), r.stderr


def amdgcn_usage(remarks):
    """Per kernel: VGPRs, SGPRs, scratch bytes per lane, LDS bytes, dynamic stack."""
    usage, current = {}, None
    for line in remarks.split("\n"):
        m = re.search(r"remark: Function Name: (\S+)", line)
        if m:
            current = usage.setdefault(m.group(1), {})
            continue
        m = re.search(r"remark:\s+([A-Za-z ]+?)(?: \[[^\]]*\])?: (\w+) \[-Rpass-analysis", line)
        if m and current is not None:
            key, value = m.group(1).strip(), m.group(2)
            current[key] = int(value) if value.isdigit() else value
    return usage


def nvptx_usage(ptx):
    """Per .entry: bytes of local depot, local loads / stores, calls."""
    usage = {}
    parts = re.split(r"^\s*\.visible\s+\.entry\s+(\w+)\s*\(", ptx, flags=re.M)
    for name, body in zip(parts[1::2], parts[2::2]):
        depot = sum(int(n) for n in re.findall(r"__local_depot\d+\[(\d+)\]", body))
        usage[name] = {
            "local": depot,
            "local_ops": len(re.findall(r"\b(?:ld|st)\.local\b", body)),
            "calls": len(re.findall(r"^\s*call(?:\.uni)?\b", body, flags=re.M)),
        }
    return usage


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clang", required=True)
    ap.add_argument("--root", required=True, help="the project's source tree")
    ap.add_argument("--work", required=True, help="a directory for generated files")
    ap.add_argument("--plan-threads", help="the plan-threads program (kernel list mode)")
    ap.add_argument("--kernel", action="append", default=[],
                    help="NAME=FUNCTION@THREADS[:EXPECT], EXPECT pass|scratch|vgprs (explicit mode)")
    ap.add_argument("--source", action="append", default=[], help=".metal sources (explicit mode)")
    ap.add_argument("--expect-over-budget", action="store_true",
                    help="pass only if the kernels compile and at least one is over budget "
                         "(the one-thread-per-row kernels, until the tiled ones land)")
    a = ap.parse_args()

    root = os.path.abspath(a.root)
    proxy = os.path.join(os.path.dirname(os.path.abspath(__file__)), "proxy")
    os.makedirs(a.work, exist_ok=True)

    kernels = []  # (name, function, threads, expectation or None)
    if a.kernel:
        sources = [os.path.abspath(s) for s in a.source]
        for spec in a.kernel:
            m = re.fullmatch(r"(\w+)=(.+)@(\d+)(?::(pass|scratch|vgprs))?", spec)
            if not m:
                fail("bad --kernel %r" % spec)
            kernels.append((m.group(1), m.group(2), int(m.group(3)), m.group(4)))
    else:
        shaders = os.path.join(root, "shaders")
        sources = sorted(os.path.join(shaders, f) for f in os.listdir(shaders) if f.endswith(".metal"))
        table = sim_table(a.clang, root)
        missing = metallib_functions(a.clang, root, sources, proxy) - {n for n, _ in table}
        if missing:
            fail("kernels in the .metal sources but not in cpp/sim/kernels.cpp's table: " + ", ".join(sorted(missing)))
        threads = planned_threads(a.plan_threads)
        for name, fn in table:
            if name not in threads:
                fail("no plan launches %s: its threadgroup size is unknown" % name)
            for n in threads[name]:
                if n == 0:
                    fail("the plan launches %s with a threadgroup that is not one-dimensional" % name)
                kernels.append((name, fn, n, None))

    with open(os.path.join(a.work, "gate_sources.inc"), "w") as f:
        for s in sources:
            f.write('#include "%s"\n' % s)
    with open(os.path.join(a.work, "gate_list.inc"), "w") as f:
        for name, fn, n, _ in kernels:
            f.write("FA_GATE_KERNEL(%s, %d, %s)\n" % (symbol(name, n), n, fn))

    extra = sorted({os.path.dirname(s) for s in sources} - {os.path.join(root, "shaders")})
    amd_asm, amd_remarks = compile_target(a.clang, "amdgcn", a.work, proxy, root, extra)
    ptx, _ = compile_target(a.clang, "nvptx", a.work, proxy, root, extra)
    amd = amdgcn_usage(amd_remarks)
    nv = nvptx_usage(ptx)
    if ".amdhsa_wavefront_size32 1" not in amd_asm:
        fail("the amdgcn build is not wave32")

    print("GPU resource gate (proxy: clang %s, amdgcn gfx1100 wave32 and nvptx sm_80, -O3; "
          "limits: 0 scratch, <= %d VGPRs)" % (clang_version(a.clang), MAX_VGPRS))
    header = ("kernel", "threads", "VGPRs", "SGPRs", "scratch B/lane", "nvptx local B", "threadgroup B", "verdict")
    rows = []
    over = 0
    wrong = 0
    for name, fn, n, expect in kernels:
        sym = symbol(name, n)
        if sym not in amd or sym not in nv:
            fail("no resource usage for %s in the compiler output" % sym)
        g, p = amd[sym], nv[sym]
        problems = []
        if g.get("ScratchSize", 0) or g.get("VGPRs Spill", 0) or g.get("Dynamic Stack") == "True":
            problems.append("scratch")
        if p["local"] or p["local_ops"]:
            problems.append("nvptx-local")
        if g["VGPRs"] > MAX_VGPRS:
            problems.append("vgprs")
        if p["calls"]:
            problems.append("calls")
        verdict = "ok" if not problems else "OVER: " + ",".join(problems)
        if problems:
            over += 1
        if expect is not None:
            got = "pass" if not problems else ("scratch" if "scratch" in problems else problems[0])
            if got != expect:
                wrong += 1
                verdict += "  (expected %s)" % expect
            else:
                verdict += "  (as expected)"
        rows.append((name, str(n), str(g["VGPRs"]), str(g.get("SGPRs", "?")),
                     str(g.get("ScratchSize", "?")), str(p["local"]),
                     str(g.get("LDS Size", "?")), verdict))
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    for r in [header, tuple("-" * w for w in widths)] + rows:
        print("  ".join(c.ljust(w) if i in (0, 7) else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())

    if a.kernel:
        if wrong:
            print("gpu gate: %d planted kernel(s) not judged as expected" % wrong)
            return 1
        print("gpu gate: every planted kernel judged as expected")
        return 0
    if a.expect_over_budget:
        if over:
            print("gpu gate: %d of %d kernels over budget, as expected for the one-thread-per-row kernels "
                  "(configure with -DFLASHATTN_GPU_GATE_STRICT=ON to require every kernel to pass)" % (over, len(rows)))
            return 0
        print("gpu gate: every kernel is within budget: turn the gate on (FLASHATTN_GPU_GATE_STRICT=ON)")
        return 1
    if over:
        print("gpu gate: FAIL: %d of %d kernels over budget" % (over, len(rows)))
        return 1
    print("gpu gate: all %d kernels within budget" % len(rows))
    return 0


def clang_version(clang):
    m = re.search(r"version (\S+)", run([clang, "--version"]).stdout)
    return m.group(1) if m else "?"


if __name__ == "__main__":
    sys.exit(main())
