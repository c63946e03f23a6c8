# The shared start of the pending device scripts (sourced): strict unset variables, the
# output folder with its records folder, an elapsed-time echo, and the threads per process.
set -u
OUT=${OUT:-bench/results/session}
S=$(date +%s)
el() { echo "[$(($(date +%s) - S))s] $*"; }
mkdir -p "$OUT/rec"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2} PYTHONUNBUFFERED=1
