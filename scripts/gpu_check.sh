#!/usr/bin/env bash
# GPU tests and GPU benchmarks, run on the device machine (H200, torch 2.11 + CUDA 13, no install).
#
#   bash scripts/gpu_check.sh [limits] [tests] [quant] [reload] [moe] [offload_update] [offload] [transport]
#                          [multi] [async] [async_gloo] [delta] [tests_quick] [reload8b] [offload_fp8] [transport_zc]
#                          [delta_profile] [delta_decode] [delta_trace] [tests_delta] [delta_flat] [delta_cpu_host]
#                          (default: the first nine)
#   (transport = transport_ipc transport_sweep transport_nccl, delta = delta_small delta8b: each also a phase of its own)
#   bash scripts/gpu_check.sh peers   (opt-in: bench_peers.py, weight_sync next to checkpoint-engine from .whl/)
#
# Logs go to ./gpu_out; benchmark JSON/markdown/PNG go to benchmarks/results/. When $OUT is set (the
# device tool's output folder, which returns at most 8 files) both are packed into $OUT/gpu_results.tgz. Pure-Python wheels the machine lacks (diffusers)
# travel in .whl/ (see docs/benchmarks.md) and are installed into /tmp/site, never into the image.
set -u
cd "$(dirname "$0")/.."
LOGS=$PWD/gpu_out
mkdir -p "$LOGS"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
# NVLink multicast stays off on shared hosts (the device tool's rule).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
# Ranks are spawned here, as in every GPU run so far: run_distributed's fork server (the CPU suite's
# default since 2026-12-07) has not yet run on a GPU machine. WEIGHT_SYNC_RANK_START=forkserver tries it.
export WEIGHT_SYNC_RANK_START=${WEIGHT_SYNC_RANK_START:-spawn}
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi
NGPU=$(python3 -c 'import torch; print(torch.cuda.device_count())')
# Result tags name the card that ran them (H100 machines come when no H200 is free).
G=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | grep -q H100 && echo h100 || echo h200)
phases=("$@")
[ ${#phases[@]} -eq 0 ] && phases=(limits tests quant reload moe offload_update offload transport multi)
expanded=()
for p in "${phases[@]}"; do
  case $p in
    transport) expanded+=(transport_ipc transport_sweep transport_nccl) ;;
    delta) expanded+=(delta_small delta8b) ;;
    *) expanded+=("$p") ;;
  esac
done
phases=("${expanded[@]}")
status=0

step() {  # step NAME TIMEOUT_S CMD...: run, log to $OUT/NAME.log, print the tail
  local name=$1 limit=$2; shift 2
  echo "=== $name: $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
  local rc=$?
  echo "=== $name: rc=$rc in $((SECONDS - t0)) s"
  tail -n "${TAIL:-12}" "$LOGS/$name.log"
  [ $rc -eq 0 ] || status=1
  pack  # after every step: a call cut short by its time limit still returns what finished
}

pack() {
  if [ -n "${OUT:-}" ]; then
    tar czf "$OUT/gpu_results.tgz" gpu_out $(ls benchmarks/results/*${G}* 2>/dev/null) 2>/dev/null
  fi
}

for phase in "${phases[@]}"; do
  case $phase in
    limits)
      if [ -f .shared_tools/gpu_limits.py ]; then
        step limits_single 180 python3 .shared_tools/gpu_limits.py single
        [ "$NGPU" -ge 2 ] && step limits_nccl 180 python3 .shared_tools/gpu_limits.py nccl
      fi ;;
    tests)
      step tests_gpu 540 python3 -m pytest tests -m "gpu or multi_gpu" -q -p no:cacheprovider -rs ;;
    tests_quick)  # the GPU tests of the reload, quant, engine and offload paths (no transports)
      step tests_quick 150 python3 -m pytest tests/quant/test_fp8_gpu.py tests/offload/test_gpu.py \
        tests/reload/test_cuda_reload.py tests/engine/test_moe_cuda.py -m gpu -q -p no:cacheprovider -rs ;;
    reload8b)
      step bench_reload_8b 90 python3 benchmarks/bench_reload.py --device cuda --preset qwen3-8b --tag ${G}_qwen3-8b \
        --repeats 3 --formats bf16,fp8,fp8_block,fp8_channel --small-layers 2000 ;;
    offload_fp8)  # issue 19: fp8-streamed blocks against their bound and the bf16 DLO time, same run
      step bench_offload_fp8 180 python3 benchmarks/bench_offload.py --quantization fp8_block \
        --tokens 1024 4096 16384 --tag ${G}_fp8 ;;
    reload)
      step bench_reload_0.6b 300 python3 benchmarks/bench_reload.py --device cuda --preset qwen3-0.6b --tag ${G}_qwen3-0.6b --repeats 5
      step bench_reload_8b 420 python3 benchmarks/bench_reload.py --device cuda --preset qwen3-8b --tag ${G}_qwen3-8b --repeats 3 --small-layers 2000 ;;
    quant)  # fp8 kernels of a whole 8B model against a cast copy of the same bytes
      step bench_quant 240 python3 benchmarks/bench_quant.py --device cuda --preset qwen3-8b --tag ${G} ;;
    moe)  # Qwen3-30B-A3B-shaped reload (16 of its 48 layers: engine + source + the naive path must fit)
      step bench_reload_moe 480 python3 benchmarks/bench_reload.py --device cuda --arch qwen3_moe \
        --preset qwen3-30b-a3b --layers 16 --repeats 7 --formats bf16,fp8,fp8_block --tag ${G}_qwen3-30b-a3b ;;
    offload_update)  # an update of the offloaded 16 x 227 MB DiT against the pinned H2D bound
      step offload_update 300 python3 benchmarks/offload_update.py --tag ${G} ;;
    offload)
      step bench_offload 480 python3 benchmarks/bench_offload.py --tag ${G}
      step offload_demo 240 python3 -m weight_sync.cli offload-demo --device cuda --verify --dlo-no-use-allgather \
        --num-blocks 16 --hidden 3072 --heads 24 --in-channels 64 --tokens 4096 --steps 2 --dtype bfloat16 ;;
    transport_ipc)  # colocated, one GPU: buffered ipc next to zero-copy, against one device copy
      step bench_transport_ipc_zc 300 python3 benchmarks/bench_transport.py --backends ipc,ipc+zc --bucket-mb 2048 \
        --repeats 7 --tag ${G}_ipc_zc ;;
    transport_zc)  # issue 15: zero-copy ipc, bf16 and an fp8_block engine (its single-pass bound in the row)
      step bench_transport_zc 300 python3 benchmarks/bench_transport.py --backends ipc+zc --quantization none,fp8_block \
        --bucket-mb 2048 --repeats 21 --rss-updates 0 --tag ${G}_ipc_zc_bound ;;
    transport_sweep)  # throughput vs bucket size (the PNG)
      [ "$NGPU" -ge 2 ] && step bench_transport_sweep 420 python3 benchmarks/bench_transport.py --backends nccl,ipc \
        --quantization none --bucket-mb 256,1024,2048 --repeats 3 --warmup 1 --rss-updates 0 --tag ${G}x2 ;;
    transport_nccl)  # the acceptance numbers: bf16 and an fp8-block engine at 1 GiB buckets
      [ "$NGPU" -ge 2 ] && step bench_transport 420 python3 benchmarks/bench_transport.py --backends nccl \
        --quantization none,fp8_block --bucket-mb 1024 --repeats 9 --tag ${G}x2_final ;;
    multi)
      if [ "$NGPU" -ge 2 ]; then
        step bench_offload_dp2 420 python3 benchmarks/bench_offload.py --dp 2 --tag ${G}x2
        step offload_demo_dp2 240 python3 -m weight_sync.cli offload-demo --device cuda --verify \
          --enable-distributed-layerwise-offload --data-parallel-size 2 --num-blocks 16 --hidden 3072 \
          --heads 24 --in-channels 64 --tokens 4096 --steps 2 --dtype bfloat16
      fi ;;
    async)  # issue 20: decode throughput while updates arrive (0.6B smoke first: it fails fast)
      step bench_async_smoke 150 python3 benchmarks/bench_async.py --device cuda --preset qwen3-0.6b --batch 8 \
        --steps 64 --every 16 --sources local,ipc --repeats 1 --tag ${G}_smoke --results-dir gpu_out
      step bench_async 360 python3 benchmarks/bench_async.py --device cuda --preset qwen3-8b --batch 8 --steps 512 \
        --every 64 --sources local,ipc --tag ${G} ;;
    async_gloo)  # issue 20: the slow path, gloo from host memory
      step bench_async_gloo 360 python3 benchmarks/bench_async.py --device cuda --preset qwen3-8b --batch 8 \
        --steps 1536 --every 512 --sources gloo --repeats 1 --tag ${G}_gloo ;;
    delta_small)  # issue 18: delta apply into an fp8_block engine over ipc against its full reload
      # (Adam steps at lr 1e-6 / 1e-5 included: the 0.6B model's fp32 Adam state fits one GPU.)
      step bench_delta 300 python3 benchmarks/bench_delta.py --device cuda --quantization fp8_block \
        --preset qwen3-0.6b --repeats 3 --tag ${G}_fp8_block ;;
    delta8b)
      # The Qwen3-8B shape at the transport's default bucket size (64 MiB); two densities fit its memory
      # (on an 80 GB H100 only with the sender's base in pinned host memory).
      base=(); [ "$G" = h100 ] && base=(--delta-base pinned)
      step bench_delta_8b 420 python3 benchmarks/bench_delta.py --device cuda --quantization fp8_block \
        --preset qwen3-8b --no-adam --densities 0,0.02 --repeats 2 --bucket-mib 64 "${base[@]}" --tag ${G}_fp8_block_8b ;;
    delta_profile)  # issue 18: where the 8B engine's delta session goes (cProfile of the engine's deltas only)
      base=(); [ "$G" = h100 ] && base=(--delta-base pinned)
      step bench_delta_8b_profile 300 python3 benchmarks/bench_delta.py --device cuda --quantization fp8_block \
        --preset qwen3-8b --no-adam --densities 0,0.02 --repeats 2 --bucket-mib 64 "${base[@]}" \
        --profile-deltas gpu_out/delta_8b_prof --tag ${G}_fp8_block_8b_profiled
      python3 -c "import pstats, sys; s = pstats.Stats(sys.argv[1]); s.sort_stats('cumulative').print_stats(70); s.sort_stats('tottime').print_stats(40)" \
        gpu_out/delta_8b_prof/engine_deltas.prof > gpu_out/delta_8b_prof/engine_deltas.txt 2>&1 ;;
    delta_cpu_host)  # issue 18: the CPU delta over gloo on this host's 16 cores (the CI host has 2, shared)
      step bench_delta_cpu_host 240 python3 benchmarks/bench_delta.py --preset qwen3-0.6b --no-adam \
        --densities 0,0.02 --repeats 3 --bucket-mib 64 --tag ${G}host_cpu_qwen3-0.6b ;;
    tests_delta)  # issue 18: the delta path's GPU tests (decode, grouped scatter, apply by address, checksums)
      step tests_delta 300 python3 -m pytest tests/transport/test_delta_gpu.py tests/reload/test_scatter_many.py \
        tests/reload/test_delta_flat.py tests/transport/test_gpu.py -k "not nccl and not ipc" -q -p no:cacheprovider -rs ;;
    delta_flat)  # issue 18: the 0.6B fp8_block engine's delta vs full reload, deltas applied by address
      step bench_delta_flat 240 python3 benchmarks/bench_delta.py --device cuda --quantization fp8_block \
        --preset qwen3-0.6b --no-adam --densities 0,0.02 --repeats 5 --tag ${G}_fp8_block_flat
      # The same through per-payload views (the path before), on the same machine: the change's baseline.
      step bench_delta_views 240 python3 benchmarks/bench_delta.py --device cuda --quantization fp8_block \
        --preset qwen3-0.6b --no-adam --densities 0,0.02 --repeats 5 --views --tag ${G}_fp8_block_views
      # The decode alone, view path against by address, host time per payload on this shape.
      step bench_delta_decode_06b 120 python3 benchmarks/bench_delta_decode.py --device cuda --preset qwen3-0.6b \
        --densities 0,0.02 --repeats 5 --tag ${G}_0.6b ;;
    delta_decode)  # issue 18: the batched decode's host cost per payload, device payloads vs the same bytes on the host
      step bench_delta_decode 150 python3 benchmarks/bench_delta_decode.py --device cuda --preset qwen3-8b \
        --densities 0,0.02 --repeats 5 --tag ${G}_8b ;;
    delta_trace)  # issue 18: host and device timeline of the 0.6B engine's last delta (torch.profiler)
      step bench_delta_trace 150 python3 benchmarks/bench_delta.py --device cuda --quantization fp8_block \
        --preset qwen3-0.6b --no-adam --densities 0.02 --repeats 2 --trace-deltas gpu_out/delta_trace \
        --tag ${G}_fp8_block_traced ;;
    peers)  # issue 15.4: pinned host -> one GPU, weight_sync next to checkpoint-engine and the pinned H2D bound
      step bench_peers 560 python3 benchmarks/bench_peers.py --tag ${G} --profile ;;
    *) echo "unknown phase $phase"; status=2 ;;
  esac
done
pack
exit $status
