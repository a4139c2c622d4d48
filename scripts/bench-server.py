#!/usr/bin/env python3
"""still server against llama.cpp's llama-server (built by `make peer` from the same vendored source), on this
machine, in one run:

  turns       a long conversation of 10 turns (each user turn a ~500-token passage of a text and a request for a
              one-sentence summary; replies greedy, at most 48 tokens; about 6K tokens in all): the time to the
              first streamed token of every turn. Alone, and interleaved with a second conversation in the only
              slot (-np 1), so that each turn of the first comes back to a slot that held the other.
  throughput  S concurrent streams (S = 1, 4, 16; -np S), each a distinct short prompt and 64 generated tokens
              (ignore_eos, greedy): generated tokens per second over all streams.
  memory      each server's resident memory after the turns, and still's kept state per conversation.

    scripts/bench-server.py --still build/still --llama-server peer/llama-server -m MODEL --text FILE
        [--adapter A] [--threads 2] [--json OUT]

Prints markdown tables (and the CPU model); --json writes every figure."""
import argparse
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
import urllib.request


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_model():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "?"


def rss_mib(pid):
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


class Server:
    def __init__(self, kind, args, slots, ctx_per_slot):
        self.kind, self.port = kind, free_port()
        if kind == "llama":
            cmd = [args.llama_server, "-m", args.model, "--host", "127.0.0.1", "--port", str(self.port), "-t",
                   str(args.threads), "-np", str(slots), "-c", str(ctx_per_slot * slots), "--no-webui"]
        else:
            cmd = [args.still, "server", "-m", args.model, "--port", str(self.port), "-t", str(args.threads), "-np",
                   str(slots), "-c", str(ctx_per_slot)]
            if kind == "still-adapter":
                cmd += ["--adapter", args.adapter]
        self.p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.base = f"http://127.0.0.1:{self.port}"
        for _ in range(600):
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except Exception:   # noqa: BLE001 (not up yet)
                time.sleep(0.1)
        else:
            raise SystemExit(f"{kind} server did not come up")

    def post(self, path, body):
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())

    def stream(self, path, body):
        """(seconds to the first content, the whole text, completion tokens counted as content events)."""
        body = dict(body, stream=True)
        req = urllib.request.Request(self.base + path, data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        t0, first, parts = time.perf_counter(), None, []
        with urllib.request.urlopen(req, timeout=600) as r:
            for raw in r:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                j = json.loads(line[6:])
                for c in j.get("choices", []):
                    piece = c.get("delta", {}).get("content") if "delta" in c else c.get("text")
                    if piece:
                        if first is None:
                            first = time.perf_counter() - t0
                        parts.append(piece)
        return first, "".join(parts)

    def metric(self, name):
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            m = re.search(rf"^{re.escape(name)} ([0-9.e+-]+)$", r.read().decode(), re.M)
        return float(m.group(1)) if m else None

    def stop(self):
        self.p.terminate()
        self.p.wait(timeout=60)


def passages(text, n, words=380, seed=0):
    w = text.split()
    step = len(w) // (n + 1)
    return [" ".join(w[seed * 7919 % step + i * step:][:words]) for i in range(n)]


def conversation(srv, pas, system):
    msgs, ttft = [{"role": "system", "content": system}], []
    for p in pas:
        msgs.append({"role": "user", "content": p + "\n\nSummarize this passage in one sentence."})
        t, reply = srv.stream("/v1/chat/completions", {"messages": msgs, "max_tokens": 48, "temperature": 0})
        ttft.append(t)
        msgs.append({"role": "assistant", "content": reply})
    return ttft, msgs


def run_turns(args, text):
    system = "You are a helpful assistant."
    a, b = passages(text, 10, seed=1), passages(text, 10, seed=2)
    out = {}
    for kind in args.kinds:
        srv = Server(kind, args, 1, 8192)
        try:
            ttft_alone, msgs = conversation(srv, a, system)
            n_tok = srv.post("/tokenize" if kind != "llama" else "/tokenize",
                             {"content": "".join(m["content"] for m in msgs)})["tokens"]
            rss_after = rss_mib(srv.p.pid)
            # interleaved: A's turn, B's turn, ... in the one slot (a fresh server, so A starts cold as before)
            srv.stop()
            srv = Server(kind, args, 1, 8192)
            ma, mb = [{"role": "system", "content": system}], [{"role": "system", "content": system}]
            ttft_inter = []
            for pa, pb in zip(a, b):
                for msgs_, p, rec in ((ma, pa, True), (mb, pb, False)):
                    msgs_.append({"role": "user", "content": p + "\n\nSummarize this passage in one sentence."})
                    t, reply = srv.stream("/v1/chat/completions", {"messages": msgs_, "max_tokens": 48,
                                                                   "temperature": 0})
                    if rec:
                        ttft_inter.append(t)
                    msgs_.append({"role": "assistant", "content": reply})
            snap = srv.metric("still_snapshot_bytes") if kind != "llama" else None
            n_snap = srv.metric("still_snapshots") if kind != "llama" else None
            out[kind] = {"ttft_alone": ttft_alone, "ttft_interleaved": ttft_inter, "conversation_tokens": len(n_tok),
                         "rss_mib_after_turns": rss_after, "rss_mib_after_interleaved": rss_mib(srv.p.pid),
                         "kept_state_bytes_per_conversation": snap / n_snap if snap and n_snap else None}
        finally:
            srv.stop()
    return out


def run_throughput(args):
    out = {}
    for kind in args.kinds:
        for S in args.streams:
            srv = Server(kind, args, S, 1024)
            try:
                body = lambda i: {"prompt": f"Story number {i}: Once upon a time, in a town by the sea,",   # noqa: E731
                                  "max_tokens": 64, "temperature": 0, "ignore_eos": True}
                srv.post("/v1/completions", dict(body(999), max_tokens=4))   # warm-up
                counts, threads = [], []

                def one(i):
                    counts.append(srv.post("/v1/completions", body(i))["usage"]["completion_tokens"])
                t0 = time.perf_counter()
                for i in range(S):
                    threads.append(threading.Thread(target=one, args=(i,)))
                    threads[-1].start()
                for t in threads:
                    t.join()
                dt = time.perf_counter() - t0
                out[f"{kind}/{S}"] = {"streams": S, "tokens": sum(counts), "seconds": dt, "tps": sum(counts) / dt}
            finally:
                srv.stop()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--still", default="build/still")
    ap.add_argument("--llama-server", default="peer/llama-server")
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("--adapter", default="adapters/smollm2-135m-still.gguf")
    ap.add_argument("--text", required=True)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--streams", default="1,4,16")
    ap.add_argument("--kinds", default="still-softmax,still-adapter,llama")
    ap.add_argument("--only", choices=["turns", "throughput"])
    ap.add_argument("--json")
    args = ap.parse_args()
    args.streams = [int(x) for x in args.streams.split(",")]
    args.kinds = args.kinds.split(",")
    for exe in (args.still, args.llama_server):
        if not os.access(exe, os.X_OK):
            sys.exit(f"bench-server: {exe} is not an executable (make; make peer)")
    text = open(args.text, encoding="utf-8").read()
    res = {"cpu": cpu_model(), "threads": args.threads}
    print(f"CPU: {res['cpu']}, {args.threads} threads")
    if args.only != "throughput":
        res["turns"] = run_turns(args, text)
        print("\n| server | conversation tokens | TTFT turn 1 / 5 / 10, alone (s) | TTFT turn 10, interleaved (s) |"
              " RSS after (MiB) | kept state per conversation |")
        print("| --- | ---: | ---: | ---: | ---: | ---: |")
        for k, v in res["turns"].items():
            a, ks = v["ttft_alone"], v["kept_state_bytes_per_conversation"]
            kept = f"{ks / 1048576:.1f} MiB" if ks else "—"
            print(f"| {k} | {v['conversation_tokens']} | {a[0]:.3f} / {a[4]:.3f} / {a[9]:.3f} | "
                  f"{v['ttft_interleaved'][9]:.3f} | {v['rss_mib_after_interleaved']:.0f} | {kept} |")
    if args.only != "turns":
        res["throughput"] = run_throughput(args)
        print("\n| server | streams | generated tokens | seconds | tokens/s (all streams) |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for k, v in res["throughput"].items():
            print(f"| {k.split('/')[0]} | {v['streams']} | {v['tokens']} | {v['seconds']:.2f} | {v['tps']:.1f} |")
    if args.json:
        with open(args.json + ".tmp", "w") as f:
            json.dump(res, f, indent=1)
        os.replace(args.json + ".tmp", args.json)


if __name__ == "__main__":
    main()
