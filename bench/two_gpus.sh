#!/usr/bin/env bash
# Issues 50 and 51 on two GPUs of one host, in the order a session with little GPU time should
# spend it; each phase fits one call of the device tool (10 minutes) and writes its logs to $OUT.
# Session 8 (bench/RESULTS.md, "Issues 50 and 51 on two H200s at last") ran the benches' first
# rows. Session 10 ("Repeated plans ...") ran the 1B pipeline (1.39x one GPU), the all-reduce past
# 512 KiB and the one-shot's two-GPU tests. Session 11 ("Tensor parallelism's every way in one
# run ...") ran `tp ipc` (TP2 1.69x one GPU offline, 0.61x TPOT), tensor parallelism's two-GPU
# tests (every one passes since 7b01dc1) and the 1B pipeline again (1.43x). Session 12 ("Where the
# 1B pipeline's time goes ...") ran tp-faults (4 passed once form() stopped waiting for NCCL's abort),
# inflight-1b, clock-1b and spy-1b (the last stage's Python is the 1B's bound, not the plans in
# flight), prefix-groups-dp (groups 1.09x the cache at two replicas), rank-attention (no gain),
# ratio-1b (1.41x) and the 8B at 256 requests (1.40x). Session 13 ("The 1B pipeline's hosts are
# not its bound") ran host-tests and ab-1b: three GIL cuts gave nothing past the spread, and each
# stage's host does ~1 ms a step and waits for its GPU the rest; then 9a18257 stopped stage 0
# waiting for announced tokens no step needed (RESULTS: "Stage 0 waited for tokens it did not
# need"), unmeasured. Session 14 ("The token waits deferred") measured it: ab-1b 87-90k tok/s
# against 54-59k for 1fdaea0; ratio-1b 1.75-1.81x one GPU; pipeline 8B 1.95x at 1,024 (two
# replicas 1.88x); MPS on one GPU 0.99-1.00x; the NCCL link's same fix (848138f) 1.37x -> 1.67x.
# Session 15 ("The chain's all-reduce folded into its GEMVs") tried summing each row-parallel
# output in the next GEMV's prologue: 0.714x one GPU at batch 1 against 0.608x (every program re-read
# the peer's row), reverted; `tp ipc 1,tp2` again: 16 streams 0.581x and 0.605x, batch 1 0.606x and
# 0.608x; a rank's step alone at every tile size (64 KB stays). Next: issue 51's batch-1 TPOT (23 us
# short) needs the collectives' 164 us or the rank's own latency (attention ~7 us a layer) cut; then
# ratio-1b again for the 1B's 16-stream TPOT (1.06x, 0.95x, 1.16x, 1.02x in four runs against 1.1x).
# Session 16 ("The row-parallel GEMVs send their own rows") had o_proj and down send their rows from
# their epilogues: batch 1 0.597x twice (met); 16 streams 0.63x by the mean (the p50 is bimodal),
# missed; neither cuBLASLt nor a Triton GEMM beats cuBLAS at a rank's 16-row shapes. Session 17
# ("What the 16-stream gap is made of") measured the all-reduce's share of the 16-stream TPOT (4.0%:
# a rank's compute alone is 0.600x one GPU's), profiled a rank's batch-16 step kernel by kernel,
# and sped up the norm one-shot past 256 rows (528 rows: 18.4 against 20.7 us); an L2 prefetch of
# cuBLAS's weights and a small-batch Triton GEMM with its weights before the wait were both slower.
# Session 18 ("A small-batch GEMM of our own") served 2-16 rows through a split-K Triton GEMM with
# per-shape configs (kernels/small_batch_linear.py): `tp ipc 1,tp2` three times, 16 streams 0.57-0.60x
# by the p50 and 0.61-0.63x by the mean (missed: the waves' prefills and their NCCL all-reduces);
# NCCL past 8 MiB moves ~250 GB/s. Session 19 tuned the GEMM for Qwen3-8B and the 1B (small-gemm)
# and measured copy-engine copies to the peer at 370-380 GB/s (python -m strata.bench.peer_copy);
# its three all-reduces on them did not beat NCCL and none serves. Session 20 ran `tp ipc 1,tp2` in three
# leases (16 streams 0.605-0.630x by the mean: missed) and `waves`: the scheduler's per-step log showed a
# wave's arrivals split over plans built the moment a slot freed, which plan pacing (f5c2cba) fixed.
# Session 21 ran ipc-large (the fused one-shot beat NCCL-then-norm to 32 MiB: e9946d5 serves prefill's
# sums with it) and `tp ipc 1,tp2` (16 streams 0.607x by the mean, request latency 0.604x: missed), then
# lost x2. Session 22 ran the small-batch GEMMs' early row sends on two GPUs: the same bits, no gain
# (16 streams 3.067 ms by the mean with and without), and two ranks sharing one GPU hung again; removed.
#
# Here, first: bench/gpu_wheels.sh (the wheels the GPU image lacks, into bench/build/whl) and
# SmolLM2's tokenizer in bench/build/tokenizer (strata build-model smollm2-135m writes one; the GPU
# machine reaches no hub). Carry bench/build. On the GPU machine:
#
#   bash bench/two_gpus.sh COMMIT tp ipc        # issue 51's bench, one GPU, tp2, pp2 and dp2 in one run
#   bash bench/two_gpus.sh COMMIT waves         # the 16-stream phase with the scheduler's per-step debug log (waves.log.gz)
#   bash bench/two_gpus.sh COMMIT ipc-large     # the ipc one-shot (and fused with the norm) against NCCL at prefill
#                                               # sizes past its 8 MiB: 12-32 MiB, 1,536-4,096 rows of 4,096
#   bash bench/two_gpus.sh COMMIT prefill-overlap  # a TP2 prefill's sums beside its GEMMs (rows in two pieces)
#   bash bench/two_gpus.sh COMMIT tp-tests      # the one-shot's two-GPU tests, then tensor parallelism's (NCCL, ipc)
#   bash bench/two_gpus.sh COMMIT tp-faults     # only tensor parallelism's lost-rank tests, with their logs
#   bash bench/two_gpus.sh COMMIT rank-attention  # (one GPU will do) a TP2 rank's step at 8 or 4 attention warps
#   bash bench/two_gpus.sh COMMIT small-gemm    # (one GPU will do) the small-batch GEMM sweep of Qwen3-8B and the 1B
#   bash bench/two_gpus.sh COMMIT prefix-groups-dp  # prefix groups against the plain cache at one and two replicas
#   bash bench/two_gpus.sh COMMIT pipeline      # issue 50's bench: one GPU, two stages, two replicas (8B)
#   bash bench/two_gpus.sh COMMIT hops          # the stage hop on the GPUs' clock (gpu_clock put ~200 us a step on
#                                               # the token hand-off at 8B), then the all-reduce bench
#   bash bench/two_gpus.sh COMMIT pipeline-1b   # issue 50's 1B target
#   bash bench/two_gpus.sh COMMIT inflight-1b   # the 1B at two stages, 8 plans in flight (P + 2 micro-batches
#                                               # of two each, the default) against 12 (three each)
#   bash bench/two_gpus.sh COMMIT inflight-8b   # the same for the 8B (two stages 1.76x one GPU, GPUs 80% / 87% busy)
#   bash bench/two_gpus.sh COMMIT clock-1b      # the 1B's two stages on the GPUs' clock, the stamps in clock1b.tgz
#   bash bench/two_gpus.sh COMMIT spy-1b        # the 1B's two stages under py-spy, the stacks in spy1b.tgz
#   bash bench/two_gpus.sh COMMIT ratio-1b      # a new GEMM shape's host cost, then the 1B at one GPU and two stages
#   bash bench/two_gpus.sh COMMIT host-tests    # the GPU tests of the step thread's driver paths
#   bash bench/two_gpus.sh COMMIT ab-1b OLD     # ratio-1b for this tree, then for OLD's (its files in bench/build/old)
#
# COMMIT is the tree's commit as seen here: the device's copy of the repository keeps the git data
# of the session's first call, so `git log` there names an older commit. $OUT takes 8 files at most.
set -uo pipefail
cd "$(dirname "$0")/.."
commit=${1:?commit}
phase=${2:?phase}
OUT=${OUT:-/tmp/two_gpus}
mkdir -p "$OUT"
# Servers started with start_new_session outlive a call and keep their GPU memory.
for p in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null); do kill -9 "$p" 2>/dev/null; done
echo "$commit" > .commit
source bench/gpu_env.sh >/dev/null 2>&1 || { echo "bench/gpu_env.sh failed"; exit 1; }
nvidia-smi --query-gpu=index,name --format=csv,noheader
TOK=${TOKENIZER:-$PWD/bench/build/tokenizer}

run() {  # tag, seconds, command...: the log in $OUT, its figures here
  local tag=$1 secs=$2
  shift 2
  echo "=== $tag $(date +%T)"
  timeout "$secs" "$@" > "$OUT/$tag.log" 2>&1
  echo "rc=$? $(date +%T)"
  grep -v -i warn "$OUT/$tag.log" | grep -E "x one|arget|tok/s|TPOT|KiB|chain|passed|failed|FAIL|RESULTS|cuBLAS|Config\(|serial|chunked|^\|" | tail -40
}

case $phase in
  hops)
    for rows in 16 256; do
      run "hop_$rows" 120 python -m strata.bench.stage_hop --devices cuda:0,cuda:1 --transports ipc,distributed \
        --rows "$rows" --hidden 4096 --output "$OUT/hop_$rows.json"
    done
    run all_reduce 120 python -m strata.bench.all_reduce --json "$OUT/all_reduce.json"
    ;;
  prefill-overlap)
    run prefill_overlap 300 python -m strata.bench.prefill_overlap --rows 1536,4096 --chunks 2 --carveout 0,16 \
      --json "$OUT/prefill_overlap.json"
    ;;
  tp-tests)
    run one_shot_tests 150 python -m pytest -q -p no:cacheprovider tests/gpu/test_one_shot_all_reduce_gpu.py -k two-gpus
    run tp_tests 420 python -m pytest -q -p no:cacheprovider tests/gpu/test_tensor_parallel_gpu.py -k "not gloo"
    ;;
  prefix-groups-dp)  # issue 50: prefix groups' gain over the plain prefix cache, one replica against two
    for d in 1 2; do
      run "prefix_groups_dp$d" 280 strata bench prefix-groups --model dummy:llama-3.2-1b --tokenizer "$TOK" \
        --no-progress --ways groups,cache --data-parallel-size "$d" --output "$OUT/prefix_groups_dp$d.json"
      grep -hE "groups / prefix cache|prefill tokens computed|req/s" "$OUT/prefix_groups_dp$d.log" | head -6
    done
    ;;
  rank-attention)  # one GPU is enough: a TP2 rank's decode step with its attention at 8 warps or 4
    # (batch 1: 4 (sequence, KV head) pairs, 8 warps by default; an isolated sweep put 4 warps
    # ~1 us a layer faster, but the whole model's shape lost in the chain what it won alone)
    run rank_attention 400 python -m strata.bench.decode_chain --models dummy:llama-3-8b --ways "chain + PDL" \
      --batches 1,16 --tensor-parallel-rank-of 2 --wide-max-pairs 0,4,8 --json "$OUT/rank_attention.json"
    ;;
  small-gemm)  # one GPU is enough: kernels/small_batch_linear.py's sweep of Qwen3-8B's gate_up and down (its
    # qkv and o_proj are the 8B's), then the 1B's; prints TUNED rows (session 19's are in the table)
    run small_gemm 450 python -m strata.bench.small_batch_linear --models qwen3-8b --linears gate_up,down \
      --jobs 14 --top 2
    run small_gemm_1b 120 python -m strata.bench.small_batch_linear --models llama-3.2-1b --stages 3 --jobs 14 --top 2
    ;;
  tp-faults)  # kill -9 and SIGSTOP of a rank, NCCL and ipc; the logs show each abort and InitCache
    run tp_faults 420 python -m pytest -q -rA -p no:cacheprovider --timeout 150 tests/gpu/test_tensor_parallel_gpu.py \
      -k "lost_rank and two-gpus"
    grep -hE "abort took|InitCache on .* failed|^(PASSED|FAILED)" "$OUT/tp_faults.log" | head -30
    ;;
  tp)  # $3: the all-reduce (ipc was fastest in a chain on two H200s); $4: ways
    run tp8b 560 strata bench tensor-parallel --model dummy:llama-3-8b --tokenizer "$TOK" --no-progress \
      --ways "${4:-1,tp2,pp2,dp2}" --shape mixed --num-prompts 1024 --latency-num-prompts 128 \
      --tensor-parallel-all-reduce "${3:-nccl}" --output "$OUT/tp8b.json"
    ;;
  ipc-large)  # session 20: TP2's 1.5-4k-token prefill steps all-reduce 12-32 MiB through NCCL (RESULTS)
    run ipc_large 300 python -m strata.bench.all_reduce --sizes-kib 8192,12288,16384,24576,32768 --ipc-max-mib 32 \
      --norm-rows 1024,1536,2048,3072,4096 --replays 10 --json "$OUT/ipc_large.json"
    ;;
  waves)  # when each wave's requests reach the plans: grep "strata.scheduler DEBUG step" in the log
    run waves 400 strata bench tensor-parallel --model dummy:llama-3-8b --tokenizer "$TOK" --no-progress \
      --ways 1,tp2 --num-prompts 16 --latency-num-prompts 64 --service-log-level DEBUG --output "$OUT/waves.json"
    gzip -f "$OUT/waves.log"
    ;;
  pipeline)
    run pipe8b 560 strata bench pipeline --model dummy:llama-3-8b --tokenizer "$TOK" --no-progress --shape mixed \
      --num-prompts 256,1024 --stages 1,2 --transports ipc --data-parallel 2 --latency-num-prompts 128 \
      --output "$OUT/pipe8b.json"
    ;;
  pipeline-1b)  # with py-spy on every service: how busy the scheduler's main thread is at two stages
    run pipe1b 560 strata bench pipeline --model dummy:llama-3.2-1b --tokenizer "$TOK" --no-progress --shape mixed \
      --num-prompts 1024 --stages 1,2 --transports ipc --data-parallel 2 --latency-num-prompts 256 \
      --spy-dir /tmp/spy --output "$OUT/pipe1b.json"
    for d in /tmp/spy/*/; do python -m strata.bench.spy_summary "$d" > "$OUT/spy_$(basename "$d").txt" 2>&1; done
    grep -h -A12 "offline-1024-scheduler" "$OUT"/spy_*.txt | grep -E "==|thread|select|_engine_loop" | head -20
    run dp_tests 200 python -m pytest -q -p no:cacheprovider tests/gpu/test_data_parallel_gpu.py
    ;;
  inflight-1b|inflight-8b)  # two stages at 8 plans in flight (the default: P + 2 micro-batches of two each) and 12
    model=dummy:llama-3.2-1b
    [ "$phase" = inflight-8b ] && model=dummy:llama-3-8b
    for tag in 8a 12 8b; do  # (8 again: the host's speed drifts within a call)
      n=${tag%[ab]}
      run "${phase}_$tag" 200 strata bench pipeline --model "$model" --tokenizer "$TOK" --no-progress \
        --shape mixed --num-prompts 1024 --stages 2 --transports ipc --latency-num-prompts 64 \
        --max-plans-in-flight "$n" --output "$OUT/${phase}_$tag.json"
      grep -h "plans in flight" "$OUT/${phase}_$tag.log" | head -1
    done
    # Where each stage's stream waited, on the GPUs' clock (slows steps: apart from the A/B; the
    # 8B's four runs would not fit a call)
    [ "$phase" = inflight-1b ] && run "${phase}_clock" 200 strata bench pipeline --model "$model" --tokenizer "$TOK" --no-progress \
      --shape mixed --num-prompts 1024 --stages 2 --transports ipc --latency-num-prompts 64 \
      --gpu-clock /tmp/clock --output "$OUT/${phase}_clock.json"
    ;;
  clock-1b)  # the 1B at two stages on the GPUs' clock, its stamps kept (clock1b.tgz): stage 0's token
    # waits by how far back their tokens lie (bench/gpu_clock.py token_waits)
    rm -rf /tmp/clock
    run clock_1b 200 strata bench pipeline --model dummy:llama-3.2-1b --tokenizer "$TOK" --no-progress \
      --shape mixed --num-prompts 1024 --stages 2 --transports ipc --latency-num-prompts 64 --data-parallel 0 \
      --gpu-clock /tmp/clock --output "$OUT/clock_1b.json"
    grep -h -A12 "token waits" "$OUT/clock_1b.log" | head -30
    tar czf "$OUT/clock1b.tgz" -C /tmp clock
    ;;
  spy-1b)  # the 1B at two stages with py-spy on every service (the last stage's GIL is the bound:
    # its threads' Python by function, for cutting it), the summaries in spy1b.tgz
    rm -rf /tmp/spy
    run spy_1b 200 strata bench pipeline --model dummy:llama-3.2-1b --tokenizer "$TOK" --no-progress \
      --shape mixed --num-prompts 1024 --stages 2 --transports ipc --latency-num-prompts 64 --data-parallel 0 \
      --spy-dir /tmp/spy --output "$OUT/spy_1b.json"
    mkdir -p /tmp/spy_summaries
    for d in /tmp/spy/*/; do python -m strata.bench.spy_summary "$d" > "/tmp/spy_summaries/$(basename "$d").txt" 2>&1; done
    tar czf "$OUT/spy1b.tgz" -C /tmp spy_summaries spy
    ;;
  ratio-1b)  # issue 50's 1B target alone: one GPU and two stages in one run (no replicas, no py-spy),
    # after a check of what a GEMM shape new to cuBLAS costs the host (the eager head's padded rows)
    run logits_shapes 60 python -m strata.bench.logits_shapes
    run ratio_1b 400 strata bench pipeline --model dummy:llama-3.2-1b --tokenizer "$TOK" --no-progress --shape mixed \
      --num-prompts 1024 --stages 1,2 --transports ipc --data-parallel 0 --latency-num-prompts 256 \
      --output "$OUT/ratio_1b.json"
    ;;
  host-tests)  # the step thread's driver paths (timing-event pool, host copies, raw streams, the graph's tokens handed on)
    run host_tests 400 python -m pytest -v --timeout 120 -p no:cacheprovider tests/gpu/test_cuda_driver_gpu.py \
      tests/gpu/test_stream_memops_gpu.py tests/gpu/test_stage_transport_gpu.py tests/gpu/test_pipelined_decode_gpu.py \
      tests/gpu/test_runner_gpu.py
    ;;
  ab-1b)  # the 1B's ratio-1b with an older tree (OLD_COMMIT's files in bench/build/old: git archive) and this one
    old_commit=${3:?old commit}
    old=$PWD/bench/build/old
    mkdir -p /tmp/oldroot  # (the editable install's finder would import this tree's strata.services)
    printf '%s\n' 'import sys' \
      'sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in (f if isinstance(f, type) else type(f)).__module__.lower()]' \
      > /tmp/oldroot/sitecustomize.py
    for d in services kernels bench; do ln -sfn "../$d" "$old/strata/$d"; done
    for tree in ${TREES:-new old}; do  # e.g. TREES="old new old new" STAGES=2
      if [ $tree = new ]; then cmd=(strata); else cmd=(env -C "$old" PYTHONPATH="/tmp/oldroot:$old:/tmp/site" STRATA_GIT_COMMIT="$old_commit" python3 -m strata.cli); fi
      n=$((${n:-0} + 1))
      run "ab_1b_${n}_$tree" 280 "${cmd[@]}" bench pipeline --model dummy:llama-3.2-1b --tokenizer "$TOK" --no-progress \
        --shape mixed --num-prompts 1024 --stages "${STAGES:-1,2}" --transports ipc --data-parallel 0 \
        --latency-num-prompts 256 --output "$OUT/ab_1b_${n}_$tree.json"
    done
    ;;
  *)
    echo "unknown phase $phase: hops, tp-tests, tp ALL_REDUCE [WAYS], pipeline, pipeline-1b, inflight-1b, inflight-8b, tp-faults, rank-attention, prefix-groups-dp, clock-1b, spy-1b, ratio-1b, host-tests, ab-1b OLD_COMMIT"
    exit 2
    ;;
esac
