#!/usr/bin/env bash
# Prepares the GPU check (bench/gpu/run.sh) HERE, where PyPI is reachable, for a GPU machine that
# has no network: into .gpu/ (ignored by git; name it in what travels with the tree),
#   .gpu/wheels/    the wheels the machine's image lacks, or may hold too old, for CPython 3.12 on
#                   x86-64 Linux (the image: bench/gpu/image-packages.txt);
#   .gpu/fixtures/  the llama.cpp fixtures the CUDA tests read (a subset of ../shared/fixtures, which
#                   does not travel), found there through SPLITMOE_FIXTURES_DIR.
# Idempotent: wheels and fixtures already there are kept, anything no longer listed is removed.
# Fails when .gpu/ outgrows GPU_CHECK_CARRY_LIMIT_MIB (56: the tree travels too, 64 MiB in all).
#
# usage: bench/gpu/prepare.sh [--help]
set -euo pipefail

if [[ ${1:-} == -h || ${1:-} == --help ]]; then
    awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"
    exit 0
fi

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$REPO"
PYTHON=${PYTHON:-python3}
FIXTURES_SRC=${SPLITMOE_FIXTURES_DIR:-$REPO/../shared/fixtures}
LIMIT_MIB=${GPU_CHECK_CARRY_LIMIT_MIB:-56}
WHEELS_DIR=.gpu/wheels

# name==version, the versions the test suite passes with here. Requirements of each were checked
# against the image's package list (the `check-wheels` step below repeats that check).
WHEELS=(
    # the generated modules' runtime floors: proto/*_pb2.py (protobuf 7.35.1), proto/*_pb2_grpc.py
    # (GRPC_GENERATED_VERSION 1.85.1); the image's own versions are unknown, so both travel
    protobuf==7.36.2 grpcio==1.85.3 grpcio-health-checking==1.85.1
    gguf==0.19.0 llguidance==1.9.1
    # the gateway
    fastapi==0.165.0 fastapi-offline==1.7.7 starlette==1.10.0 pydantic==2.13.4 pydantic-core==2.46.4
    typing-inspection==0.4.2 annotated-types==0.7.0 uvicorn==0.54.0
    # tracing
    opentelemetry-api==1.45.2 opentelemetry-sdk==1.45.2 opentelemetry-semantic-conventions==0.66b2
    opentelemetry-proto==1.45.2 opentelemetry-exporter-otlp-proto-grpc==1.45.2
    opentelemetry-exporter-otlp-proto-common==1.45.2 opentelemetry-exporter-otlp-common==0.66b2
    googleapis-common-protos==1.76.0
    # in the image, but floors above old releases: pydantic needs typing-extensions>=4.14.1,
    # fastapi anyio>=4.1
    typing-extensions==4.16.0 anyio==4.16.0
)
PLATFORMS=(manylinux_2_35_x86_64 manylinux_2_34_x86_64 manylinux_2_31_x86_64 manylinux_2_28_x86_64
           manylinux_2_27_x86_64 manylinux_2_24_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64
           manylinux1_x86_64)

# The file-name prefix of a wheel of name==version (names are normalized with underscores there).
wheel_prefix() {
    local name=${1%%==*} version=${1##*==}
    name=$(tr 'A-Z.-' 'a-z__' <<<"$name")
    echo "$name-$version-"
}

mkdir -p "$WHEELS_DIR"
wanted=()
for spec in "${WHEELS[@]}"; do
    prefix=$(wheel_prefix "$spec")
    wanted+=("$prefix")
    if compgen -G "$WHEELS_DIR/$prefix*.whl" >/dev/null; then
        continue
    fi
    echo "downloading $spec"
    "$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --abi cp312 "${PLATFORMS[@]/#/--platform=}" -d "$WHEELS_DIR" "$spec"
done
for wheel in "$WHEELS_DIR"/*.whl; do  # one version of each: two would stop the install there
    base=$(basename "$wheel")
    keep=0
    for prefix in "${wanted[@]}"; do
        [[ $(tr 'A-Z' 'a-z' <<<"$base") == "$prefix"* ]] && keep=1
    done
    if (( !keep )); then
        echo "removing $base (no longer listed)"
        rm -f "$wheel"
    fi
done
"$PYTHON" -m splitmoe.bench.gpu_check check-wheels "$WHEELS_DIR" bench/gpu/image-packages.txt

if [[ ! -d $FIXTURES_SRC ]]; then
    echo "prepare.sh: no fixtures at $FIXTURES_SRC (set SPLITMOE_FIXTURES_DIR)" >&2
    exit 1
fi
"$PYTHON" -m splitmoe.bench.gpu_check fixtures "$FIXTURES_SRC" .gpu/fixtures

mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }
bytes_of() { find "$@" -type f -printf '%s\n' | awk '{ s += $1 } END { print s + 0 }'; }
wheels_bytes=$(bytes_of "$WHEELS_DIR")
fixtures_bytes=$(bytes_of .gpu/fixtures)
# what travels besides: tracked files and untracked ones git does not ignore
tree_bytes=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
             | awk '{ s += $1 } END { print s + 0 }')
carried=$((wheels_bytes + fixtures_bytes))
echo "wheels:   $(ls "$WHEELS_DIR" | wc -l) files, $(mib "$wheels_bytes")"
ls -l "$WHEELS_DIR" | awk 'NR > 1 { printf "  %8.2f MiB  %s\n", $5 / 1048576, $9 }'
echo "fixtures: $(find .gpu/fixtures -type f | wc -l) files, $(mib "$fixtures_bytes")"
echo "tree:     $(mib "$tree_bytes") (tracked and untracked-not-ignored files)"
echo "carried:  $(mib "$carried") in .gpu/ (limit $LIMIT_MIB MiB); with the tree $(mib $((carried + tree_bytes))) of 64 MiB"
if (( carried > LIMIT_MIB * 1048576 )); then
    echo "prepare.sh: .gpu/ holds $(mib "$carried"), over $LIMIT_MIB MiB" >&2
    exit 1
fi
if (( carried + tree_bytes > 64 * 1048576 )); then
    echo "prepare.sh: .gpu/ and the tree together exceed 64 MiB: the tree would not travel" >&2
    exit 1
fi
echo "ready: carry .gpu, then run bench/gpu/run.sh OUT there"
