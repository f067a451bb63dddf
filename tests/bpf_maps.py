"""The eBPF maps a process holds, read from outside it with bpftool: what
a test checks a daemon's kernel state with, entry by entry."""

import json
import os
import re
import subprocess


def bpf_maps_of(pid: int) -> dict[str, dict]:
    """Name -> bpftool's description (id, max_entries, ...) of the eBPF maps
    process `pid` holds open."""
    ids = set()
    for fd in os.listdir(f"/proc/{pid}/fdinfo"):
        try:
            text = open(f"/proc/{pid}/fdinfo/{fd}").read()
        except OSError:
            continue
        match = re.search(r"^map_id:\s*(\d+)", text, re.M)
        if match:
            ids.add(int(match.group(1)))
    out = {}
    for map_id in ids:
        show = subprocess.run(["bpftool", "-j", "map", "show", "id", str(map_id)],
                              capture_output=True, text=True, check=True).stdout
        info = json.loads(show)
        out[info["name"]] = info
    return out


def map_dump(map_id: int) -> list[dict]:
    """Every entry of the map, as bpftool prints it (with "formatted" key
    and value where the map has BTF)."""
    dump = subprocess.run(["bpftool", "-j", "map", "dump", "id", str(map_id)],
                          capture_output=True, text=True, check=True).stdout
    return json.loads(dump)


def map_entries(map_id: int) -> int:
    return len(map_dump(map_id))
