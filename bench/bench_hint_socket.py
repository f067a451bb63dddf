"""Hint-socket input costs: what checking a line costs, and what a hostile
line costs compared with a good one.

    python bench/bench_hint_socket.py [--seconds 1.0]

Times hint_protocol.parse_line on: a request-latency sample, an entropy
batch of 64 heads, a 64 KiB line of 32 768 nested brackets (refused by the
depth scan), a 64 KiB line of `[]` pairs (depth 1, parsed and refused by
the schema) and 64 KiB of random bytes; then the messages per second one
client gets through a real HintServer (socket, framing, parsing, schema).
Writes bench/out/hint_socket.json.
"""

import argparse
import json
import os
import platform
import random
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

from mmtrace.agent.socket.hint_protocol import MAX_MESSAGE, ProtocolError, parse_line
from mmtrace.agent.socket.hint_socket import HintServer

OUT = Path(__file__).resolve().parent / "out" / "hint_socket.json"


def lines() -> dict[str, bytes]:
    rng = random.Random(1)
    batch = {"v": 1, "type": "entropy", "modality": "vision",
             "values": [{"layer": f"enc.{h // 8}.attn", "head": h % 8, "value": rng.random()}
                        for h in range(64)]}
    half = MAX_MESSAGE // 2
    return {
        "sample": b'{"v":1,"type":"sample","series":"e2e","modality":"vision","value_ms":12.5}',
        "entropy batch (64 heads)": json.dumps(batch).encode(),
        "64 KiB nested brackets": b"[" * half + b"]" * half,
        "64 KiB of [] pairs": b"[" + b"[]," * (MAX_MESSAGE // 3 - 1) + b"[]]",
        "64 KiB random bytes": bytes(rng.getrandbits(8) for _ in range(MAX_MESSAGE)),
    }


def per_second(line: bytes, seconds: float) -> float:
    n, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(100):
            try:
                parse_line(line)
            except ProtocolError:
                pass
        n += 100
    return n / (time.perf_counter() - start)


def server_messages_per_second(seconds: float) -> float:
    with tempfile.TemporaryDirectory() as tmp:
        server = HintServer(Path(tmp) / "s.sock")
        stop = threading.Event()
        line = lines()["sample"] + b"\n"

        def client():
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(server.path))
            chunk = line * 1000
            while not stop.is_set():
                s.sendall(chunk)
            s.close()
        sender = threading.Thread(target=client, daemon=True)
        sender.start()
        got, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds:
            got += len(server.poll(0.01))
        elapsed = time.perf_counter() - start
        stop.set()
        while sender.is_alive():
            server.poll(0.01)
        server.close()
        return got / elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=1.0)
    args = parser.parse_args()
    results = {name: {"bytes": len(line), "lines_per_s": per_second(line, args.seconds)}
               for name, line in lines().items()}
    for name, r in results.items():
        print(f"{name:28s} {r['bytes']:7,d} B  {r['lines_per_s']:12,.0f} lines/s  "
              f"{r['bytes'] * r['lines_per_s'] / 1e6:8.1f} MB/s")
    served = server_messages_per_second(args.seconds * 3)
    print(f"{'server, one client, samples':28s} {served:12,.0f} messages/s")
    OUT.parent.mkdir(exist_ok=True)
    OUT.write_text(json.dumps({"host": platform.node(), "cpus": os.cpu_count(),
                               "python": sys.version.split()[0], "parse": results,
                               "server_messages_per_s": served}, indent=2))


if __name__ == "__main__":
    main()
