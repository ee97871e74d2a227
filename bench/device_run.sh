#!/usr/bin/env bash
# One call on a lent GPU machine: install the carried nvshmem4py wheel, then run the steps named
# in $STEPS (default: tests) with every log written to $OUT (the folder that comes back).
#   tests  the GPU test suite, first half (HEP_TEST_DEVICE=cuda: tests with more ranks than
#          GPUs skip); tests2 the second half (the whole suite takes longer than one call)
#   network  the network put from a Triton kernel through NVSHMEM (one GPU: into its own heap)
#   tests-nodes  the tests across (simulated) nodes: 2 GPUs as 2 nodes of 1, every transfer
#          between them an NVSHMEM put (reference groups, the put, timeouts, the demo)
#   bench  bench/run.py (JSON, Markdown, PNG into $OUT)
#   low-latency  the low-latency mode on one GPU: tests/test_low_latency.py's GPU cases (world 1,
#          graph capture with hooks), then bench/low_latency.py (JSON, Markdown, PNG into $OUT);
#          its tests with ranks sharing the GPU run in the step shared
#          (SHARED_TESTS=tests/test_low_latency.py)
#   experts  the experts' grouped GEMMs on one GPU: tests/test_experts.py (its cases of 2 ranks
#          skip without MPS), then bench/experts_bench.py (JSON, Markdown, PNG into $OUT)
#   low-latency-sweep  bench/low_latency_sweep.py: the low-latency kernels' launch settings
#          ($SWEEP_SETTINGS, default the script's), and the default setting of each tree in
#          $AB_OLD (folders holding src/, as for eager-ab) before and after it, named by the
#          folder: an A/B and its spread in the same call. Results in $OUT/sweep.tgz
#   soak   hybrid-ep soak on every local GPU ($SOAK_ROUNDS rounds, default 10000)
#   soak-token  the same with token rows (Buffer(expand=False))
#   transport  which NVSHMEM transport carries the puts (NVSHMEM_INFO, NVSHMEM_DEBUG=INFO), with
#          P2P allowed and with NVSHMEM_DISABLE_P2P=1 (a remote transport on one host, if any)
#   soak-nodes  the soak with every rank its own node ($SOAK_ROUNDS rounds, default 1000)
#   bench-nodes  S1 and S2 at 8 and 24 SMs, both layouts, with every rank its own node beside
#          one node, in the same run
#   fp8    the FP8 dispatch tests (the quantizer, one rank at hidden 7168, and with 2 or 4 GPUs
#          the groups of 2 and 4 ranks)
#   bench-fp8  $BENCH_SHAPES (default S1,S2) at $BENCH_SMS SMs (default 8), both layouts, bf16 beside FP8 rows
#          (given pair, quantize=True), and the quantizing copy beside a plain copy
#   bench-fp8-ab  the S1 part of bench-fp8 for each tree in $AB_OLD (folders holding src/, see
#          eager-ab; several, space-separated; "." is this tree), then this tree: an A/B of
#          dispatch and combine speed in one call. Results in $OUT/bench-ab.tgz, a folder per run
#          (ab/<folder name>, ab/new for this tree, ab/<name>-again for a tree's second run, to
#          see the spread: one archive, since a call returns at most 8 files); $BENCH_FORMATS
#          (default fp8,mxfp8,nvfp4) picks the block-scaled formats where a tree's bench has
#          --formats (older trees time what they know); bench/compare.py tabulates them
#   eager  bench/eager_ab.py on every local GPU: eager calls back to back (issue 20's targets)
#   eager-ab  bench/eager_ab.py on one GPU for the tree in $AB_OLD (a folder holding src/, e.g.
#          `git archive <commit> src | tar -x -C .ab/old`, carried) and this tree, alternated
#          twice: an A/B of eager speed in one call
#   host   bench/host_profile.py: where the host time of each kind of eager call goes (one GPU;
#          $HOST_SHAPES, default S1,S2; empty: only the launch and torch call costs)
#   tune   hybrid-ep tune for the S1 shape
#   megatron  tests/test_megatron.py on the GPUs: this library in Megatron-Core's MoELayer against
#          its alltoall dispatcher (expert-parallel 1 on one GPU; EP 2 and DP 2 x EP 1 on two;
#          DP 2 x EP 2 on four), and examples/megatron_moe.py (GPTModel losses, both dispatchers)
#   megatron-bench  bench/megatron_bench.py: one MoE layer's forward+backward at DeepSeek-V3 sizes
#          per rank, one rank per GPU: Megatron-Core's alltoall dispatcher, this library
#          (use_hybrid_ep), and its flex dispatcher with the "deepep" and "hybridep" backends on
#          deep_ep (at world 1 "deepep" past its TP x EP > 1 assertion: the script says how);
#          JSON and Markdown into $OUT
#   deepep-bench  bench/deep_ep_bench.py on one GPU: each deep_ep (DeepEP drop-in) call beside
#          the native Buffer call it maps to, S1 and 128 tokens, eager and in CUDA graphs, for
#          each tree in $AB_OLD (folders holding src/, see eager-ab; named by the folder) and
#          then this tree (named $HEP_COMMIT), each in its own process, then their ratios side
#          by side (--compare: .md and .png in $OUT). Each tree's JSON, Markdown and PNG in
#          $OUT/deepep-bench.tgz (deepep/<name>/, <name>-again for a tree's second run)
#   shared  the whole GPU test suite with every multi-rank case, ranks sharing the GPUs under CUDA
#          MPS (started before the step, stopped after it): W2, W4, W8 in one node, 2x1, 2x2, 2x4,
#          4x2 across simulated nodes, FP8, autograd, timeouts, validation, the fuzz. $SHARED_TESTS
#          (default: tests/) picks files or tests, in order; $SHARED_BUDGET seconds (default 450)
#          after which tests are skipped (the report is kept). One session: MPS has one daemon per
#          machine (sessions of pytest-xdist side by side broke it at 4d2f6c7). The MPS control
#          log is copied into $OUT. The fuzz draws the same scenarios in every call
#          ($HYPOTHESIS_SEED, default 1203; the soaks' seeds are fixed too), so that the builds
#          one call saves (SAVE_TRITON_CACHE) serve the next: its scenarios compile more than one
#          call can (2026-12-03-1xH200-shared-f0b909e-validation.log)
# Triton's cache lives in /tmp/triton-cache: restored from .triton-cache/ where a call carries it
# (the parts $OUT/triton-cache-<label>.txz.* of earlier calls, any number of labels), and when
# SAVE_TRITON_CACHE=1 the builds this call added are saved into $OUT under the label
# $CACHE_LABEL (default: the time), so that the calls that split a suite each add theirs and a
# later call (or session) carries them all (a build compiles in seconds, tens of seconds across
# nodes; it is reused only while the kernels' source is unchanged).
# Saved of each build: what a cache hit reads (bench/slim_triton_cache.py deletes the IR and
# lists the rest in the build's group file): the 289 builds of
# 2026-12-03-1xH200-soak-shared-0810ddd.log were 35.5 MB with xz, 5.5 MB so.
# xz, not gzip: at e332f1c the cache of one call was 628 MB, 86 MB gzipped, in 6 parts, of which
# only 4 came back (a call returns 8 files of at most 16 MiB); xz packs such a cache 2.2x
# smaller (310 MB of sm_90 builds here: 47 MB gzipped, 21 MB with xz).
# pytest runs the node ids of one file together, in the file's order, whatever $SHARED_TESTS's
# order, and on GPUs every test that runs ranks before those that use the GPU in pytest's own
# process (tests/conftest.py): a file's tests ahead of a budget must come first in both.
#   soak-shared  under MPS: 1000 soak rounds at 4 ranks in one node and at 2 nodes of 2, each with
#          expert-major and token rows (the four at once), and hybrid-ep demo with 8 ranks (1024
#          tokens per rank) once the one-node soaks end, beside the two-node soaks
# Each step's processes record the kernel builds they take (HEP_RECORD_BUILDS, see
# tools/prebuild.py), returned in $OUT/builds.txz as builds/<step>/ (a file per process);
# merged here into bench/builds/<step>.jsonl.xz (`hybrid-ep prebuild [that file] builds/<step>
# --merge-into that file`) and committed, they are compiled before the steps that recorded
# them, side by side on every core (`hybrid-ep prebuild`, unless PREBUILD=0), where the steps
# would compile them one after another at their first launches, for at most $PREBUILD_TIMEOUT
# seconds (default 300: what it has built by then stays in the cache, which SAVE_TRITON_CACHE
# keeps). A record holds a kernel's arguments, not its source: it serves after the kernels'
# code has changed too.
#   deepep-programs  DeepEP's own test_low_latency.py and test_intranode.py through deep_ep
#          (tests/deep_ep_programs.py), $DEEPEP_RANKS ranks (default 2) sharing the GPU under MPS,
#          from the copy of DeepEP's files in build/deepep (carry it: docs/deep_ep.md says how to
#          make it; $DEEPEP_PROGRAMS, default "low_latency intranode", picks them); with
#          DEEPEP_SHRINK=1 also test_low_latency.py --shrink-test on 8 ranks, $DEEPEP_SHRINK_RUNS
#          times (default 1: its failures come in some runs and not others)
#          (three of its ranks stop, and the others wait deep_ep.Buffer's timeout_s for each:
#          $DEEPEP_PEER_TIMEOUT_S, default 20 s; raise STEP_TIMEOUT)
#   megatron-flex  Megatron-Core's flex dispatcher on deep_ep (tests/test_megatron.py, the flex
#          cases, or those in $FLEX_CASES), each case in its own pytest under a fresh MPS daemon:
#          a case's ranks, ended with it, can leave the daemon refusing the next case's
# megatron-core travels as a wheel in .whl-megatron/ (carry it too), installed beside nvshmem4py,
# or as its package folder in .megatron-site/megatron (ignored; carry it), put on the path.
# Usage there: OUT=... STEPS="tests bench" HEP_COMMIT=<hash> bash bench/device_run.sh
# (HEP_COMMIT as a literal from here: the machine's git reported 4dccc89 for a41979f's tree.)
set -uo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl $(ls .whl-megatron/*.whl 2>/dev/null) || exit 1
MEGATRON_SITE=""
[ -d .megatron-site ] && MEGATRON_SITE=$PWD/.megatron-site:
export PYTHONPATH=/tmp/site:$MEGATRON_SITE$PWD/src PYTHONUNBUFFERED=1
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export TRITON_CACHE_DIR=/tmp/triton-cache
mkdir -p "$TRITON_CACHE_DIR"
# (gzip where the machine has no xz: parts triton-cache-<label>.tgz.*)
PACK=(xz -T0 -6) PACKED=txz
command -v xz > /dev/null || PACK=(gzip -6) PACKED=tgz
for packed in $(ls .triton-cache 2> /dev/null | sed -n 's/^\(triton-cache.*\.\(txz\|tgz\)\)\.[a-z]*$/\1/p' \
                | sort -u); do
    case $packed in *.txz) unpack=xz ;; *) unpack=gzip ;; esac
    cat .triton-cache/"$packed".* | "$unpack" -d | tar xf - -C /tmp
done
touch /tmp/triton-cache-restored  # builds newer than this are the ones this call adds
: "${OUT:?set OUT}" "${STEPS:=tests}" "${STEP_TIMEOUT:=240}"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpus.txt" 2>&1
# Triton's cache key begins with this digest (Triton's wheel, for this Python): a cache prebuilt
# on another machine (hybrid-ep prebuild --arch) serves here only where that machine's is equal.
python3 -c 'from hybrid_ep_triton.tools.prebuild import triton_key_digest
print("triton_key", triton_key_digest())' >> "$OUT/gpus.txt" 2>&1
MPS_DIRS=(CUDA_MPS_PIPE_DIRECTORY=/tmp/mps CUDA_MPS_LOG_DIRECTORY=/tmp/mpslog)
mps() {  # start | stop the MPS control daemon (the compute mode is left as it is)
    if [ "$1" = start ]; then
        mkdir -p /tmp/mps /tmp/mpslog && env "${MPS_DIRS[@]}" setsid nvidia-cuda-mps-control -d
    else
        echo quit | env "${MPS_DIRS[@]}" timeout 60 nvidia-cuda-mps-control
    fi
}
# Sizes where the reference (all_to_all through gloo, over the host) keeps up: 512 tokens of
# 2048 channels, top-8 of 64 experts.
# The four soaks run at once, their 16 ranks at 6% of the SMs each (96% in all: no launch waits
# for programs the GPU cannot make resident; 6 SMs a context, which the Buffer's default
# num_sms then takes), so that their builds, mostly different, compile side by side on the
# host's cores (at 2026-12-03 the first soak alone compiled 289 builds in 250 rounds, about
# 500 s; on 2026-12-04 the four, uncached, compiled for 440 s before round 50: 204 distinct
# builds, since in bench/builds/soak-shared.jsonl.xz for the prebuild), each reporting every 10
# rounds; each soak's log is appended to the step's once the step is over. A soak is its own
# process group (setsid), so that the step's timeout ends its ranks with it. The demo waits for
# the one-node soaks only (the two-node ones, whose builds link NVSHMEM and take 16 s each
# there, compile for longer), its 8 ranks at 6% too, beside the two-node soaks' 8.
# $SOAK_LAYOUTS (default "one-node two-node") picks the soaks' layouts; the demo runs with the
# one-node soaks.
SOAK_SHARED='pids=(); trap "for pid in \${pids[*]}; do kill -- -\$pid; done; exit 143" TERM; n=0
    one=(); two=(); for layout in ${SOAK_LAYOUTS:-one-node two-node}; do nodes=""
    [ $layout = two-node ] && nodes="--ranks-per-node 2"; for rows in "" --token-rows; do
    n=$((n + 1)); CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=6 setsid python3 -m hybrid_ep_triton soak \
    --device cuda --ranks 4 --rounds 1000 --tokens 512 --hidden 2048 --experts 64 --topk 8 \
    --progress-every 10 $nodes $rows > /tmp/soak-$n.log 2>&1 & pids+=($!)
    if [ $layout = two-node ]; then two+=($!); else one+=($!); fi; done; done; rc=0
    for pid in "${one[@]}"; do wait $pid || rc=1; done
    [ ${#one[@]} = 0 ] || CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=6 python3 -m hybrid_ep_triton demo \
    --device cuda --ranks 8 --tokens 1024 || rc=1
    for pid in "${two[@]}"; do wait $pid || rc=1; done; exit $rc'
records=()
for step in $STEPS; do [ -f bench/builds/$step.jsonl.xz ] && records+=(bench/builds/$step.jsonl.xz); done
if [ ${#records[@]} -gt 0 ] && [ "${PREBUILD:-1}" = 1 ]; then
    echo "== prebuild: ${records[*]}" | tee -a "$OUT/summary.txt"
    timeout "${PREBUILD_TIMEOUT:-300}" python3 -m hybrid_ep_triton prebuild \
        --workers "$(nproc)" "${records[@]}" 2>&1 | tail -n 20 | tee -a "$OUT/summary.txt"
fi
status=0
for step in $STEPS; do
    export HEP_RECORD_BUILDS=/tmp/builds/$step
    case $step in
        tests) cmd=(env HEP_TEST_DEVICE=cuda HEP_TEST_TIMEOUT=120 python3 -m pytest -q -rs
                    tests/test_streams.py tests/test_compile.py tests/test_moe.py
                    tests/test_dispatch_combine.py) ;;
        tests2) cmd=(env HEP_TEST_DEVICE=cuda HEP_TEST_TIMEOUT=120 python3 -m pytest -q -rs
                     tests/test_heap.py tests/test_validation.py tests/test_autograd.py
                     tests/test_primitives.py tests/test_kernel_launch.py) ;;
        network) cmd=(env HEP_TEST_DEVICE=cuda HEP_TEST_TIMEOUT=120 python3 -m pytest -q -rs
                      tests/test_network.py) ;;
        tests-nodes) cmd=(env HEP_TEST_DEVICE=cuda HEP_TEST_TIMEOUT=120 python3 -m pytest -q -rs
                          tests/test_network.py tests/test_dispatch_combine.py tests/test_heap.py
                          tests/test_cli.py -k "x1 or network or two_nodes") ;;
        bench) cmd=(python3 bench/run.py --iters 50 --warmup 10 --timeout 400 --out "$OUT") ;;
        low-latency) cmd=(bash -c 'HEP_TEST_DEVICE=cuda HEP_TEST_TIMEOUT=120 python3 -m pytest \
                          -q -rs -p no:cacheprovider tests/test_low_latency.py -m gpu; rc=$?; \
                          python3 bench/low_latency.py --out "$OUT" || rc=1; exit $rc') ;;
        experts) cmd=(bash -c 'HEP_TEST_DEVICE=cuda HEP_TEST_TIMEOUT=120 python3 -m pytest -q -rs \
                      -p no:cacheprovider tests/test_experts.py; rc=$?; \
                      python3 bench/experts_bench.py --out "$OUT" || rc=1; exit $rc') ;;
        low-latency-sweep) cmd=(bash -c 'rc=0; old() { for tree in ${AB_OLD:-}; do \
                                HEP_COMMIT=$(basename $tree) PYTHONPATH=/tmp/site:$tree/src \
                                python3 bench/low_latency_sweep.py --settings default \
                                --out $OUT/sweep/$1 || rc=1; done; }; old before; \
                                python3 bench/low_latency_sweep.py --out $OUT/sweep/new \
                                ${SWEEP_SETTINGS:+--settings "$SWEEP_SETTINGS"} || rc=1; \
                                old after; tar czf $OUT/sweep.tgz -C $OUT sweep \
                                && rm -r $OUT/sweep; exit $rc') ;;
        soak) cmd=(python3 -m hybrid_ep_triton soak --device cuda --rounds "${SOAK_ROUNDS:-10000}") ;;
        soak-token) cmd=(python3 -m hybrid_ep_triton soak --device cuda --token-rows
                         --rounds "${SOAK_ROUNDS:-10000}") ;;
        transport) cmd=(bash -c 'for p2p in 0 1; do echo "== NVSHMEM_DISABLE_P2P=$p2p";
                        NVSHMEM_DISABLE_P2P=$p2p NVSHMEM_INFO=1 NVSHMEM_DEBUG=INFO
                        HEP_TEST_DEVICE=cuda HEP_TEST_TIMEOUT=120 python3 -m pytest -q -rs -s
                        tests/test_network.py -k lands; done') ;;
        soak-nodes) cmd=(python3 -m hybrid_ep_triton soak --device cuda --ranks-per-node 1
                         --rounds "${SOAK_ROUNDS:-1000}") ;;
        bench-nodes) cmd=(python3 bench/run.py --iters 50 --warmup 10 --timeout 400
                          --shapes S1,S2 --sms 8,24 --spot-sms 8,24 --ranks-per-node 1
                          --out "$OUT") ;;
        fp8) cmd=(env HEP_TEST_DEVICE=cuda HEP_TEST_TIMEOUT=120 python3 -m pytest -q -rs
                  tests/test_fp8.py) ;;
        bench-fp8) cmd=(python3 bench/run.py --iters 50 --warmup 10 --timeout 400
                        --shapes "${BENCH_SHAPES:-S1,S2}" --sms "${BENCH_SMS:-8}" --spot-sms "${BENCH_SMS:-8}"
                        --out "$OUT") ;;
        bench-fp8-ab) cmd=(bash -c 'rc=0; for tree in $AB_OLD .; do src=$tree/src; \
                           label=$(basename $tree); [ $tree = . ] && label=new; \
                           [ -e $OUT/ab/$label ] && label=$label-again; mkdir -p $OUT/ab/$label; \
                           formats=(); grep -q -- --formats $src/hybrid_ep_triton/tools/cli.py \
                           && formats=(--formats "${BENCH_FORMATS-fp8,mxfp8,nvfp4}"); \
                           commit=$HEP_COMMIT; [ $tree = . ] || commit=$(basename $tree); \
                           start=$SECONDS; HEP_COMMIT=$commit PYTHONPATH=/tmp/site:$src \
                           python3 bench/run.py --iters 50 --warmup 10 --timeout 400 --shapes S1 --sms 8 \
                           --spot-sms 8 "${formats[@]}" --out $OUT/ab/$label || { rc=1; break; }; \
                           echo "== tree $tree ($label): $((SECONDS - start)) s"; done; \
                           tar czf $OUT/bench-ab.tgz -C $OUT ab && rm -r $OUT/ab; exit $rc') ;;
        eager) cmd=(python3 bench/eager_ab.py --ranks 0 --label "${HEP_COMMIT:-}") ;;
        eager-ab) cmd=(bash -c 'for run in 1 2; do for tree in old new; do src=$PWD/src; \
                       if [ $tree = old ]; then src=$AB_OLD/src; fi; \
                       PYTHONPATH=/tmp/site:$src python3 bench/eager_ab.py \
                       --label "$tree run$run" || exit 1; done; done') ;;
        host) cmd=(python3 bench/host_profile.py --shapes "${HOST_SHAPES-S1,S2}") ;;
        tune) cmd=(python3 -m hybrid_ep_triton tune) ;;
        megatron) cmd=(bash -c 'HEP_TEST_DEVICE=cuda HEP_TEST_TIMEOUT=300 python3 -m pytest \
                       -q -rs -s -p no:warnings tests/test_megatron.py \
                       && python3 examples/megatron_moe.py --steps 10') ;;
        megatron-bench) cmd=(python3 bench/megatron_bench.py --out "$OUT") ;;
        deepep-bench) cmd=(bash -c 'rc=0; results=(); for tree in ${AB_OLD:-} .; do \
                      src=(--src $tree); name=$(basename $tree); \
                      [ $tree = . ] && { src=(); name=${HEP_COMMIT:-new}; }; \
                      [ -e $OUT/deepep/$name ] && name=$name-again; start=$SECONDS; \
                      python3 bench/deep_ep_bench.py "${src[@]}" --label $name \
                      --out $OUT/deepep/$name || rc=1; results+=($OUT/deepep/$name/*.json); \
                      echo "== tree $tree ($name): $((SECONDS - start)) s"; \
                      tar czf $OUT/deepep-bench.tgz -C $OUT deepep; done; \
                      python3 bench/deep_ep_bench.py --compare "${results[@]}" --out $OUT || rc=1; \
                      rm -r $OUT/deepep; exit $rc') ;;
        shared) cmd=(env "${MPS_DIRS[@]}" HEP_TEST_DEVICE=cuda HEP_TEST_TIMEOUT="${HEP_TEST_TIMEOUT:-300}"
                     HEP_TEST_BUDGET_S="${SHARED_BUDGET:-450}" HEP_TEST_MAX_POOLS=6
                     python3 -m pytest -rs -v --durations=40 -p no:cacheprovider
                     --hypothesis-seed="${HYPOTHESIS_SEED:-1203}" ${SHARED_TESTS:-tests}) ;;
        soak-shared) cmd=(env "${MPS_DIRS[@]}" bash -c "$SOAK_SHARED") ;;
        deepep-programs) cmd=(env "${MPS_DIRS[@]}" bash -c 'rc=0; sizes="--num-tokens 64 \
                              --hidden 2048 --num-topk 4 --num-experts 16"; \
                              for program in ${DEEPEP_PROGRAMS-low_latency intranode}; do echo "== $program"; \
                              python3 tests/deep_ep_programs.py build/deepep --program $program \
                              --ranks ${DEEPEP_RANKS:-2} $sizes || rc=1; done; \
                              if [ "${DEEPEP_SHRINK:-0}" = 1 ]; then \
                              for run in $(seq ${DEEPEP_SHRINK_RUNS:-1}); do echo "== shrink $run"; \
                              python3 tests/deep_ep_programs.py build/deepep --program low_latency \
                              --ranks 8 --num-tokens 64 --hidden 2048 --num-topk 4 \
                              --num-experts 32 --shrink-test \
                              --peer-timeout-s ${DEEPEP_PEER_TIMEOUT_S:-20} || rc=1; done; fi; exit $rc') ;;
        megatron-flex) cmd=(env "${MPS_DIRS[@]}" bash -c 'rc=0; cases=${FLEX_CASES:-"deepep-ep2 \
                            hybridep-ep2 hybridep-dp2_ep1 hybridep-ep1 deepep-dp2_ep2 \
                            hybridep-dp2_ep2 deepep-ep4 hybridep-ep4"}; for case in $cases; do \
                            echo quit | timeout 20 nvidia-cuda-mps-control > /dev/null 2>&1; \
                            mkdir -p /tmp/mps /tmp/mpslog && setsid nvidia-cuda-mps-control -d; \
                            HEP_TEST_DEVICE=cuda HEP_TEST_TIMEOUT=${HEP_TEST_TIMEOUT:-150} python3 -m pytest -q -rs \
                            -p no:cacheprovider "tests/test_megatron.py::test_megatron_flex_dispatcher_on_deep_ep_matches[$case]" \
                            || rc=1; done; echo quit | timeout 20 nvidia-cuda-mps-control; exit $rc') ;;
        *) echo "unknown step $step" >&2; exit 2 ;;
    esac
    echo "== $step: ${cmd[*]}" | tee -a "$OUT/summary.txt"
    case $step in shared|soak-shared|deepep-programs) mps start ;; esac
    timeout "$STEP_TIMEOUT" "${cmd[@]}" > "$OUT/$step.log" 2>&1
    rc=$?
    case $step in shared|soak-shared|deepep-programs) mps stop; cp /tmp/mpslog/control.log "$OUT/$step-mps.log" ;; esac
    case $step in soak-shared) for log in /tmp/soak-[1-4].log; do echo "== $log"; cat "$log"
                               done >> "$OUT/$step.log" ;; esac
    echo "== $step: exit $rc" | tee -a "$OUT/summary.txt"
    tail -3 "$OUT/$step.log" | tee -a "$OUT/summary.txt"
    [ $rc -ne 0 ] && status=$rc
done
[ -d /tmp/builds ] && tar cf - -C /tmp builds | xz -T0 > "$OUT/builds.txz"
if [ "${SAVE_TRITON_CACHE:-0}" = 1 ]; then
    saved="$OUT/triton-cache-${CACHE_LABEL:-$(date +%m%d-%H%M%S)}.$PACKED"
    (cd /tmp && find triton-cache -mindepth 1 -maxdepth 1 -newer triton-cache-restored -print0 \
        | xargs -0 -r python3 "$REPO/bench/slim_triton_cache.py" >> "$OUT/summary.txt" \
        && find triton-cache -mindepth 1 -maxdepth 1 -newer triton-cache-restored -print0 \
        | tar cf - --null -T -) | "${PACK[@]}" | split -b 15m - "$saved."
    du -sh "$TRITON_CACHE_DIR" "$saved".* | tee -a "$OUT/summary.txt"
fi
# A call returns at most 8 files, the first by name: past that, the logs travel in one archive
# named to come first (a step's log was lost so).
if [ "$(find "$OUT" -maxdepth 1 -type f | wc -l)" -gt 8 ]; then
    (cd "$OUT" && tar czf 00-logs.tgz gpus.txt summary.txt ./*.log && rm -f gpus.txt ./*.log)
fi
exit $status
