#!/bin/bash
# Issue 36, on the 16-core device: build main (the checkout's root) and the
# branch (.wt36) into /tmp/fa_main and /tmp/fa (skipped when there), then
# run what $1 names: probe | bench. Logs go to $OUT.
R=$(pwd)
W=$R/.wt36
export CMAKE_BUILD_PARALLEL_LEVEL=8 PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1
if [ ! -f /tmp/fa/flashattn/__init__.py ] || [ ! -f /tmp/fa_main/flashattn/__init__.py ]; then
  (lscpu; gcc --version | head -1; nproc; free -g; uptime) > $OUT/machine.txt 2>&1
  t0=$(date +%s)
  ( python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/fa_main . > $OUT/build_main.log 2>&1 ) &
  ( cd $W && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/fa . > $OUT/build_br.log 2>&1 ) &
  wait
  echo "builds took $(( $(date +%s) - t0 )) s"; tail -3 $OUT/build_main.log $OUT/build_br.log
fi
cd /tmp
main() { PYTHONPATH=/tmp/fa_main:/tmp/site "$@"; }
br() { FLASHATTN_CPU_PROFILE=1 PYTHONPATH=/tmp/fa:/tmp/site "$@"; }
br_plain() { PYTHONPATH=/tmp/fa:/tmp/site "$@"; }
P=$W/bench/issue36_probe.py
case "$1" in
probe)
  main timeout 150 python3 $P --label main --torch --only peak,wake,scaling > $OUT/probe_main.txt 2>&1
  br timeout 150 python3 $P --label br --only wake,scaling,longt,decode > $OUT/probe_br.txt 2>&1
  main timeout 100 python3 $P --label main --only longt,decode >> $OUT/probe_main.txt 2>&1
  grep -h -E "kept|peak|wake|longT|torch.*4096, 16" $OUT/probe_*.txt
  ;;
bench)
  for b in main br_plain; do
    $b timeout 240 python3 -m flashattn bench --threads 16 --skip window,memory,gqa-bwd > $OUT/bench_fp32_$b.txt 2>&1
    $b timeout 90 python3 -m flashattn bench --dtype bf16 --threads 16 > $OUT/bench_bf16_$b.txt 2>&1
  done
  grep -h -E "speedup|lowest|thread pool|geometric|FMA peak" $OUT/bench_*.txt
  ;;
esac
