"""`mmtrace mcp` end to end, as an assistant meets it: the SDK's own client
over stdio, against a real daemon on real eBPF that has just watched the
diagnosis tests' CPU starvation scenario (the launcher on real libcudart,
three cpu_hog threads on its CPU). Every tool is called, and each answer is
checked against `mmtrace report --json`, `explain --json` and `top --json`
on the same data; hostile calls get tool errors while the server keeps
serving; and its memory stays bounded over 1000 calls.

One daemon and one server serve the whole module (module-scoped)."""

import json
import os
import signal
import subprocess

import jsonschema
import numpy as np
import pytest

from conftest import MMTRACE
from daemon_process import start_daemon
from mcp_session import McpSession
from test_diagnosis_bpf import _program, _run, real_cudart
from test_dispatch_socket import wait_for

from mmtrace.agent.recording import file_format as recording

pytestmark = [pytest.mark.bpf, pytest.mark.slow]

TOOLS = {"status", "anomalies", "explain", "report", "recordings", "series", "hints", "dump"}


def cli(*args, timeout=120):
    out = subprocess.run([str(MMTRACE), *map(str, args)], capture_output=True, text=True,
                         timeout=timeout)
    assert out.returncode == 0, out.stderr
    return out.stdout


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """The daemon after the starvation scenario, a flight recording of it
    (`mmtrace dump`), and an `mmtrace mcp` server over both."""
    out = tmp_path_factory.mktemp("mcp")
    program = _program(out, "scenario_real", [real_cudart()])
    state, sock, incidents = out / "state", out / "mmtrace.sock", out / "incidents"
    incidents.mkdir()
    config = out / "mmtrace.toml"
    # A ring of 60 s: the live answers and the dump still hold the whole
    # scenario while the test asks about it.
    config.write_text(f'state_dir = "{state}"\nsocket = "{sock}"\nmetrics_address = "off"\n'
                      'ring_seconds = 60.0\n')
    log: list[str] = []
    daemon = start_daemon(["--config", str(config)], log)
    session = None
    try:
        truth = _run(program, "cpu_starved")
        dumped = cli("dump", "--socket", sock).strip()
        session = McpSession(["--config", config, "--recordings", incidents],
                             out / "mcp.log")
        report = json.loads(cli("report", dumped, "--json"))
        yield {"daemon": daemon, "truth": truth, "flight": dumped, "report": report,
               "state": state,
               "sock": sock, "config": config, "incidents": incidents, "out": out,
               "mcp": session}
    finally:
        if session is not None:
            session.close()
        daemon.send_signal(signal.SIGTERM)
        daemon.communicate(timeout=60)


def answer(result):
    assert not result.is_error, result.content[0].text
    data = result.structured_content
    assert json.loads(result.content[0].text) == data       # the text says the same
    return data


def refused(result, *words):
    assert result.is_error, result.structured_content
    text = result.content[0].text
    assert all(w in text for w in words), text
    return text


def without_now(value):
    """A live answer stamps the wall clock as it is made, and says how far
    the daemon's split reaches (`held`), which grows as it runs: the moment
    between two calls is not a difference."""
    if isinstance(value, dict):
        return {k: without_now(v) for k, v in value.items()
                if k not in ("started", "ended", "wall_time", "held")}
    if isinstance(value, list):
        return [without_now(v) for v in value]
    return value


def incident_window(truth) -> str:
    lo = -(-(truth["incident_ns"] + 500_000_000) // 10**9)
    return f"{lo}:{truth['end_ns'] // 10**9}"


# ------------------------------------------------------------------ tools

def test_every_tool_is_listed_with_schemas_that_check(host):
    tools = {t.name: t for t in host["mcp"].tools()}
    assert set(tools) == TOOLS
    for tool in tools.values():
        for schema in (tool.input_schema, tool.output_schema):
            jsonschema.Draft202012Validator.check_schema(schema)
            assert schema["type"] == "object"
        assert tool.input_schema["additionalProperties"] is False
        assert len(tool.description) > 150, tool.name       # says when to use it
    assert tools["report"].input_schema["required"] == ["path"]
    assert tools["dump"].annotations.read_only_hint is False
    assert tools["status"].annotations.read_only_hint is True
    (prompt,) = host["mcp"].prompts()
    text = host["mcp"].prompt(prompt.name, {"pid": "4242"}).messages[0].content.text
    steps = [text.index(f"`{t}`") for t in ("status", "anomalies", "explain", "recordings")]
    assert steps == sorted(steps) and "4242" in text


def test_report_and_explain_of_a_recording_are_the_cli_s(host):
    mcp, flight = host["mcp"], host["flight"]
    name = os.path.basename(flight)            # a name in the state directory
    assert answer(mcp.call("report", {"path": name})) == host["report"]
    pid = host["truth"]["pid"]
    window = incident_window(host["truth"])
    explained = answer(mcp.call("explain", {"path": flight, "pid": pid, "window": window}))
    assert explained == json.loads(cli("explain", flight, "--pid", pid, "--window", window,
                                       "--json"))
    (process,) = explained["processes"]
    assert process["verdict"] == "cpu_starved"
    assert process["culprits"][0]["pid"] in host["truth"]["hogs"]


def test_live_explain_is_the_cli_s(host):
    pid, window = host["truth"]["pid"], incident_window(host["truth"])
    live = answer(host["mcp"].call("explain", {"pid": pid, "window": window}))
    by_cli = json.loads(cli("explain", "--pid", pid, "--window", window, "--socket",
                            host["sock"], "--json"))
    assert without_now(live) == without_now(by_cli)
    assert live["processes"][0]["verdict"] == "cpu_starved"


def test_series_live_and_from_the_recording_agree_with_the_events(host):
    pid = host["truth"]["pid"]
    name = f"runq_delay{{pid={pid}}}"
    live = answer(host["mcp"].call("series", {"name": name, "window_s": 60}))
    filed = answer(host["mcp"].call("series", {"name": name, "window_s": 60,
                                               "path": host["flight"]}))
    # The launcher's device threads' run-queue delays, read from the file apart.
    rec = recording.read_recording(host["flight"])
    dev = rec.events["dev.event"]
    tids = np.unique(dev["tid"][dev["pid"] == pid])
    runq = rec.events["cpu.runq"]
    delays_ms = runq["delay_ns"][np.isin(runq["tid"], tids)] / 1e6
    assert filed["count"] == len(delays_ms) > 100
    assert filed["p99_ms"] == pytest.approx(np.percentile(delays_ms, 99))
    assert filed["max_ms"] == pytest.approx(delays_ms.max())
    # The daemon's rings hold the same scenario whole.
    assert live["count"] == filed["count"]
    assert live["p99_ms"] == pytest.approx(filed["p99_ms"])


def test_status_anomalies_and_hints_are_top_s(host):
    mcp = host["mcp"]
    status = answer(mcp.call("status"))
    top = json.loads(wait_for(lambda: _top(host), timeout=20, step=0.1))
    assert status["daemon_pid"] == top["daemon_pid"] == host["daemon"].pid
    assert set(status) == set(top) - {"v", "type"}
    assert status["hints"] == top["hints"]
    live = answer(mcp.call("anomalies"))
    assert live["source"] == "daemon"
    assert all({"detector", "what", "state", "verdict"} <= set(a) for a in live["anomalies"])
    hints = answer(mcp.call("hints"))
    assert hints["hints"] == top["hints"] and hints["hints_sent"] == top["hints_sent"]


def _top(host) -> str | None:
    """`mmtrace top --json`, or None where the daemon, busy on its one CPU of
    a loaded host, did not answer within top's 2 s."""
    out = subprocess.run([str(MMTRACE), "top", "--json", "--socket", host["sock"]],
                         capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 or "did not answer within" in out.stderr, out.stderr
    return out.stdout if out.returncode == 0 else None


def test_anomalies_and_hints_of_a_recording_are_the_report_s(host):
    mcp, flight = host["mcp"], host["flight"]
    report = host["report"]
    found = answer(mcp.call("anomalies", {"path": flight, "limit": 100}))
    assert found["count"] == len(report["anomalies"])
    assert found["anomalies"] == report["anomalies"][-100:]
    hints = answer(mcp.call("hints", {"path": flight}))
    assert hints["hints"] == report["telemetry"]["hints"]["last"]
    assert hints["count"] == report["telemetry"]["hints"]["count"]


def test_recordings_list_the_state_directory_with_triggers(host):
    before = {str(p) for p in host["state"].glob("*.mmtr")}
    listed = answer(host["mcp"].call("recordings", {"limit": 100}))
    after = {str(p) for p in host["state"].glob("*.mmtr")}   # an alarm may write one meanwhile
    assert before <= {r["path"] for r in listed["recordings"]} <= after
    (dump,) = [r for r in listed["recordings"] if r["path"] == host["flight"]]
    assert dump["trigger"] == {"kind": "dump", "reason": "dump"} and dump["flight_recording"]
    for row in listed["recordings"]:
        header = recording.RecordingReader(row["path"], scan=False).header
        if "anomaly" in header:
            assert row["trigger"]["detector"] == header["anomaly"]["detector"]
    assert listed["unreadable"] == []


def test_dump_writes_only_when_allowed(host):
    refused(host["mcp"].call("dump"), "--allow-dump")
    allowed = McpSession(["--config", host["config"], "--allow-dump"], host["out"] / "dump.log")
    try:
        path = answer(allowed.call("dump"))["path"]
        assert os.path.dirname(path) == str(host["state"]) and os.path.isfile(path)
        listed = answer(allowed.call("recordings"))["recordings"]
        assert path in [r["path"] for r in listed]
    finally:
        allowed.close()


# ---------------------------------------------------------------- hostile

def _hostile(host) -> list[tuple[str, dict, tuple]]:
    incidents, flight = host["incidents"], host["flight"]
    damaged = incidents / "damaged.mmtr"
    if not damaged.exists():
        data = bytearray(open(flight, "rb").read(4096))
        data[20:40] = b"\xff" * 20                  # inside the header: its checksum fails
        damaged.write_bytes(bytes(data))
        os.mkfifo(incidents / "pipe.mmtr")
        os.symlink("/etc/passwd", incidents / "out.mmtr")
        os.symlink(flight, incidents / "in.mmtr")   # a link within the roots is fine
    big = "x" * (1 << 20)
    return [
        ("report", {"path": "/etc/passwd"}, ("expected a recording under",)),
        ("report", {"path": f"{host['state']}/../mmtrace.toml"}, ("'..'",)),
        # refused, and where the link leads is not said
        ("report", {"path": str(incidents / "out.mmtr")}, ("expected a recording under",)),
        ("report", {"path": str(incidents / "pipe.mmtr")}, ("a FIFO",)),
        ("explain", {"path": str(damaged)}, ("checksum",)),
        ("explain", {"path": flight, "window": "0:1000000000"}, ("at most 864000 s",)),
        ("explain", {"pid": host["truth"]["pid"], "window": "1000:10000"},
         ("at most 3600 s",)),
        ("series", {"name": "runq_delay{pid=1}", "window_s": 1e9}, ("at most 3600",)),
        ("explain", {"pid": 4_194_000}, ("4194000",)),
        ("explain", {"path": flight, "pid": 4_194_000}, ("4194000",)),
        ("explain", {"pid": "1234"}, ("pid: expected an integer",)),
        ("series", {"name": 7}, ("name: expected a string",)),
        ("anomalies", {"limit": True}, ("limit: expected an integer", "boolean")),
        ("report", {"path": big}, ("at most 4096 characters", "1,048,576 characters")),
        ("series", {"name": big}, ("at most 200 characters",)),
        ("explain", {"path": flight, "window": big}, ("window: expected at most 64",)),
        ("dump", {}, ("--allow-dump",)),
        ("report", {}, ("missing",)),
        ("no_such_tool", {}, ("expected a tool among",)),
    ]


def test_hostile_calls_are_tool_errors_and_the_server_keeps_serving(host):
    mcp = host["mcp"]
    for name, arguments, words in _hostile(host):
        text = refused(mcp.call(name, arguments), *words)
        assert "/etc/passwd" not in text or arguments.get("path") == "/etc/passwd", text
        assert len(text) < 1000, text[:200]        # a megabyte does not come back
        assert answer(mcp.call("recordings", {"limit": 1}))["recordings"]
    assert answer(mcp.call("report", {"path": str(host["incidents"] / "in.mmtr")}))["events"]
    assert mcp.alive()


def test_memory_stays_bounded_over_1000_calls(host):
    """Calls good and hostile, a replay of the flight recording every 100th
    (the heaviest work there is) and the daemon asked every 20th (its
    status costs it a loaded CPU's while): the server's RSS, from /proc,
    after 1000 calls is within 16 MiB of what it was after 100 (a replay
    moves it by a few MiB; a leak of 20 KiB a call would pass that)."""
    mcp = host["mcp"]
    quick = [(n, a) for n, a, _ in _hostile(host)
             if len(json.dumps(a)) < 1000 and not ("path" in a and "pid" in a)
             and not ("pid" in a and isinstance(a["pid"], int))]
    live = [("status", {}), ("anomalies", {}), ("hints", {})]
    rss = {}
    for i in range(1000):
        if i % 100 == 50:
            answer(mcp.call("series", {"name": "runq_delay{pid=1}", "path": host["flight"]}))
        elif i % 20 == 10:
            answer(mcp.call(*live[i // 20 % len(live)]))
        elif i % 2:
            name, arguments = quick[i // 2 % len(quick)]
            assert mcp.call(name, arguments).is_error
        else:
            answer(mcp.call("recordings", {"limit": 5}))
        if i + 1 in (100, 1000):
            rss[i + 1] = mcp.rss_kib()
    print(f"mmtrace mcp RSS: {rss[100]} KiB after 100 calls, {rss[1000]} KiB after 1000")
    assert rss[1000] - rss[100] < 16 * 1024, rss
