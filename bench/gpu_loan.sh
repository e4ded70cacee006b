#!/usr/bin/env bash
# What a short GPU loan runs (issue 57), prepared so that the loan's minutes go to measuring.
# The loan's machine has torch, torchvision, numpy, PyYAML, safetensors, scikit-learn and pytest
# (its image; ../.library/device/KINDS.md lists them) but not omegaconf, and reaches no package
# index: its wheel travels with the working tree in .whl/ (git-ignored).
#
#   bash bench/gpu_loan.sh prepare     # here, once: omegaconf's wheel into .whl/
#   device run: command="bash bench/gpu_loan.sh headline", carry=[".whl"], timeout_s=560
#   device run: command="bash bench/gpu_loan.sh tests",    carry=[".whl"], timeout_s=180
#
# A loan is 15 minutes of device time in all, the machine's start (a minute or two) included:
# the suite stops starting rows after 420 s (a row then runs to its own limit), and the tests
# stop after 150 s, the new GPU paths' test first.
# headline: the GPU headline suite (bench/headline.py; rows not started by --deadline-s are
# recorded as skipped: `bash bench/gpu_loan.sh headline --row NAME` reruns one), its JSON, log
# and nvidia-smi into $OUT. tests: the GPU-marked tests (pytest -m gpu), their log into $OUT.
# Then commit $OUT's headline-<gpu>.json into bench/results and quote it in docs/benchmarks.md.
set -uo pipefail
cd "$(dirname "$0")/.."
what=${1:-}
shift || true
OUT=${OUT:-/tmp/gpu-loan}
OMEGACONF=omegaconf==2.4.0  # requirements.lock's pin

case "$what" in
prepare)
    mkdir -p .whl
    exec python3 -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 -d .whl "$OMEGACONF"
    ;;
headline | tests) ;;
*)
    echo "usage: bash bench/gpu_loan.sh prepare|headline|tests [bench/headline.py's options]" >&2
    exit 2
    ;;
esac

ls .whl/omegaconf-*.whl >/dev/null 2>&1 ||
    { echo "gpu_loan: no .whl/omegaconf-*.whl: run 'bash bench/gpu_loan.sh prepare' here and carry .whl" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 2
export PYTHONPATH="/tmp/site:$PWD" PYTHONUNBUFFERED=1 TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
mkdir -p "$OUT"
nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
python3 -c 'import torch, sys; print(torch.__version__, torch.version.cuda, sys.version)' \
    >"$OUT/versions.txt" 2>&1

if [ "$what" = headline ]; then
    python3 bench/headline.py --out "$OUT" --deadline-s 420 "$@" 2>&1 |
        tee "$OUT/headline.log"
else
    first=tests/test_gpu.py::test_adamw_is_fused_and_the_loss_compiled_on_the_gpu_and_a_cpu_checkpoint_resumes_fused
    tests() {
        python3 -m pytest -q -p no:cacheprovider "$first" "$@"
        python3 -m pytest -m gpu -q -p no:cacheprovider --deselect "$first" tests "$@"
    }
    export -f tests
    export first
    timeout 150 bash -c 'tests "$@"' tests "$@" 2>&1 | tee "$OUT/tests.log"
fi
