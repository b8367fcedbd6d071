#!/bin/bash
# Issue 36, on the 16-core device: build main (the checkout's root) and the
# branch (.wt36) into /tmp/fa_main and /tmp/fa (skipped when there), then
# run what $1 names: probe | bench | tests | ab. Logs go to $OUT.
R=$(pwd)
W=$R/.wt36
export CMAKE_BUILD_PARALLEL_LEVEL=8 PYTHONUNBUFFERED=1 OPENBLAS_NUM_THREADS=1
# (each build only where it is missing: rm -rf /tmp/fa for a new branch build)
[ -f $OUT/machine.txt ] || (lscpu; gcc --version | head -1; nproc; free -g; uptime) > $OUT/machine.txt 2>&1
t0=$(date +%s)
[ -f /tmp/fa_main/flashattn/__init__.py ] || ( python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/fa_main . > $OUT/build_main.log 2>&1 ) &
[ -f /tmp/fa/flashattn/__init__.py ] || ( cd $W && python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/fa . > $OUT/build_br.log 2>&1 ) &
wait
[ $(( $(date +%s) - t0 )) -gt 2 ] && echo "builds took $(( $(date +%s) - t0 )) s" && tail -n 3 $OUT/build_*.log
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
stages)
  # $2: shape, $3: threads: the branch build's per-stage cycles and pool profile
  FLASHATTN_STAGES=1 br timeout 120 python3 $W/bench/issue36_stages.py --shape $2 --threads $3 \
    > $OUT/stages_${2//,/_}_t$3.txt 2>&1; cat $OUT/stages_${2//,/_}_t$3.txt
  ;;
tests)
  # the branch's bfloat16 (AMX) and float32 cpu cases, from its own tests
  cd $W && br_plain timeout ${TESTS_S:-200} python3 -m pytest -q -x -p no:cacheprovider \
    tests/python/test_backward.py tests/python/test_numerics.py tests/python/test_nonfinite.py \
    tests/python/test_score_options.py tests/python/test_dtypes.py tests/python/test_sizes.py \
    -k "cpu and not sim" > $OUT/pytest_br.txt 2>&1; echo "pytest rc $?"; tail -5 $OUT/pytest_br.txt
  cd /tmp
  ;;
ab)
  # $2: dtype, $3: threads list, $4: shapes (issue,table); main and the branch
  # in turn, twice, each against torch in its own process
  A=$W/bench/issue36_ab.py
  for round in $(seq ${AB_ROUNDS:-2}); do
    for b in main br_plain; do
      $b timeout ${AB_S:-150} python3 $A --label "$b#$round" --dtype $2 --threads $3 --shapes $4 $AB_ARGS \
        >> $OUT/ab_$2_${4//,/_}_t${3//,/_}.txt 2>&1
    done
  done
  cat $OUT/ab_$2_${4//,/_}_t${3//,/_}.txt
  ;;
esac
