#!/usr/bin/env bash
# fetch-gpu-wheels.sh [DIR]: the wheels a GPU machine without network needs to run whetstone from
# src/ (default DIR: .whl, kept out of git by .gitignore): the shared list
# (../shared/device/fetch-wheels, when this checkout sits beside it) plus what whetstone added
# since: tensorboard, for every role's event files, and what it imports to write them; and
# opentelemetry-api, which fastapi imports from 0.165 on.
# scripts/gpu-check.sh installs them there.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-.whl}
mkdir -p "$dir"
shared=../shared/device/fetch-wheels
if [ -x "$shared" ]; then
    "$shared" "$dir"
else
    echo "no $shared here: fetching only the wheels whetstone adds to it" >&2
fi
for req in tensorboard==2.21.0 protobuf==7.36.2 absl-py==2.5.1 opentelemetry-api==1.45.2; do  # the versions CI installs
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        --platform any -d "$dir" "$req"
done
du -sh "$dir"
