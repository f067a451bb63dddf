"""Hostile hint-socket clients for the daemon's flood test: 50 threads
send the socket fuzzer's seeds and generated hostile input (deep nesting,
huge lines, wrong types, NaN, garbage bytes), hold idle connections, flood
without reading, half-close; each reconnects whenever the daemon lets it
go. Run: python socket_flood.py SOCKET; it floods until its standard input
closes, then prints one JSON summary."""

import json
import random
import socket
import sys
import threading
import time
from collections import Counter
from pathlib import Path

SEEDS = Path(__file__).resolve().parent / "fuzz" / "corpus" / "socket"
CLIENTS = 50


def hostile_lines(rng: random.Random) -> list[bytes]:
    """Generated lines beside the seeds: each breaks one rule."""
    deep = rng.randint(9, 30000)
    return [
        b"[" * deep + b"]" * deep + b"\n",
        b'{"a":' * 5000 + b"1" + b"}" * 5000 + b"\n",
        b"x" * rng.randint(65537, 300_000) + b"\n",
        b'{"v":1,"type":"sample","series":"s","modality":"m","value_ms":NaN}\n',
        b'{"v":1,"type":"sample","series":"s","modality":"m","value_ms":1e999}\n',
        b'{"v":true,"type":"hello","pid":true}\n',
        b'{"v":1.0,"type":"subscribe"}\n',
        b'{"v":1,"type":"entropy","modality":"m","layer":"l","head":-3,"value":0.5}\n',
        b'{"v":1,"type":"entropy","modality":"m","ts_ns":"abc","layer":"l","head":1,"value":1}\n',
        b'{"v":1,"type":"entropy","modality":"m","values":[1,"x",null]}\n',
        b'{"v":1,"type":"sample","series":"s","modality":"m","value_ms":1,"ts_ns":'
        + str(2**80).encode() + b"}\n",
        b'{"v":1,"type":"sample","series":"s","modality":"m","value_ms":' + b"9" * 5000 + b"}\n",
        bytes(rng.getrandbits(8) for _ in range(rng.randint(1, 4000))) + b"\n",
        json.dumps({"v": 1, "type": "sample", "series": f"flood{rng.randint(0, 10**6)}",
                    "modality": "m", "value_ms": rng.random()}).encode() + b"\n",
    ]


class Role:
    """One hostile client: connects, misbehaves, reconnects when dropped."""

    def __init__(self, path: str, kind: str, seed: int, stop: threading.Event, tally: Counter):
        self.path, self.kind, self.stop, self.tally = path, kind, stop, tally
        self.rng = random.Random(seed)
        self.seeds = [p.read_bytes() for p in sorted(SEEDS.iterdir())]

    def run(self):
        while not self.stop.is_set():
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                sock.connect(self.path)
            except OSError:
                self.tally["connect_failed"] += 1
                time.sleep(0.05)
                continue
            self.tally["connections"] += 1
            try:
                getattr(self, self.kind)(sock)
            except OSError:
                self.tally[f"{self.kind}_dropped"] += 1
            finally:
                sock.close()

    def _send(self, sock, data: bytes):
        sock.settimeout(2.0)
        sock.sendall(data)

    def _drain(self, sock):
        sock.settimeout(0.05)
        try:
            while sock.recv(1 << 16):
                self.tally["reply_chunks"] += 1
        except TimeoutError:
            pass

    def corpus(self, sock):
        """The fuzzer's seeds and the generated lines, reading the replies."""
        for _ in range(20):
            if self.stop.is_set():
                return
            lines = self.seeds + hostile_lines(self.rng)
            self._send(sock, self.rng.choice(lines))
            self.tally["corpus_lines"] += 1
            self._drain(sock)

    def never_reads(self, sock):
        """Invalid lines as fast as the socket takes them; never a read."""
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        while not self.stop.is_set():
            self._send(sock, b"not json\n" * 200)
            self.tally["flood_lines"] += 200

    def idle(self, sock):
        """Connected and silent until the daemon times it out."""
        sock.settimeout(None)
        while not self.stop.is_set():
            sock.settimeout(0.2)
            try:
                if not sock.recv(1 << 16):
                    self.tally["idle_closed"] += 1
                    return
            except TimeoutError:
                continue

    def huge(self, sock):
        """Oversized lines, with and without their newline."""
        self._send(sock, b"[" * self.rng.randint(65537, 400_000))
        self._send(sock, b"\n" + b'{"v":1,"type":"subscribe"}\n')
        self.tally["huge_lines"] += 1
        self._drain(sock)

    def half_close(self, sock):
        """A few hostile lines, the last without a newline, then SHUT_WR."""
        lines = hostile_lines(self.rng)
        self._send(sock, b"".join(self.rng.sample(lines, 3)).rstrip(b"\n"))
        sock.shutdown(socket.SHUT_WR)
        self.tally["half_closed"] += 1
        self._drain(sock)


KINDS = ["corpus", "never_reads", "idle", "huge", "half_close"]


def flood(path: str, until) -> Counter:
    """CLIENTS hostile clients on `path` until `until()` returns."""
    stop, tally = threading.Event(), Counter()
    threads = [threading.Thread(target=Role(path, KINDS[i % len(KINDS)], i, stop, tally).run,
                                daemon=True) for i in range(CLIENTS)]
    for t in threads:
        t.start()
    until()
    stop.set()
    for t in threads:
        t.join(10)
    return tally


if __name__ == "__main__":
    print(json.dumps(flood(sys.argv[1], sys.stdin.read)), flush=True)
