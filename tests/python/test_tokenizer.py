"""Tokenizer tests: still's BPE tokenizer (via tests/tools/tokenize_tool)
against a Hugging Face `tokenizers` Tokenizer built from the same GGUF
vocabulary, merges and pre-tokenizer; byte-exact round trips; special tokens;
ChatML rendering against the GGUF's Jinja chat template.

Environment: STILL_BUILD_DIR (directory holding tokenize_tool), STILL_MODEL
(SmolLM2 GGUF); tests skip when either is absent. STILL_CORPUS optionally
points at the text corpus (default ../shared/data/corpus beside the repository)."""
import os
import pathlib
import random
import subprocess

import pytest

gguf = pytest.importorskip("gguf")
tokenizers = pytest.importorskip("tokenizers")
jinja2 = pytest.importorskip("jinja2")
from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: E402

MODEL = os.environ.get("STILL_MODEL", "")
BUILD = os.environ.get("STILL_BUILD_DIR", "")
CORPUS = pathlib.Path(os.environ.get(
    "STILL_CORPUS", pathlib.Path(__file__).resolve().parents[2].parent / "shared" / "data" / "corpus"))

if not MODEL or not os.path.exists(MODEL):
    pytest.skip(f"model not found (STILL_MODEL={MODEL!r})", allow_module_level=True)
if not BUILD:
    pytest.skip("STILL_BUILD_DIR not set", allow_module_level=True)
TOOL = os.path.join(BUILD, "tokenize_tool")

TYPE_CONTROL, TYPE_USER_DEFINED = 3, 4


# ---------------------------------------------------------------------------
# reference: GGUF metadata -> HF tokenizer

def _gguf_meta(path):
    r = gguf.GGUFReader(path)

    def field(key):
        return r.fields.get(key)

    def strings(key):
        f = field(key)
        return [bytes(f.parts[i]).decode("utf-8") for i in f.data]

    def scalar(key):
        f = field(key)
        return None if f is None else f.parts[f.data[0]][0]

    tt = field("tokenizer.ggml.token_type")
    tmpl = field("tokenizer.chat_template")
    return {
        "model": bytes(field("tokenizer.ggml.model").parts[-1]).decode(),
        "pre": bytes(field("tokenizer.ggml.pre").parts[-1]).decode(),
        "tokens": strings("tokenizer.ggml.tokens"),
        "merges": strings("tokenizer.ggml.merges"),
        "types": [int(tt.parts[i][0]) for i in tt.data],
        "bos": int(scalar("tokenizer.ggml.bos_token_id")),
        "eos": int(scalar("tokenizer.ggml.eos_token_id")),
        "template": None if tmpl is None else bytes(tmpl.parts[-1]).decode("utf-8"),
    }


@pytest.fixture(scope="module")
def meta():
    m = _gguf_meta(MODEL)
    assert m["model"] == "gpt2" and m["pre"] == "smollm"
    return m


def _bytes_to_unicode():
    bs = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


@pytest.fixture(scope="module")
def byte_tokens(meta):
    """byte value -> id of its single-byte token (absent if the vocab lacks it)."""
    vocab = {t: i for i, t in enumerate(meta["tokens"])}
    return {b: vocab[c] for b, c in _bytes_to_unicode().items() if c in vocab}


@pytest.fixture(scope="module")
def hf(meta):
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(meta["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in meta["merges"]]
    tk = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    # SmolLM2's tokenizer.json: Sequence[Digits(individual_digits), ByteLevel]
    tk.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens([AddedToken(t, special=True, normalized=False)
                           for t, ty in zip(meta["tokens"], meta["types"])
                           if ty in (TYPE_CONTROL, TYPE_USER_DEFINED)])
    return tk


def hf_ids(tk, text, special=False):
    tk.encode_special_tokens = not special   # True: special token strings are plain text
    return tk.encode(text, add_special_tokens=False).ids


# ---------------------------------------------------------------------------
# the tool

def _records(items):
    return b"".join(b"%d\n%s\n" % (len(b), b) for b in items)


def _parse_line(line):
    parts = line.split()
    assert parts and parts[0] in ("OK", "RTFAIL"), line
    return parts[0] == "OK", [int(x) for x in parts[1:]]


def run_tool(texts, special=False):
    """Encode byte strings with still; returns [(roundtrip_ok, ids)]."""
    if not os.path.exists(TOOL):
        pytest.fail(f"{TOOL} not built")
    args = [TOOL] + (["--special"] if special else []) + [MODEL, "-"]
    p = subprocess.run(args, input=_records(texts), capture_output=True, timeout=300)
    assert p.returncode in (0, 1), p.stderr.decode(errors="replace")
    lines = p.stdout.decode().splitlines()
    assert len(lines) == len(texts), p.stderr.decode(errors="replace")
    return [_parse_line(l) for l in lines]


def run_chat(messages, gen):
    items = []
    for m in messages:
        items += [m["role"].encode(), m["content"].encode()]
    args = [TOOL, "--chat"] + (["--gen"] if gen else []) + [MODEL, "-"]
    p = subprocess.run(args, input=_records(items), capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr.decode(errors="replace")
    out = p.stdout
    nl = out.index(b"\n")
    n = int(out[:nl])
    rendered = out[nl + 1:nl + 1 + n]
    assert out[nl + 1 + n:nl + 2 + n] == b"\n"
    ok, ids = _parse_line(out[nl + 2 + n:].decode())
    return rendered, ok, ids


def check_against_hf(hf, byte_tokens, texts, special=False):
    """Compare ids with HF; round trip must be exact unless the text holds a
    byte the vocabulary cannot represent. Returns the number compared."""
    res = run_tool([t.encode("utf-8") for t in texts], special)
    bad = []
    for t, (ok, ids) in zip(texts, res):
        ref = hf_ids(hf, t, special)
        representable = all(b in byte_tokens for b in t.encode("utf-8"))
        if ids != ref or ok != representable:
            bad.append(f"{t[:60]!r}: ours={ids[:20]} hf={ref[:20]} roundtrip={ok}")
    assert not bad, f"{len(bad)}/{len(texts)} differ:\n" + "\n".join(bad[:10])
    return len(texts)


# ---------------------------------------------------------------------------
# texts

TEXTS = [
    # English prose
    "Hello world",
    "The quick brown fox jumps over the lazy dog.",
    "It was the best of times, it was the worst of times, it was the age of wisdom...",
    "  Leading spaces and trailing spaces   ",
    "Mr. O'Neil's cat wasn't there; \"quoted\" text (parenthesised) [bracketed] {braced}.",
    # contractions
    "I'm sure you're right, they've said we'll go and he'd agree, it's John's.",
    "DON'T SHOUT: IT'S HE'S WE'RE THEY'VE I'M YOU'LL SHE'D",
    "'s 't 're 've 'm 'll 'd 'S 'T 'RE 'x '' ''s",
    "rock'n'roll o'clock y'all ma'am 'tis",
    # code
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "import numpy as np\nx = np.arange(10)**2  # squares\nprint(f\"{x.sum():,}\")\n",
    "class Foo(Base):\n\tdef __init__(self, *args, **kwargs):\n\t\tsuper().__init__(*args, **kwargs)\n",
    "#include <stdio.h>\nint main(void) {\n    printf(\"%d\\n\", 42);\n    return 0;\n}\n",
    "for (size_t i = 0; i < n; ++i) { a[i] = b[i] * c[i] + (i >> 2) ^ 0xFF; }",
    '{"name": "still", "version": [1, 2, 3], "nested": {"ok": true, "x": null}, "pi": 3.14}',
    "<html><body class=\"main\"><a href='https://example.com/?q=1&r=2'>link</a></body></html>",
    "SELECT id, name FROM users WHERE age >= 18 AND name LIKE '%son' ORDER BY id DESC;",
    "$ ls -la | grep -v '^d' > /tmp/out.txt && echo $?",
    # numbers
    "1234567",
    "3.14159 and 2.71828",
    "1,000,000 dollars; -42; +7; 1e-10; 0x1F; 007; 1st 2nd 3rd",
    "Phone: (555) 123-4567, year 2024, version 10.0.19045",
    "٣٤٥ ١٢ ۱۲۳ १२३ ๑๒๓ １２３ ½ ¾ ² ³ Ⅻ ⑦",
    # punctuation and whitespace runs
    "!!!???...,,,;;;:::---___***///\\\\\\|||",
    "Wait... what?! No -- really??? (yes!!!)",
    "tab\tseparated\tvalues\t\tdouble tab",
    "multiple     spaces   here  and  there",
    "line1\nline2\n\nline4\n\n\n\nline8",
    "windows\r\nline\r\nendings\r\n",
    "trailing spaces   \n   leading after newline",
    "   ",
    "\n",
    " \t \n \r\n \u00a0 \u3000 \u2003 x",
    "",
    # accented Latin, Greek, Cyrillic
    "Café crème brûlée, naïve façade, Ångström, Zürich, São Paulo, Łódź, Dvořák",
    "Ελληνικά: Η γρήγορη καφέ αλεπού πηδάει πάνω από τον τεμπέλη σκύλο.",
    "Русский текст: Съешь же ещё этих мягких французских булок, да выпей чаю.",
    # CJK, Arabic, others
    "日本語のテキスト：東京は日本の首都です。",
    "中文文本：我爱自然语言处理。今天天气很好！",
    "한국어 텍스트: 안녕하세요, 세계!",
    "النص العربي: مرحبا بالعالم، كيف حالك؟",
    "עברית: שלום עולם",
    "हिन्दी: नमस्ते दुनिया",
    "ไทย: สวัสดีชาวโลก",
    # emoji
    "Emoji: 😀😃😄 👍 🎉🎉🎉",
    "Family 👨‍👩‍👧‍👦 and couple 👩‍❤️‍👨 and flag 🏳️‍🌈 🇫🇷🇯🇵",
    "Skin tones: 👋🏻 👋🏼 👋🏽 👋🏾 👋🏿",
    "Keycaps 1️⃣ #️⃣ and variation ☺︎ ☺️",
    # mixed / odd
    "mixedCASE camelCase snake_case kebab-case SCREAMING_CASE",
    "URL: https://huggingface.co/HuggingFaceTB/SmolLM2-135M-Instruct?x=1#frag",
    "e-mail: someone@example.org, @mention #hashtag",
    "a\u0301e\u0301 (combining) ﬁ ﬂ (ligatures) Ａ Ｂ (fullwidth)",
    "zero\u200bwidth\u200cnon\u200djoiner\ufeffbom\u0085nel\u2028ls\u2029ps",
]


def test_text_count():
    assert len(TEXTS) >= 40


def test_handwritten_texts_match_hf(hf, byte_tokens):
    assert check_against_hf(hf, byte_tokens, TEXTS) == len(TEXTS)


def _corpus_chunks():
    picks = [("python-docs.txt", 0, 3000), ("python-docs.txt", 1_000_000, 3000),
             ("python-docs.txt", 5_000_000, 3000), ("jargon.txt", 500_000, 3000),
             ("austen/emma.txt", 100_000, 4000), ("austen/prideandprejudice.txt", 300_000, 4000)]
    out = []
    for name, off, n in picks:
        p = CORPUS / name
        if p.exists():
            with open(p, "rb") as f:
                f.seek(off)
                out.append(f.read(n).decode("utf-8", errors="ignore"))
    return out


def test_corpus_matches_hf(hf, byte_tokens):
    chunks = _corpus_chunks()
    if not chunks:
        pytest.skip(f"no corpus at {CORPUS}")
    check_against_hf(hf, byte_tokens, chunks)
    # and the chunks concatenated, as one long text
    check_against_hf(hf, byte_tokens, ["\n\n".join(chunks)])


def _random_texts(seed=1234, n=80):
    rng = random.Random(seed)
    pools = [
        (0x20, 0x7E), (0x09, 0x0D), (0xA0, 0x24F), (0x370, 0x3FF), (0x400, 0x4FF),
        (0x590, 0x6FF), (0x900, 0x97F), (0xE00, 0xE7F), (0x1100, 0x11FF),
        (0x2000, 0x206F), (0x2070, 0x218F), (0x2460, 0x24FF), (0x3000, 0x30FF),
        (0x4E00, 0x9FFF), (0xAC00, 0xD7A3), (0xFF00, 0xFFEF), (0x1F300, 0x1FAFF),
        (0x1D400, 0x1D7FF), (0x20000, 0x2A6DF), (0x0, 0x10FFFF),
    ]
    out = []
    for _ in range(n):
        chars = []
        for _ in range(rng.randint(1, 40)):
            lo, hi = rng.choice(pools)
            cp = rng.randint(lo, hi)
            if 0xD800 <= cp <= 0xDFFF:
                cp = 0x20
            chars.append(chr(cp))
        out.append("".join(chars))
    return out


def test_random_unicode_matches_hf(hf, byte_tokens):
    check_against_hf(hf, byte_tokens, _random_texts())


# ---------------------------------------------------------------------------
# invalid UTF-8

def _split_utf8(b):
    """Maximal valid UTF-8 runs (str) and single invalid bytes (int)."""
    out, i, run = [], 0, 0
    while i < len(b):
        for k in range(1, 5):
            try:
                b[i:i + k].decode("utf-8")
                break
            except UnicodeDecodeError:
                continue
        else:
            k = 0
        if k:
            i += k
            continue
        if i > run:
            out.append(b[run:i].decode("utf-8"))
        out.append(b[i])
        i += 1
        run = i
    if len(b) > run:
        out.append(b[run:].decode("utf-8"))
    return out


INVALID = [
    b"\x80", b"\xbf\xbf", b"abc\x80def", b"\xe4\xb8", b"\xe4\xb8 truncated CJK",
    b"hello \xc3 world", b"\xed\xa0\x80 surrogate", b"\xf0\x9f\x98 truncated emoji \xf0\x9f\x98\x80",
    b"\xf4\x90\x80\x80 above U+10FFFF", b"\xe0\x80\x80 overlong", b"nul\x00byte\x00",
    b"\x80\x81\x82\x83 \x90 123\x9a456", b"<|im_start|>\xa0\xa1<|im_end|>",
]
UNREPRESENTABLE = [b"\xff", b"ab\xfe\xffcd", b"\xc0\xaf overlong slash", b"ctrl\x04\x06\x13end"]


def test_invalid_utf8_roundtrips(hf, byte_tokens):
    res = run_tool(INVALID)
    for b, (ok, ids) in zip(INVALID, res):
        assert all(x in byte_tokens for x in b)
        assert ok, f"{b!r} does not round-trip"
        expect = []
        for part in _split_utf8(b):
            expect += [byte_tokens[part]] if isinstance(part, int) else hf_ids(hf, part)
        assert ids == expect, f"{b!r}: {ids} != {expect}"
    # with special-token parsing the round trip still holds
    assert all(ok for ok, _ in run_tool(INVALID, special=True))


def test_unrepresentable_bytes_are_dropped(hf, byte_tokens):
    """The vocabulary has no token for some bytes (e.g. 0xFF): they are dropped
    like HF's BPE (no unk token) does; such input cannot round-trip."""
    res = run_tool(UNREPRESENTABLE)
    for b, (ok, ids) in zip(UNREPRESENTABLE, res):
        assert not ok
        expect = []
        for part in _split_utf8(b):
            if isinstance(part, int):
                expect += [byte_tokens[part]] if part in byte_tokens else []
            else:
                expect += hf_ids(hf, part)
        assert ids == expect, f"{b!r}: {ids} != {expect}"


# ---------------------------------------------------------------------------
# special tokens and chat template

SPECIAL_TEXTS = [
    "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|endoftext|>more text<|im_end|><|im_end|>",
    "<|im_start<|im_start|>|> partial <|im_end",
    "<repo_name>still<file_sep>src/main.c<filename>x.py<gh_stars>10",
]


def test_special_tokens(meta, hf, byte_tokens):
    ids_of = {t: i for i, t in enumerate(meta["tokens"])}
    check_against_hf(hf, byte_tokens, SPECIAL_TEXTS, special=True)
    check_against_hf(hf, byte_tokens, SPECIAL_TEXTS, special=False)
    with_sp = run_tool([t.encode() for t in SPECIAL_TEXTS], special=True)
    without = run_tool([t.encode() for t in SPECIAL_TEXTS], special=False)
    assert with_sp[0][1][0] == ids_of["<|im_start|>"] == 1
    assert ids_of["<|im_end|>"] in with_sp[0][1]
    assert with_sp[1][1] == [ids_of["<|endoftext|>"]] == [0]
    control = {i for i, ty in enumerate(meta["types"]) if ty == TYPE_CONTROL}
    for ok, ids in without:
        assert ok and not control & set(ids)


def test_tool_info(meta):
    p = subprocess.run([TOOL, "--info", MODEL], capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr
    info = dict(l.split(" ", 1) for l in p.stdout.decode().splitlines())
    assert int(info["n_vocab"]) == len(meta["tokens"])
    assert int(info["bos"]) == meta["bos"] and int(info["eos"]) == meta["eos"]
    assert info["eog_im_end"] == "1"
    assert info["default_system"] == "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


CONVERSATIONS = [
    ([{"role": "user", "content": "What is the capital of France?"},
      {"role": "assistant", "content": "Paris."},
      {"role": "user", "content": "And of Germany?"}], True),
    ([{"role": "system", "content": "You are terse."},
      {"role": "user", "content": "Say hi.\nTwo lines, ünïcödé 🙂"}], True),
    ([{"role": "user", "content": "Hello"},
      {"role": "assistant", "content": "Hi! How can I help?"}], False),
]


@pytest.mark.parametrize("messages,gen", CONVERSATIONS)
def test_chat_template(meta, hf, messages, gen):
    assert meta["template"], "GGUF has no chat template"
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    ref = env.from_string(meta["template"]).render(messages=messages, add_generation_prompt=gen)
    rendered, ok, ids = run_chat(messages, gen)
    assert rendered.decode("utf-8") == ref
    assert ok
    assert ids == hf_ids(hf, ref, special=True)
