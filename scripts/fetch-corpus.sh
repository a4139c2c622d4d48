#!/usr/bin/env bash
# Assemble a plain-English training corpus for `still linearize --data FILE...`
# from public-domain texts shipped in Debian packages. Nothing is installed:
# each package is fetched with `apt-get download` (no root needed) and unpacked
# with `dpkg-deb -x` into a temporary directory, then converted to plain UTF-8
# prose (paragraphs separated by a blank line, \n line endings).
#
# Usage: scripts/fetch-corpus.sh [OUT_DIR]      (default: data/corpus)
#
# Sources (licence as stated in each package's /usr/share/doc/PKG/copyright;
# the script re-checks that file says "public domain" before using a package):
#   web-bible.txt          sword-text-web  World English Bible (modern English,
#                          with deuterocanon), SWORD zText module.
#                          "The World English Bible is in the Public Domain.
#                          That means that it is not copyrighted."
#   kjv-bible.txt          sword-text-kjv  King James Version (1611; eBible.org
#                          2006 edition), SWORD zText module.
#                          "License: public-domain" (the copyright file notes
#                          the Crown's letters patent restrict printing in the
#                          UK only; outside the UK it is in the public domain).
#   jargon-file.txt        dict-jargon     The Jargon File 4.4.7 (dictd format).
#                          "This document (the Jargon File) is in the public
#                          domain, to be freely used, shared, and modified."
#   devils-dictionary.txt  dict-devil      Ambrose Bierce, The Devil's
#                          Dictionary (1911; dictd format). "The Devil's
#                          Dictionary is in the public domain, its copyright
#                          has expired."
# Together about 10 MiB of text.
#
# Considered and not used: bible-kjv-text (public-domain KJV, but stored in a
# private compressed format that only the `bible` program reads; the SWORD
# module above is the same text); fortunes / fortunes-min (BSD licence covers
# the program, the quotations themselves come from many still-copyrighted
# authors); doc-rfc (not public domain); wamerican and miscfiles (word lists
# and data tables, not prose); dict-gcide, dict-foldoc, dict-vera (not
# public-domain licences).
#
# Idempotent: a file already present (non-empty) in OUT_DIR is kept and its
# package is not downloaded again. Each file is written under a temporary name
# in OUT_DIR and renamed into place, so an interrupted run leaves no partial
# file. Needs apt-get, dpkg-deb, python3 and iconv, and apt package lists that
# know the packages (as on a stock Debian/Ubuntu; else `sudo apt-get update`).
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)

case "${1:-}" in
  -h|--help) sed -n '2,9p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
esac
[ $# -le 1 ] || { echo "usage: $0 [OUT_DIR]" >&2; exit 2; }
OUT_DIR=${1:-$REPO/data/corpus}

die() { echo "fetch-corpus: error: $*" >&2; exit 1; }
# Print a path relative to the current directory when it lies below it.
pretty() { case "$1" in "$PWD"/*) echo "${1#"$PWD"/}" ;; *) echo "$1" ;; esac; }

# name | Debian package | format | path of the text inside the package
SOURCES=(
  "web-bible.txt|sword-text-web|sword|usr/share/sword/modules/texts/ztext/engWEB2015eb"
  "kjv-bible.txt|sword-text-kjv|sword|usr/share/sword/modules/texts/ztext/engKJV2006eb"
  "jargon-file.txt|dict-jargon|dict|usr/share/dictd/jargon"
  "devils-dictionary.txt|dict-devil|dict|usr/share/dictd/devil"
)

# Converter: `python3 -c "$CONVERT" FORMAT SRC OUT` writes plain text to OUT.
#   sword: SRC is a SWORD zText module directory (ot/nt .bzs .bzv .bzz files:
#          zlib-compressed blocks of OSIS XML, one index entry per verse).
#   dict:  SRC is a dictd base name (SRC.index and SRC.dict.dz).
CONVERT=$(cat <<'PY'
import gzip, html, os, re, struct, sys, unicodedata, zlib

def sword_osis(moddir):
    verses = []
    for part in ("ot", "nt"):
        base = os.path.join(moddir, part)
        if not os.path.exists(base + ".bzs"):
            continue
        bzs = open(base + ".bzs", "rb").read()
        bzv = open(base + ".bzv", "rb").read()
        bzz = open(base + ".bzz", "rb").read()
        blocks = []
        for i in range(0, len(bzs) - 11, 12):
            off, size, _ = struct.unpack_from("<III", bzs, i)
            blocks.append(zlib.decompress(bzz[off:off + size]))
        for i in range(0, len(bzv) - 9, 10):
            blk, off, size = struct.unpack_from("<IIH", bzv, i)
            if size:
                verses.append(blocks[blk][off:off + size].decode("utf-8"))
    if not verses:
        sys.exit("no ot/nt zText files in " + moddir)
    return " ".join(verses)

def osis_to_text(s):
    s = re.sub(r"<note\b[^>]*/>", "", s)
    s = re.sub(r"<note\b.*?</note>", "", s, flags=re.S)      # footnotes, cross-refs
    s = re.sub(r"<(title|speaker)\b[^>]*/>", "", s)
    s = re.sub(r"<(title|speaker)\b[^>]*>(.*?)</\1>",           # headings: own paragraph
               lambda m: "\n\n" + re.sub(r"<[^>]*>", "", m.group(2)) + "\n\n", s, flags=re.S)
    s = re.sub(r"<div\b[^>]*\btype=\"x-milestone\"[^>]*>", "", s)
    s = re.sub(r"</?(div|chapter|lg|list|p)\b[^>]*>", "\n\n", s)  # paragraph breaks
    s = re.sub(r"<lb\b[^>]*\btype=\"x-p\"[^>]*>", "\n\n", s)
    s = re.sub(r"<lb\b[^>]*>", "\n", s)
    s = re.sub(r"<l\b[^>]*\beID=[^>]*>|</l>|</item>", "\n", s)    # verse lines, list items
    s = re.sub(r"<[^>]*>", "", s)                                # Strong's <w>, <q>, ...
    s = html.unescape(s)
    s = re.sub(r"\\\+?[a-z]+[0-9]*\*? ?", "", s)               # stray USFM (\nd)
    return s.replace("\u00b6", "")                              # KJV pilcrows

B64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/"

def b64num(s):
    n = 0
    for c in s:
        n = n * 64 + B64.index(c)
    return n

def indent(line):
    return len(line) - len(line.lstrip(" "))

def body_to_paragraphs(lines):
    """Unwrap prose; keep line breaks in blocks indented deeper than the body
    (verse, examples) and in box-drawn tables."""
    lines = [l.rstrip() for l in lines]
    nonblank = [l for l in lines if l.strip()]
    if not nonblank:
        return []
    base = min(indent(l) for l in nonblank)
    blocks, cur = [], []
    for l in lines + [""]:
        if l.strip():
            cur.append(l)
        elif cur:
            blocks.append(cur)
            cur = []
    paras = []
    for b in blocks:
        if min(indent(l) for l in b) > base or re.search("[\u2500-\u257f]", "".join(b)):
            paras.append("\n".join(l.strip() for l in b))
            continue
        cur = []
        for l in b:                       # an indented line starts a new paragraph
            if cur and indent(l) > base:
                paras.append(" ".join(cur))
                cur = []
            cur.append(l.strip())
        paras.append(" ".join(cur))
    return paras

def dict_to_text(base):
    data = gzip.open(base + ".dict.dz").read()
    spans = {}
    with open(base + ".index", encoding="utf-8") as f:
        for line in f:
            fields = line.rstrip("\n").split("\t")
            if len(fields) >= 3:
                spans.setdefault((b64num(fields[1]), b64num(fields[2])), fields[0])
    out = []
    for (off, n), word in sorted(spans.items()):
        entry = data[off:off + n].decode("utf-8").replace("\r\n", "\n").replace("\r", "\n")
        lines = entry.split("\n")
        if word.startswith("00"):         # dictfmt metadata entries
            # keep a book preface if the info entry carries one (The Devil's Dictionary)
            m = re.search(r"^\s*PREFACE\s*$", entry, re.M)
            if re.sub(r"\W", "", word).endswith("info") and m:
                out.append(["PREFACE"] + body_to_paragraphs(entry[m.end():].split("\n")))
            continue
        paras = []
        if len(lines) > 1 and not lines[0].startswith(" ") and (
                lines[1] == "" or lines[1].startswith(" ")):
            # "headword\n pronunciation, part of speech\n\n    body" (Jargon File)
            extra = re.sub(r"^//,?\s*", "", lines[1].strip())
            paras.append(lines[0].strip() + (", " + extra if extra else ""))
            lines = lines[2:]
        paras += body_to_paragraphs(lines)
        out.append(paras)
    text = "\n\n".join("\n\n".join(p for p in paras if p) for paras in out if paras)
    text = re.sub(r"\{\s*([^{}]*?)\s*\}", r"\1", text)          # {cross reference}
    text = re.sub(r"(?<!\w)_([^_\n]+)_(?!\w)", r"\1", text)     # _italics_
    text = re.sub(r"\u201c[ \t]+", "\u201c", text)              # re-wrap artefacts
    text = re.sub(r"[ \t]+\u201d", "\u201d", text)
    return text

def tidy(s):
    s = s.replace("\r\n", "\n").replace("\r", "\n").replace("\t", " ")
    s = unicodedata.normalize("NFC", s)
    s = re.sub(r"[\x00-\x08\x0b-\x1f\x7f\u00ad\ufeff]", "", s)
    s = "\n".join(re.sub(r" {2,}", " ", l).strip() for l in s.split("\n"))
    s = re.sub(r"(?<=[\w)\]\u2019\u201d]) +([,.;:!?])(?=\s|$)", r"\1", s)
    s = re.sub(r"\n{3,}", "\n\n", s).strip("\n")
    return s + "\n"

fmt, src, dst = sys.argv[1:4]
if fmt == "sword":
    text = osis_to_text(sword_osis(src))
elif fmt == "dict":
    text = dict_to_text(src)
else:
    sys.exit("unknown format " + fmt)
with open(dst, "w", encoding="utf-8", newline="\n") as f:
    f.write(tidy(text))
PY
)

WORK=""
TMP_OUT=""
cleanup() {
  [ -z "$TMP_OUT" ] || rm -f "$TMP_OUT"
  [ -z "$WORK" ] || rm -rf "$WORK"
}
trap cleanup EXIT
trap 'exit 130' INT TERM

checked=0
check_tools() {
  [ "$checked" = 1 ] && return
  local t
  for t in apt-get dpkg-deb python3 iconv; do
    command -v "$t" >/dev/null 2>&1 ||
      die "'$t' not found; this script needs a Debian/Ubuntu system with apt-get, dpkg-deb, python3 and iconv"
  done
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/fetch-corpus.XXXXXX")
  checked=1
}

mkdir -p "$OUT_DIR" || die "cannot create $OUT_DIR"

for src in "${SOURCES[@]}"; do
  IFS='|' read -r name pkg fmt path <<<"$src"
  dest="$OUT_DIR/$name"
  if [ -s "$dest" ]; then
    echo "fetch-corpus: $(pretty "$dest") present, skipped" >&2
    continue
  fi
  check_tools
  echo "fetch-corpus: downloading $pkg ..." >&2
  mkdir -p "$WORK/$pkg/deb" "$WORK/$pkg/root"
  if ! (cd "$WORK/$pkg/deb" && apt-get download -q "$pkg") >"$WORK/$pkg/apt.log" 2>&1; then
    msg=$(grep -E '^E:' "$WORK/$pkg/apt.log" | tail -n 1 || true)
    [ -n "$msg" ] || msg=$(tail -n 1 "$WORK/$pkg/apt.log")
    die "apt-get download $pkg failed: ${msg:-no output} (network? try 'sudo apt-get update')"
  fi
  debs=("$WORK/$pkg/deb/"*.deb)
  deb=${debs[0]}
  [ -f "$deb" ] || die "apt-get download $pkg produced no .deb file"
  dpkg-deb -x "$deb" "$WORK/$pkg/root" 2>"$WORK/$pkg/dpkg.log" ||
    die "dpkg-deb -x $(basename "$deb") failed: $(tail -n 1 "$WORK/$pkg/dpkg.log")"
  copyright="$WORK/$pkg/root/usr/share/doc/$pkg/copyright"
  grep -Eqi 'public[- ]domain' "$copyright" 2>/dev/null ||
    die "$pkg: $copyright does not say 'public domain' any more; not using it"
  [ -e "$WORK/$pkg/root/$path" ] || [ -e "$WORK/$pkg/root/$path.index" ] ||
    die "$pkg: expected $path in $(basename "$deb"); package layout changed"

  TMP_OUT="$OUT_DIR/.$name.tmp.$$"
  python3 -c "$CONVERT" "$fmt" "$WORK/$pkg/root/$path" "$TMP_OUT" ||
    die "converting $pkg to text failed"
  iconv -f UTF-8 -t UTF-8 "$TMP_OUT" >/dev/null 2>&1 || die "$name: output is not valid UTF-8"
  size=$(stat -c %s "$TMP_OUT")
  [ "$size" -ge 100000 ] || die "$name: only $size bytes of text from $pkg; conversion broken?"
  mv -f "$TMP_OUT" "$dest"
  TMP_OUT=""
  rm -rf "${WORK:?}/$pkg"
done

mib() { LC_ALL=C awk -v s="$1" 'BEGIN { printf "%.1f MiB", s / 1048576 }'; }
total=0
for src in "${SOURCES[@]}"; do
  name=${src%%|*}
  size=$(stat -c %s "$OUT_DIR/$name")
  total=$((total + size))
  printf '%-40s %10d bytes %10s\n' "$(pretty "$OUT_DIR/$name")" "$size" "$(mib "$size")"
done
printf '%-40s %10d bytes %10s\n' "total" "$total" "$(mib "$total")"
