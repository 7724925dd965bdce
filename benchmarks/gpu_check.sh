#!/usr/bin/env bash
# The GPU check: everything fsdp2 has to show on a GPU, in one run, into one report file.
#
#   PYTHONPATH=. bash benchmarks/gpu_check.sh --report gpu_check_report.md   # on a GPU machine
#   PYTHONPATH=. bash benchmarks/gpu_check.sh --dry-run --report /tmp/r.md    # the same steps on CPU
#
# Runs from the checkout alone, with the machine's own torch (2.11 or newer) and pytest: no
# install, no network. The steps, each under a time limit of its own so that one hang cannot
# eat the machine's time:
#   1. environment: torch, CUDA, the GPUs, this checkout's commit;
#   2. `pytest -m cuda` on the files that carry the cuda marker (world size 1 where one GPU is
#      all there is: tests/comm/test_cuda.py sizes its worlds to the devices);
#   3. a training step against torch's FSDP2, DDP and no communication on the machine's GPUs
#      (benchmarks/step_time.py --device cuda: step time, peak CUDA memory per step);
#   4. the runtime's CPU overhead and peak memory at world 8 on one GPU, the other ranks stood in
#      for by torch's fake process group (benchmarks/overhead.py --device cuda);
#   5. where that host time goes, on the CPU and the GPU of the same machine: ATen ops, copies,
#      kernels and CUDA API calls per step of each runtime (benchmarks/host_profile.py);
#   6. step 2 again under TORCH_CUDA_SANITIZER=1 (PyTorch's CUDA stream sanitizer).
# --dry-run runs the same steps on CPU (gloo, small sizes; the cuda tests skip) so that CI
# checks the script itself. Exit status: 0 when every step passed, 1 otherwise.
set -uo pipefail
cd "$(dirname "$0")/.."

usage() { sed -n '2,21p' "$0" | sed 's/^# \{0,1\}//'; }
dry=0
report=gpu_check_report.md
while (($#)); do
    case "$1" in
        --dry-run) dry=1 ;;
        --report) report=${2:?--report needs a path}; shift ;;
        -h | --help) usage; exit 0 ;;
        *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
done

PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mapfile -t cuda_files < <(grep -rl --include='test_*.py' 'pytest.mark.cuda' tests | sort)
if ((dry)); then
    device=cpu
    gpus=2  # ranks for step 3: gloo on CPU
else
    device=cuda
    gpus=$("$PYTHON" -c 'import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)')
    if [[ "$gpus" != [1-9]* ]]; then
        echo "gpu_check.sh: no CUDA device here (torch sees $gpus); use --dry-run on a CPU machine" >&2
        exit 2
    fi
fi

: >"$report"
status=0
summary=()

# section TITLE LIMIT_S COMMAND...: run COMMAND under `timeout`, append its command, exit status,
# duration and output (the last 400 lines) to the report.
section() {
    local title=$1 limit=$2
    shift 2
    local log="$work/log" start=$SECONDS rc
    echo "== $title (limit ${limit}s): $*" >&2
    timeout --kill-after=10 "$limit" "$@" >"$log" 2>&1
    rc=$?
    local took=$((SECONDS - start)) verdict=passed
    if ((rc == 124 || rc == 137)); then
        verdict="TIMED OUT after ${limit}s"
    elif ((rc != 0)); then
        verdict="FAILED (exit $rc)"
    fi
    ((rc == 0)) || status=1
    summary+=("| $title | $verdict | ${took}s |")
    {
        echo "## $title"
        echo
        echo "\`$*\` — $verdict in ${took}s"
        echo
        echo '```'
        tail -n 400 "$log"
        echo '```'
        echo
    } >>"$report"  # section by section: a run cut short still leaves what it did
    echo "   $verdict in ${took}s" >&2
}

cat >"$work/environment.py" <<'EOF'
import os, platform, subprocess, sys
import torch
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
for i in range(torch.cuda.device_count()):
    p = torch.cuda.get_device_properties(i)
    print(f"gpu {i}: {p.name}, {p.total_memory / 2**30:.1f} GiB, {p.multi_processor_count} SMs")
if torch.cuda.is_available():
    print("nccl", torch.cuda.nccl.version())
try:
    print("commit", subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip())
except OSError:
    pass
import fsdp2
print("fsdp2", fsdp2.__file__)
EOF
section "environment" 60 "$PYTHON" "$work/environment.py"

pytest_cuda=("$PYTHON" -m pytest -m cuda -v -rA --tb=short -p no:cacheprovider "${cuda_files[@]}")
section "pytest -m cuda" 150 "${pytest_cuda[@]}"

if ((dry)); then
    step_args=(--device cpu --sweep tiny --steps 2 --warmup 1)
    overhead_args=(--device cpu --groups 4 --steps 2 --warmup 1)
    profile_args=(--device cpu --groups 2 --steps 2)
else
    step_args=(--device cuda --sweep 17M,100M --steps 20 --warmup 5 --foreach)
    overhead_args=(--device cuda --world 8 --groups 32 --steps 30 --warmup 5)
    profile_args=(--device cpu,cuda --world 8 --groups 32 --steps 20)
fi
section "step time against torch FSDP2, DDP, no communication ($gpus rank(s), $device)" 120 \
    "$PYTHON" -m torch.distributed.run --standalone --nproc-per-node "$gpus" benchmarks/step_time.py \
    --impls fsdp2,torch_fsdp2,ddp,nocomm --out "$work/step_time.jsonl" "${step_args[@]}"
section "overhead at world 8, fake process group ($device)" 90 \
    "$PYTHON" benchmarks/overhead.py --out "$work/overhead.jsonl" "${overhead_args[@]}"
section "where the host time goes, CPU against $device (host_profile.py)" 150 \
    "$PYTHON" benchmarks/host_profile.py --out "$work/host_profile.json" "${profile_args[@]}"
section "pytest -m cuda under TORCH_CUDA_SANITIZER=1" 170 env TORCH_CUDA_SANITIZER=1 "${pytest_cuda[@]}"

{
    echo "# fsdp2 GPU check ($( ((dry)) && echo "dry run, CPU" || echo "$gpus GPU(s)"), $(date -u +%Y-%m-%dT%H:%MZ))"
    echo
    echo "| step | result | time |"
    echo "|---|---|---|"
    printf '%s\n' "${summary[@]}"
    echo
    echo "## Results (JSON lines)"
    echo
    for f in "$work"/step_time.jsonl "$work"/overhead.jsonl; do
        [[ -s "$f" ]] || continue
        echo "\`$(basename "$f")\`:"
        echo
        echo '```json'
        cat "$f"
        echo '```'
        echo
    done
    cat "$report"
} >"$work/report"
mv "$work/report" "$report"
echo "report: $report ($( ((status)) && echo "some steps failed" || echo "every step passed"))" >&2
exit "$status"
