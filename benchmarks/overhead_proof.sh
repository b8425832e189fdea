#!/usr/bin/env bash
# The recorder-overhead goals of docs/benchmarks.md on one GPU machine, in one call of at most ~9 minutes.
#
#   bash benchmarks/overhead_proof.sh sync  OUT   # the synchronous graph step: micro costs (C and Python),
#                                                 # the cost call by call and term by term, events /
#                                                 # sampled / kernels
#   bash benchmarks/overhead_proof.sh eager OUT   # eager torch and eager Triton: events / sampled
#   bash benchmarks/overhead_proof.sh events OUT  # the synchronous graph step, events alone in its process:
#                                                 # no CUPTI ever attached (the sync part's rotation has it)
#
# Lent machines differ 2-4x in what Python costs, so each part compares its ways inside one process on one
# machine; the tables of every part print last, and the JSON files land under OUT.
set -euo pipefail
part=${1:?sync, eager or events}
out=${2:?output directory}
mkdir -p "$out"
here=$(cd "$(dirname "$0")" && pwd)
log="$out/$part.log"

case "$part" in
  sync)
    for path in c python; do
      OVERSHOOT_HOTPATH=$path python "$here/recorder_overhead.py" --steps 20000 \
        --json "$out/recorder_overhead_$path.json" | tee -a "$log"
    done
    python "$here/call_costs.py" --config step-triton-sync --preset qwen3-4b --rounds 60 | tee -a "$log"
    python "$here/sync_decomposition.py" --modes off,events --budget-s 90 \
      --out "$out/sync_decomposition.json" | tee -a "$log"
    # --attach-check-s: plain rounds before any mode and after all, CUPTI attached but off in between:
    # whether an attached CUPTI is what `sampled` costs over `events` on this step.
    python "$here/hook_overhead.py" --configs step-triton-sync --modes events,sampled,kernels --batches 1 \
      --tokens 128 --rounds 2000 --budget-s 170 --attach-check-s 20 --out "$out/sync" | tee -a "$log"
    ;;
  eager)
    python "$here/hook_overhead.py" --configs eager-torch --modes events,sampled --batches 1 --tokens 32 \
      --rounds 2000 --budget-s 260 --out "$out/eager-torch" | tee -a "$log"
    python "$here/hook_overhead.py" --configs eager-triton --modes events,sampled --batches 1 --tokens 64 \
      --rounds 2000 --budget-s 150 --out "$out/eager-triton" | tee -a "$log"
    ;;
  events)
    python "$here/hook_overhead.py" --configs step-triton-sync --modes events --batches 1 --tokens 128 \
      --rounds 2000 --budget-s 200 --out "$out/events-alone" | tee -a "$log"
    ;;
  *)
    echo "overhead_proof.sh: unknown part '$part' (sync, eager or events)" >&2
    exit 2
    ;;
esac
