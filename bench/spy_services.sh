#!/usr/bin/env bash
# Samples the Python stacks of a running local cluster's services with py-spy (which must be on
# PATH), to see which process bounds the step rate: `bash bench/spy_services.sh OUTDIR [SECONDS]`.
# Writes OUTDIR/{scheduler,gateway,worker}.txt in py-spy's folded "raw" format.
set -euo pipefail
out="$1"; seconds="${2:-6}"
mkdir -p "$out"
for role in scheduler gateway worker; do
  pid=$(pgrep -f "strata.cli $role" | head -1) || { echo "no $role process"; continue; }
  py-spy record --nonblocking --threads -r 250 -d "$seconds" -f raw -p "$pid" -o "$out/$role.txt" >/dev/null 2>&1 &
done
wait
