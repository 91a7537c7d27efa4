#!/usr/bin/env bash
# The SHA-256 of kvtier's sources in this tree (Python, C, stubs, build files): what a kvtier
# wheel is built from. `make gpu-wheels` records it beside a prebuilt wheel, and
# bench/gpu_check.sh uses that wheel only when the tree it checks has the same digest.
set -euo pipefail
cd "$(dirname "$0")/.."
{
    find config ipc daemon client engine launch cli kernels bench -type f \
        \( -name '*.py' -o -name '*.c' -o -name '*.h' -o -name '*.pyi' \) -print0
    printf '%s\0' setup.py pyproject.toml
} | LC_ALL=C sort -z | xargs -0 sha256sum | sha256sum | cut -d' ' -f1
