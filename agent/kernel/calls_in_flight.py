"""The blocking GPU/NPU calls in flight now, read from the kernel's
calls_in_flight map (bpf/device.h): each one's entry record, kept there
until its return. A sync that never returns stays there; the hang
detector (detectors/device_hang.py) reads it without any return probe.
Read, never written: the programs own the map."""


MAP = "calls_in_flight"
MAX_CALLS = 1024        # a meta document's worth; a host rarely has more threads stuck


def blocking_ids(infos: dict) -> frozenset:
    """API ids whose call waits for the device: syncs, and the submissions
    that are complete when they return (cudaMemcpy, aclmdlExecute, ...)."""
    return frozenset(i for i, info in infos.items() if info.kind == "sync" or info.blocking)


def blocking_calls(table, infos: dict, ids: frozenset | None = None,
                   limit: int = MAX_CALLS) -> list[dict]:
    """The blocking calls in `table` (the map, as bcc gives it), at most `limit`,
    each once. The map is read a key after another while threads enter and
    return: when the key last read is deleted under the reader, the kernel
    goes on from the map's first key, and what was read already comes again."""
    ids = blocking_ids(infos) if ids is None else ids
    out, seen = [], set()
    for key, ev in table.items():
        if len(out) >= limit:
            break
        if key.value in seen:
            continue
        seen.add(key.value)
        api = int(ev.api)
        if api not in ids:
            continue
        info = infos[api]
        out.append({"pid": int(ev.pid), "tid": int(ev.tid), "api_id": api, "api": info.api,
                    "stream": info.stream, "stream_handle": int(ev.stream_handle),
                    "device": int(ev.device), "ts_ns": int(ev.ts_ns),
                    "comm": bytes(ev.comm).split(b"\0", 1)[0].decode(errors="replace")})
    return out
