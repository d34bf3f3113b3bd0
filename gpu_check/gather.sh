#!/bin/sh
# Gather what the GPU check installs on an NVIDIA machine without a network (README.md here):
# llama-cpp-python's sdist, slimmed to what a CUDA build reads (gpu_check/sdist.py), and the
# pure-Python wheels it needs to build without isolation and to run.
#
#   gpu_check/gather.sh [DEST]          DEST (default gpu_check/wheels) must be new or empty
#
# LLAMA_CPP_PYTHON_VERSION: the sdist's version (default: the one this checkout's venv has).
# TARGET_PYTHON: the GPU machine's Python (default 3.12). EXTRA="numpy psutil jinja2
# markupsafe typing-extensions": binary wheels too, for a machine that lacks them.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
repo=$(dirname "$here")
dest=${1:-$here/wheels}
py=${PYTHON:-$repo/.venv/bin/python}
[ -x "$py" ] || py=python3
if [ -d "$dest" ] && [ -n "$(ls -A "$dest")" ]; then
    echo "gather.sh: error: $dest is not empty; remove it or name another folder" >&2
    exit 1
fi
version=${LLAMA_CPP_PYTHON_VERSION:-$("$py" -c \
    'import importlib.metadata as m; print(m.version("llama-cpp-python"))' 2>/dev/null \
    || echo 0.3.36)}
target=${TARGET_PYTHON:-3.12}
mkdir -p "$dest"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

"$py" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$version" -d "$tmp"
(cd "$repo" && "$py" -m gpu_check.sdist "$tmp/llama_cpp_python-$version.tar.gz" \
    "$dest/llama_cpp_python-$version.tar.gz") >"$dest/llama_cpp_python-$version.slim.json"

# diskcache: llama-cpp-python imports it; the rest: its build backend, used without isolation
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$target" \
    -d "$dest" diskcache scikit-build-core pathspec packaging
for name in ${EXTRA:-}; do
    "$py" -m pip download -q --no-deps --only-binary=:all: --python-version "$target" \
        --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
        --platform manylinux2014_x86_64 -d "$dest" "$name"
done
ls -l "$dest"
du -sh "$dest"
