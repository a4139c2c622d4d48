#!/usr/bin/env bash
# Build a CPU-only llama.cpp "peer" for comparisons with still.
#
# The llama.cpp source comes from the llama-cpp-python sdist on PyPI (it vendors
# llama.cpp under vendor/llama.cpp), fetched with pip. Nothing from llama.cpp is
# ever committed: everything lands in peer/ (git-ignored).
#
#   peer/cache/   the sdist tarball
#   peer/src/     extracted vendor/llama.cpp
#   peer/build/   CMake build tree
#   peer/llama-*  the built tools (static, self-contained)
#   peer/VERSION  what was built
#
# Usage: scripts/build-llama-cpp.sh [--force | --clean]
#   --force  re-run configure + build even if the binaries exist (incremental)
#   --clean  wipe peer/src and peer/build first (full rebuild, ~15 min on 2 cores)
# Env:   LCP_VERSION (default pinned below), PEER_DIR (default <repo>/peer),
#        JOBS (default 2), LCP_SDIST (path to an already-downloaded sdist).
set -euo pipefail

LCP_VERSION="${LCP_VERSION:-0.3.36}"
# sha256 of llama_cpp_python-0.3.36.tar.gz (checked only for the pinned version)
LCP_SHA256_0_3_36="832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PEER="${PEER_DIR:-$ROOT/peer}"
JOBS="${JOBS:-2}"
TOOLS=(llama-perplexity llama-bench llama-completion llama-simple llama-tokenize llama-server)

CACHE="$PEER/cache"
SRC="$PEER/src/llama.cpp"
BUILD="$PEER/build"
TARBALL_NAME="llama_cpp_python-${LCP_VERSION}.tar.gz"
TARBALL="$CACHE/$TARBALL_NAME"

log() { printf '[build-llama-cpp] %s\n' "$*" >&2; }
die() { printf '[build-llama-cpp] ERROR: %s\n' "$*" >&2; exit 1; }

FORCE=0
case "${1:-}" in
    "") ;;
    --force) FORCE=1 ;;
    --clean) FORCE=1; rm -rf "$PEER/src" "$PEER/build" ;;
    *) die "unknown argument '$1' (expected --force or --clean)" ;;
esac

all_built() {
    local t
    for t in "${TOOLS[@]}"; do [[ -x "$PEER/$t" ]] || return 1; done
    [[ -f "$PEER/VERSION" ]]
}

if [[ $FORCE == 0 ]] && all_built; then
    log "peer already built in $PEER (use --force to rebuild):"
    cat "$PEER/VERSION"
    exit 0
fi

mkdir -p "$CACHE"

expected_sha() {
    local v="LCP_SHA256_${LCP_VERSION//./_}"
    printf '%s' "${!v:-}"
}

check_tarball() {   # $1 = file; returns 0 if usable
    local f="$1" want got
    [[ -s "$f" ]] || return 1
    want="$(expected_sha)"
    if [[ -n "$want" ]]; then
        got="$(sha256sum "$f" | cut -d' ' -f1)"
        if [[ "$got" != "$want" ]]; then
            log "sha256 mismatch for $f (got $got, want $want); ignoring it"
            return 1
        fi
    fi
    tar tzf "$f" >/dev/null 2>&1 || { log "$f is not a readable tarball; ignoring it"; return 1; }
}

# 1. Locate or fetch the sdist.
if ! check_tarball "$TARBALL"; then
    rm -f "$TARBALL"
    for cand in "${LCP_SDIST:-}" "/tmp/dl/$TARBALL_NAME" "/tmp/dl/lcp/$TARBALL_NAME"; do
        if [[ -n "$cand" ]] && check_tarball "$cand"; then
            log "using existing sdist $cand"
            cp "$cand" "$TARBALL.tmp" && mv "$TARBALL.tmp" "$TARBALL"
            break
        fi
    done
fi
if [[ ! -s "$TARBALL" ]]; then
    log "downloading llama-cpp-python==$LCP_VERSION sdist from PyPI with pip ..."
    # pip download of an sdist also prepares its metadata: it installs the build
    # backend (scikit-build-core, + the cmake wheel if no usable cmake is on PATH)
    # into a throw-away env; a few seconds, nothing is compiled. --no-binary is
    # limited to llama-cpp-python so those build deps may come as wheels
    # (with :all: pip would compile e.g. cmake from source).
    dl="$(mktemp -d "$CACHE/dl.XXXXXX")"
    if ! python3 -m pip download --no-deps --no-binary llama-cpp-python --timeout 30 --retries 2 \
            -d "$dl" "llama-cpp-python==$LCP_VERSION" >"$dl/pip.log" 2>&1; then
        tail -n 20 "$dl/pip.log" >&2 || true
        rm -rf "$dl"
        die "could not download llama-cpp-python==$LCP_VERSION from PyPI (is PyPI reachable? \
pip config/proxy ok?). You can also place $TARBALL_NAME at $TARBALL or pass LCP_SDIST=/path/to/it."
    fi
    [[ -s "$dl/$TARBALL_NAME" ]] || { rm -rf "$dl"; die "pip did not produce $TARBALL_NAME"; }
    check_tarball "$dl/$TARBALL_NAME" || { rm -rf "$dl"; die "downloaded sdist failed verification"; }
    mv "$dl/$TARBALL_NAME" "$TARBALL"
    rm -rf "$dl"
fi
log "sdist: $TARBALL ($(sha256sum "$TARBALL" | cut -d' ' -f1))"

# 2. Extract vendor/llama.cpp (and the submodule's git HEAD, for the commit id).
top="llama_cpp_python-${LCP_VERSION}"
stamp="$PEER/src/.extracted-$LCP_VERSION"
if [[ ! -f "$stamp" || ! -f "$SRC/CMakeLists.txt" ]]; then
    log "extracting vendor/llama.cpp ..."
    rm -rf "$PEER/src" && mkdir -p "$PEER/src"
    tmp="$(mktemp -d "$PEER/src/x.XXXXXX")"
    tar xzf "$TARBALL" -C "$tmp" "$top/vendor/llama.cpp"
    # Submodule HEAD (present in the sdist as .git/modules/vendor/llama.cpp/HEAD).
    tar xzf "$TARBALL" -C "$tmp" "$top/.git/modules/vendor/llama.cpp/HEAD" 2>/dev/null || true
    mv "$tmp/$top/vendor/llama.cpp" "$SRC"
    # The vendored tree's .git is a gitlink file pointing outside it; drop it so
    # nothing mistakes the tree for a checkout.
    rm -f "$SRC/.git"
    if [[ -f "$tmp/$top/.git/modules/vendor/llama.cpp/HEAD" ]]; then
        head -c 40 "$tmp/$top/.git/modules/vendor/llama.cpp/HEAD" >"$PEER/src/llama.cpp.commit"
    fi
    rm -rf "$tmp"
    touch "$stamp"
fi
COMMIT="$(cat "$PEER/src/llama.cpp.commit" 2>/dev/null || echo unknown)"
SHORT="${COMMIT:0:7}"
log "llama.cpp commit: $COMMIT"

# 3. Configure + build only the tools we need.
#    llama-completion is the classic one-shot generator (the old llama-cli);
#    the current llama-cli is a chat UI built on the server code, not built here.
# GIT_CEILING_DIRECTORIES: the source tree sits inside this project's git
# checkout; without the ceiling, llama.cpp/ggml's CMake would run `git rev-parse`
# and stamp *our* commit (and commit count) into the binaries' version strings.
log "configuring (Release, GGML_NATIVE=ON, static) ..."
GIT_CEILING_DIRECTORIES="$PEER/src" cmake -S "$SRC" -B "$BUILD" \
    -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF \
    -DBUILD_SHARED_LIBS=OFF \
    -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=ON \
    -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON \
    -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF \
    -DLLAMA_BUILD_COMMIT="$SHORT" \
    -DLLAMA_BUILD_NUMBER=0 \
    -Wno-dev >"$PEER/cmake-configure.log" 2>&1 \
    || { tail -n 30 "$PEER/cmake-configure.log" >&2; die "cmake configure failed (log: $PEER/cmake-configure.log)"; }

log "building ${TOOLS[*]} with -j$JOBS (takes a while on 2 cores) ..."
GIT_CEILING_DIRECTORIES="$PEER/src" cmake --build "$BUILD" --config Release -j "$JOBS" --target "${TOOLS[@]}" \
    || die "build failed"

for t in "${TOOLS[@]}"; do
    install -m 755 "$BUILD/bin/$t" "$PEER/$t"
done

{
    echo "llama-cpp-python sdist: $LCP_VERSION ($(sha256sum "$TARBALL" | cut -d' ' -f1))"
    echo "llama.cpp commit:       $COMMIT"
    echo "compiler:               $(${CC:-cc} --version | head -n1)"
    echo "flags:                  Release GGML_NATIVE=ON BUILD_SHARED_LIBS=OFF LLAMA_OPENSSL=OFF"
    echo "tools:                  ${TOOLS[*]}"
    echo "built:                  $(date -u +%Y-%m-%dT%H:%M:%SZ)"
} >"$PEER/VERSION"

log "done. Binaries in $PEER:"
cat "$PEER/VERSION"
"$PEER/llama-bench" --version 2>&1 | tail -n 2 || true
