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
macro-generated entries count), with every threadgroup size and every set
of function-constant values the plan launches it with (the
gpu_gate_plan_launches program), the constants folded as Metal folds them,
and once more with them opaque (the kernel for any value). Every kernel the
.metal sources put in the metallib must be in that table. Or, with --kernel, an explicit list (the
planted kernels that prove the gate can fail).
"""
import argparse
import concurrent.futures
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


def planned_launches(program):
    """{kernel: [(threads, constants)]}, constants a tuple of (index, bits)."""
    r = run([program])
    if r.returncode != 0:
        fail("%s failed:\n%s" % (program, r.stderr))
    launches = {}
    for line in r.stdout.split("\n"):
        if not line.strip():
            continue
        name, threads, constants = line.split()
        pairs = () if constants == "-" else tuple(tuple(int(x) for x in c.split("=")) for c in constants.split(","))
        launches.setdefault(name, []).append((int(threads), pairs))
    return launches


def describe(constants):
    if constants is None:
        return "any"
    return ",".join("%d=%d" % c for c in constants) or "-"


def symbol(job):
    tail = "" if job["constants"] is None else "_c" + "_".join("%dx%d" % c for c in job["constants"])
    return "gate_%s_t%d%s" % (job["name"], job["threads"], tail)


def compile_target(clang, target, unit_dir, proxy, root, extra_includes, folded):
    src = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gate_kernels.cu")
    out = os.path.join(unit_dir, "gate_kernels.%s.s" % target)
    cmd = ([clang] + TARGETS[target] + ["-O3", "-std=c++17", "-S", "-o", out, "-I" + unit_dir, "-I" + proxy,
           "-I" + os.path.dirname(src), "-I" + os.path.join(root, "shaders")] +
           ["-I" + d for d in extra_includes] + (["-DFA_GATE_FOLD_CONSTANTS"] if folded else []) +
           ["-Wno-unknown-attributes", src])
    r = run(cmd)
    if r.returncode != 0:
        fail("%s compile failed:\n%s\n%s" % (target, " ".join(cmd), r.stderr))
    with open(out) as f:
        return f.read(), r.stderr


def amdgcn_usage(remarks):
    """Per kernel: VGPRs, SGPRs, ScratchSize (bytes per lane), LDS Size,
    VGPRs Spill, Dynamic Stack, as -Rpass-analysis=kernel-resource-usage
    reports them."""
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
    """Per .entry: bytes of local depot, local loads / stores, calls, and the
    function constants it reads opaquely."""
    usage = {}
    parts = re.split(r"^\s*\.visible\s+\.entry\s+(\w+)\s*\(", ptx, flags=re.M)
    for name, body in zip(parts[1::2], parts[2::2]):
        depot = sum(int(n) for n in re.findall(r"__local_depot\d+\[(\d+)\]", body))
        usage[name] = {
            "local": depot,
            "local_ops": len(re.findall(r"\b(?:ld|st)\.local\b", body)),
            "calls": len(re.findall(r"^\s*call(?:\.uni)?\b", body, flags=re.M)),
            "opaque_constants": sorted({int(i) for i in re.findall(r"// function_constant (\d+)", body)}),
        }
    return usage


def judge(job, g, p):
    problems = []
    if g.get("ScratchSize", 0) or g.get("VGPRs Spill", 0) or g.get("Dynamic Stack") == "True":
        problems.append("scratch")
    if p["local"] or p["local_ops"]:
        problems.append("nvptx-local")
    if g["VGPRs"] > MAX_VGPRS:
        problems.append("vgprs")
    if p["calls"]:
        problems.append("calls")
    if job["constants"] is not None and p["opaque_constants"]:
        problems.append("unset-constant " + ",".join(str(i) for i in p["opaque_constants"]))
    return problems


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clang", required=True)
    ap.add_argument("--root", required=True, help="the project's source tree")
    ap.add_argument("--work", required=True, help="a directory for generated files")
    ap.add_argument("--plan-launches", help="the gpu_gate_plan_launches program (kernel list mode)")
    ap.add_argument("--kernel", action="append", default=[],
                    help="NAME=FUNCTION@THREADS[/INDEX=BITS,...][:EXPECT] (explicit mode): the constants "
                         "folded (none after '/': every one unset), else opaque; EXPECT the verdict, "
                         "pass|scratch|vgprs|unset-constant")
    ap.add_argument("--source", action="append", default=[], help=".metal sources (explicit mode)")
    ap.add_argument("--expect-over-budget", action="store_true",
                    help="pass only if the kernels compile and at least one is over budget "
                         "(the one-thread-per-row kernels, until the tiled ones land)")
    a = ap.parse_args()

    root = os.path.abspath(a.root)
    proxy = os.path.join(os.path.dirname(os.path.abspath(__file__)), "proxy")
    os.makedirs(a.work, exist_ok=True)

    # One job per compiled kernel: constants None = opaque, else folded values.
    jobs = []
    if a.kernel:
        sources = [os.path.abspath(s) for s in a.source]
        for spec in a.kernel:
            m = re.fullmatch(r"(\w+)=(.+?)@(\d+)(?:/((?:\d+=\d+,?)*))?(?::(pass|scratch|vgprs|unset-constant))?", spec)
            if not m:
                fail("bad --kernel %r" % spec)
            constants = None if m.group(4) is None else tuple(
                tuple(int(x) for x in c.split("=")) for c in m.group(4).split(",") if c)
            jobs.append(dict(name=m.group(1), fn=m.group(2), threads=int(m.group(3)), constants=constants,
                             expect=m.group(5)))
    else:
        if not a.plan_launches:
            fail("--plan-launches or --kernel is required")
        shaders = os.path.join(root, "shaders")
        sources = sorted(os.path.join(shaders, f) for f in os.listdir(shaders) if f.endswith(".metal"))
        table = sim_table(a.clang, root)
        missing = metallib_functions(a.clang, root, sources, proxy) - {n for n, _ in table}
        if missing:
            fail("kernels in the .metal sources but not in cpp/sim/kernels.cpp's table: " + ", ".join(sorted(missing)))
        launches = planned_launches(a.plan_launches)
        for name, fn in table:
            if name not in launches:
                fail("no plan launches %s: its threadgroup size and constants are unknown" % name)
            for threads in sorted({t for t, _ in launches[name]}):
                if threads == 0:
                    fail("the plan launches %s with a threadgroup that is not one-dimensional" % name)
                sets = sorted({c for t, c in launches[name] if t == threads})
                if any(sets):  # the kernel as it is for any value, too
                    jobs.append(dict(name=name, fn=fn, threads=threads, constants=None, expect=None))
                for c in sets:
                    jobs.append(dict(name=name, fn=fn, threads=threads, constants=c, expect=None))

    # One translation unit per set of folded constants, one for the opaque.
    units = {}
    for job in jobs:
        units.setdefault(job["constants"], []).append(job)
    extra = sorted({os.path.dirname(s) for s in sources} - {os.path.join(root, "shaders")})
    # The units' compiles are independent: FLASHATTN_JOBS of them at a time
    # (the gate is most of the C++ tests' time in CI).
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, int(os.environ.get("FLASHATTN_JOBS", "2"))))
    compiled = []
    for n, (constants, unit_jobs) in enumerate(sorted(units.items(), key=lambda u: (u[0] is not None, u[0] or ()))):
        unit_dir = os.path.join(a.work, "unit%d" % n)
        os.makedirs(unit_dir, exist_ok=True)
        with open(os.path.join(unit_dir, "gate_sources.inc"), "w") as f:
            f.writelines('#include "%s"\n' % s for s in sources)
        with open(os.path.join(unit_dir, "gate_constants.inc"), "w") as f:
            f.writelines("FA_GATE_CONSTANT(%d, %du)\n" % c for c in (constants or ()))
        with open(os.path.join(unit_dir, "gate_list.inc"), "w") as f:
            f.writelines("FA_GATE_KERNEL(%s, %d, %s)\n" % (symbol(j), j["threads"], j["fn"]) for j in unit_jobs)
        compiled.append((unit_jobs, [pool.submit(compile_target, a.clang, target, unit_dir, proxy, root, extra,
                                                 constants is not None) for target in ("amdgcn", "nvptx")]))
    for unit_jobs, (amd_build, nv_build) in compiled:
        (amd_asm, amd_remarks), (ptx, _) = amd_build.result(), nv_build.result()
        if ".amdhsa_wavefront_size32 1" not in amd_asm:
            fail("the amdgcn build is not wave32")
        amd, nv = amdgcn_usage(amd_remarks), nvptx_usage(ptx)
        for j in unit_jobs:
            if symbol(j) not in amd or symbol(j) not in nv:
                fail("no resource usage for %s in the compiler output" % symbol(j))
            j["amd"], j["nv"] = amd[symbol(j)], nv[symbol(j)]

    print("GPU resource gate (proxy: clang %s, amdgcn gfx1100 wave32 and nvptx sm_80, -O3; "
          "limits: 0 scratch, <= %d VGPRs; constants: 'any' = opaque, else index=bits as the plan "
          "launches it)" % (clang_version(a.clang), MAX_VGPRS))
    header = ("kernel", "threads", "constants", "VGPRs", "SGPRs", "scratch B/lane", "nvptx local B",
              "threadgroup B", "verdict")
    rows, over, wrong = [], set(), 0
    for j in jobs:
        g, p = j["amd"], j["nv"]
        problems = judge(j, g, p)
        verdict = "ok" if not problems else "OVER: " + ",".join(problems)
        if problems:
            over.add(j["name"])
        if j["expect"] is not None:
            got = "pass" if not problems else ("scratch" if "scratch" in problems else problems[0].split()[0])
            if got != j["expect"]:
                wrong += 1
                verdict += "  (expected %s)" % j["expect"]
            else:
                verdict += "  (as expected)"
        rows.append((j["name"], str(j["threads"]), describe(j["constants"]), str(g["VGPRs"]),
                     str(g.get("SGPRs", "?")), str(g.get("ScratchSize", "?")), str(p["local"]),
                     str(g.get("LDS Size", "?")), verdict))
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    left = (0, 2, 8)
    for r in [header, tuple("-" * w for w in widths)] + rows:
        print("  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))).rstrip())

    kernels = len({j["name"] for j in jobs})
    if a.kernel:
        if wrong:
            print("gpu gate: %d planted kernel(s) not judged as expected" % wrong)
            return 1
        print("gpu gate: every planted kernel judged as expected")
        return 0
    if a.expect_over_budget:
        if over:
            print("gpu gate: %d of %d kernels over budget, as expected for the one-thread-per-row kernels "
                  "(configure with -DFLASHATTN_GPU_GATE_STRICT=ON to require every kernel to pass)" % (len(over), kernels))
            return 0
        print("gpu gate: every kernel is within budget: turn the gate on (FLASHATTN_GPU_GATE_STRICT=ON)")
        return 1
    if over:
        print("gpu gate: FAIL: %d of %d kernels over budget: %s" % (len(over), kernels, ", ".join(sorted(over))))
        return 1
    print("gpu gate: all %d kernels within budget" % kernels)
    return 0


def clang_version(clang):
    m = re.search(r"version (\S+)", run([clang, "--version"]).stdout)
    return m.group(1) if m else "?"


if __name__ == "__main__":
    sys.exit(main())
