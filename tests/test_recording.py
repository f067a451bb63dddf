"""The recording file: round trip, damage of every kind, and the CLI's
answer to it (the intact prefix with a warning, or one line and exit 2)."""

import json
import struct
import zlib

import numpy as np
import pytest
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mmtrace.agent.recording import file_format as recording
from mmtrace.agent.cli import cli
from mmtrace.bpf.sched import RUNQ_EVENT

SCHEMAS = {"cpu.runq": RUNQ_EVENT}


def runq_records(n, start=0, tid=100):
    r = np.zeros(n, RUNQ_EVENT)
    r["ts_ns"] = 1_000_000 + np.arange(start, start + n) * 1000
    r["delay_ns"] = (np.arange(start, start + n) % 50 + 1) * 1000
    r["pid"] = 42
    r["tid"] = tid
    r["comm"] = b"worker"
    return r


def write_sample(path, chunks=4, per_chunk=10, close=True):
    w = recording.RecordingWriter(path, SCHEMAS, info={"hostname": "test"})
    w.write_meta({"probes": []})
    for i in range(chunks):
        w.write_events("cpu.runq", runq_records(per_chunk, start=i * per_chunk))
    if close:
        w.close({"duration_s": 1.5, "lost_events": 3, "counters": {}})
    else:
        w._file.close()
    return path


def chunk_boundaries(data: bytes) -> list[int]:
    """Byte offsets where each chunk starts, and the end of the file."""
    _, _, _, body = struct.unpack_from("<8sHHI", data, 0)
    offset = 8 + 2 + 2 + 4 + body + 4
    out = []
    while offset < len(data):
        out.append(offset)
        length = recording._CHUNK.unpack_from(data, offset)[5]
        offset += recording._CHUNK.size + length
    out.append(len(data))
    return out


def test_round_trip_keeps_every_record(tmp_path):
    path = write_sample(tmp_path / "a.mmtr")
    rec = recording.read_recording(path)
    assert rec.complete and rec.warnings == []
    expected = np.concatenate([runq_records(10, start=i * 10) for i in range(4)])
    assert np.array_equal(rec.events["cpu.runq"], expected)
    assert rec.footer["lost_events"] == 3
    assert rec.meta == [{"probes": []}]
    assert rec.header["hostname"] == "test"


def test_truncation_at_every_chunk_boundary_gives_the_prefix(tmp_path):
    data = write_sample(tmp_path / "full.mmtr").read_bytes()
    bounds = chunk_boundaries(data)
    # chunk 0 is meta, then 4 event chunks of 10, then the end chunk
    for i, cut in enumerate(bounds[:-1]):
        path = tmp_path / f"cut{i}.mmtr"
        path.write_bytes(data[:cut])
        rec = recording.read_recording(path)
        assert not rec.complete
        assert len(rec.warnings) == 1 and "cut short" in rec.warnings[0]
        events_chunks = max(0, min(i - 1, 4))
        assert len(rec.events["cpu.runq"]) == 10 * events_chunks


def test_truncation_inside_a_chunk_keeps_the_chunks_before(tmp_path):
    data = write_sample(tmp_path / "full.mmtr").read_bytes()
    bounds = chunk_boundaries(data)
    for i in range(1, len(bounds) - 1):
        for cut in (bounds[i] + 3, bounds[i] + 30, bounds[i + 1] - 1):
            path = tmp_path / "cut.mmtr"
            path.write_bytes(data[:cut])
            rec = recording.read_recording(path)
            assert len(rec.warnings) == 1
            assert len(rec.events["cpu.runq"]) == 10 * max(0, min(i - 1, 4))


def test_header_damage_is_an_error(tmp_path):
    data = bytearray(write_sample(tmp_path / "full.mmtr").read_bytes())
    data[20] ^= 0x01
    (tmp_path / "bad.mmtr").write_bytes(data)
    with pytest.raises(recording.RecordingError, match="checksum"):
        recording.read_recording(tmp_path / "bad.mmtr")


def test_newer_major_version_is_refused(tmp_path):
    data = bytearray(write_sample(tmp_path / "full.mmtr").read_bytes())
    struct.pack_into("<H", data, 8, recording.MAJOR + 1)
    end = 16 + struct.unpack_from("<I", data, 12)[0]
    struct.pack_into("<I", data, end, zlib.crc32(bytes(data[:end])))
    (tmp_path / "new.mmtr").write_bytes(data)
    with pytest.raises(recording.RecordingError, match="newer than this mmtrace reads"):
        recording.read_recording(tmp_path / "new.mmtr")


def test_not_a_recording(tmp_path):
    (tmp_path / "x").write_text("hello")
    with pytest.raises(recording.RecordingError, match="not an mmtrace recording"):
        recording.read_recording(tmp_path / "x")


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flips=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(0, 7)),
                      min_size=1, max_size=4))
def test_random_bit_flips_give_prefix_or_clear_error(tmp_path, flips):
    data = bytearray(write_sample(tmp_path / "full.mmtr").read_bytes())
    for where, bit in flips:
        data[int(where * len(data))] ^= 1 << bit
    path = tmp_path / "flipped.mmtr"
    path.write_bytes(data)
    full = np.concatenate([runq_records(10, start=i * 10) for i in range(4)])
    try:
        rec = recording.read_recording(path)
    except recording.RecordingError as exc:
        assert str(exc).startswith(str(path))
        return
    got = rec.events["cpu.runq"]
    # Whatever is returned is an intact prefix of what was written...
    assert np.array_equal(got, full[:len(got)])
    # ...and anything less than everything comes with a warning.
    if len(got) < len(full) or not rec.complete:
        assert rec.warnings


def test_cli_report_on_damaged_files(tmp_path):
    runner = CliRunner()
    data = write_sample(tmp_path / "full.mmtr").read_bytes()
    (tmp_path / "cut.mmtr").write_bytes(data[: len(data) // 2])
    result = runner.invoke(cli, ["report", str(tmp_path / "cut.mmtr"), "--json"])
    assert result.exit_code == 0
    assert "mmtrace: warning:" in result.stderr
    assert json.loads(result.stdout)["complete"] is False

    (tmp_path / "junk.mmtr").write_bytes(b"MMTRACE\x00" + b"\xff" * 40)
    for bad in ("junk.mmtr", "missing.mmtr"):
        result = runner.invoke(cli, ["report", str(tmp_path / bad)])
        assert result.exit_code == 2
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("mmtrace: error:")
        assert "Traceback" not in result.output


def test_report_json_has_the_spec_keys_and_runqlat_buckets(tmp_path):
    path = write_sample(tmp_path / "a.mmtr")
    result = CliRunner().invoke(cli, ["report", str(path), "--json"])
    assert result.exit_code == 0, result.output
    summary = json.loads(result.stdout)
    for key in ("duration_s", "events", "lost_events", "runq", "ops", "anomalies"):
        assert key in summary
    assert summary["events"] == {"cpu.runq": 40}
    assert summary["lost_events"] == 3
    hist = summary["runq"]["hist_log2_us"]
    assert [(b["low_us"], b["high_us"]) for b in hist[:4]] == [(0, 1), (2, 3), (4, 7), (8, 15)]
    # delays are 1..50 µs, each 0.8 times over 40 records
    delays_us = (np.arange(40) % 50) + 1
    expected = np.bincount(np.where(delays_us < 2, 0, np.floor(np.log2(delays_us)).astype(int)))
    assert [b["count"] for b in hist] == expected.tolist()
    assert summary["runq"]["count"] == 40
    assert summary["runq"]["p50_us"] == pytest.approx(np.percentile(delays_us, 50))


def test_export_jsonl_lines_carry_spec_fields(tmp_path):
    path = write_sample(tmp_path / "a.mmtr")
    result = CliRunner().invoke(cli, ["export", str(path), "--format", "jsonl", "-o", "-"])
    assert result.exit_code == 0
    lines = [json.loads(x) for x in result.stdout.splitlines()]
    assert len(lines) == 40
    first = lines[0]
    assert first["stream"] == "cpu" and first["kind"] == "runq"
    assert (first["pid"], first["tid"], first["comm"]) == (42, 100, "worker")
    assert first["duration_ns"] == 1000 and first["ts_ns"] == 1_000_000
    for key in ("api", "op_id", "op_name", "handle", "stream_handle", "grid", "block",
                "shared_mem_bytes", "bytes", "direction", "sched_delay_ns", "retired_ns",
                "device"):
        assert first[key] is None
    assert [x["ts_ns"] for x in lines] == sorted(x["ts_ns"] for x in lines)


def test_export_chrome_is_a_trace(tmp_path):
    path = write_sample(tmp_path / "a.mmtr")
    out = tmp_path / "t.json"
    result = CliRunner().invoke(cli, ["export", str(path), "--format", "chrome", "-o", str(out)])
    assert result.exit_code == 0, result.output
    trace = json.loads(out.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == 40
    assert slices[0]["dur"] == pytest.approx(1.0) and slices[0]["tid"] == 100


@pytest.mark.parametrize("args", [
    ["report"],
    ["export", "x.mmtr", "--format", "xml", "-o", "y"],
    ["record", "-o", "x.mmtr", "--duration", "-1"],
    ["record", "-o", "x.mmtr", "--pid", "0"],
    ["record", "--bogus"],
])
def test_bad_flags_exit_2(args):
    result = CliRunner().invoke(cli, args)
    assert result.exit_code == 2
    assert "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1].startswith("Error:")


@pytest.mark.parametrize("mib,wanted", [
    ("3", "mmtrace: error: --device-ringbuf-mib 3: expected a power of two (1, 2, 4, ... 1024)"),
    ("2048", "Error: Invalid value for '--device-ringbuf-mib'"),
])
def test_a_device_ring_size_that_is_no_power_of_two_is_one_line_and_exit_2(mib, wanted):
    result = CliRunner().invoke(cli, ["record", "-o", "x.mmtr", "--device-ringbuf-mib", mib])
    assert result.exit_code == 2 and "Traceback" not in result.output
    assert result.output.strip().splitlines()[-1].startswith(wanted), result.output


@pytest.mark.parametrize("command", ["doctor", "record", "report", "export", "run", "mcp"])
def test_every_command_has_help_with_an_example(command):
    result = CliRunner().invoke(cli, [command, "--help"])
    if command == "run" and result.exit_code == 2:
        pytest.skip("mmtrace run is not built yet")
    assert result.exit_code == 0
    assert "Example" in result.output


def test_schemas_given_out_of_name_order_read_back_as_written(tmp_path):
    """The header lists schemas by name; the chunks must number them so."""
    late = np.zeros(2, [("ts_ns", "<u8"), ("late", "<u4")])
    early = np.zeros(3, [("ts_ns", "<u8"), ("early", "<f8")])
    w = recording.RecordingWriter(tmp_path / "o.mmtr", {"zz.late": late.dtype,
                                                        "aa.early": early.dtype})
    w.write_events("zz.late", late)
    w.write_events("aa.early", early)
    w.close({})
    rec = recording.read_recording(tmp_path / "o.mmtr")
    assert rec.counts == {"aa.early": 3, "zz.late": 2}
    assert rec.events["zz.late"].dtype == late.dtype
