"""Recordings that say odd things with valid checksums, damaged headers,
inputs that are not files, and exports that cannot be written: each ends
in one `mmtrace: error:` line and exit status 2, never a traceback; an
export leaves nothing behind when it fails and never overwrites its input."""

import json
import os
import shutil
import subprocess
import time

import numpy as np
import pytest
from click.testing import CliRunner

import crafted_recording as craft
from mmtrace.agent.recording import file_format as recording
from mmtrace.agent.cli import cli
from mmtrace.bpf.sched import RUNQ_EVENT
from test_recording import runq_records, write_sample

FORMATS = ["jsonl", "chrome", "perfetto"]


def one_error_line(result, *expected: str):
    assert result.exit_code == 2, result.output
    assert "Traceback" not in result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmtrace: error:"), result.stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


def every_command_refuses(path, *expected: str):
    runner = CliRunner()
    one_error_line(runner.invoke(cli, ["report", str(path)]), *expected)
    one_error_line(runner.invoke(cli, ["report", str(path), "--json"]), *expected)
    for fmt in FORMATS:
        out = path.parent / f"out.{fmt}"
        one_error_line(runner.invoke(cli, ["export", str(path), "--format", fmt, "-o", str(out)]),
                       *expected)
        assert not out.exists()


def crafted(tmp_path, *parts: bytes, name="c.mmtr"):
    path = tmp_path / name
    path.write_bytes(b"".join(parts))
    return path


def good_events():
    return craft.events(runq_records(10))


# ------------------------------------------------ footer and meta content

@pytest.mark.parametrize("footer, field", [
    ({"duration_s": "abc"}, "duration_s"),
    ({"duration_s": -1.0}, "duration_s"),
    ({"duration_s": True}, "duration_s"),
    ({"lost_events": None}, "lost_events"),
    ({"lost_events": -3}, "lost_events"),
    ({"lost_events": 2.5}, "lost_events"),
    ({"lost_events": {"ringbuf_full": "x"}}, "lost_events.ringbuf_full"),
    ({"counters": {"a": "b"}}, "counters.a"),
    ({"runq_hist_log2_us": [1, -2]}, "runq_hist_log2_us"),
    ([1, 2], "footer"),
])
def test_odd_footer_is_one_line(tmp_path, footer, field):
    path = crafted(tmp_path, craft.header(), good_events(), craft.end(footer))
    every_command_refuses(path, "chunk 1 (end) is not valid", field)


def test_footer_duration_not_finite_is_one_line(tmp_path):
    # NaN is not JSON; a writer writing it anyway is refused like any other odd value.
    path = crafted(tmp_path, craft.header(), craft.end(b'{"duration_s": NaN}'))
    every_command_refuses(path, "end", "NaN")


def test_lost_events_by_reason_are_summed(tmp_path):
    path = crafted(tmp_path, craft.header(), good_events(),
                   craft.end({"lost_events": {"ringbuf_full": 3, "map_full": 4}}))
    result = CliRunner().invoke(cli, ["report", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["lost_events"] == 7


@pytest.mark.parametrize("p99, field", [
    ({"window_s": 0}, "window_s"), ({"window_s": "x"}, "window_s"),
    ({"window_s": -1}, "window_s"), ({"factor": -2}, "factor"),
    ({"consecutive": 0}, "consecutive"), ({"baseline_windows": 10**10}, "baseline_windows"),
    ({"consecutive": 1.5}, "consecutive"), ({"floor_s": -1}, "floor_s"),
])
def test_odd_detector_settings_in_meta_are_one_line(tmp_path, p99, field):
    path = crafted(tmp_path, craft.header(), craft.meta({"config": {"p99": p99}}),
                   good_events(), craft.end({}))
    every_command_refuses(path, "chunk 0 (meta) is not valid", f"p99.{field}")


@pytest.mark.parametrize("entropy", [{"tau": -5}, {"tau": 2}, {"consecutive": -3},
                                     {"delta_sigma": "wide"}])
def test_odd_entropy_settings_in_meta_are_one_line(tmp_path, entropy):
    path = crafted(tmp_path, craft.header(), craft.meta({"config": {"entropy": entropy}}),
                   craft.end({}))
    every_command_refuses(path, "config.entropy")


@pytest.mark.parametrize("doc, field", [
    ({"op_names": [[1, 2]]}, "op_names"), ({"op_names": "x"}, "op_names"),
    ({"op_names": [[-1, 2, "k"]]}, "op_names"),
    ({"symbol_names": {"abc": "x"}}, "symbol_names"),
    ({"apis": [{"id": "one"}]}, "apis"), ({"modalities": [1, 2]}, "modalities"),
    ({"config": []}, "config"), ("not an object", "meta"),
    ({"probes": {"state": "failed"}}, "probes"), ({"probes": ["failed"]}, "probes"),
])
def test_odd_meta_tables_are_one_line(tmp_path, doc, field):
    path = crafted(tmp_path, craft.header(), craft.meta(doc), craft.end({}))
    every_command_refuses(path, field)


def test_detector_settings_in_meta_are_used_when_valid(tmp_path):
    path = crafted(tmp_path, craft.header(),
                   craft.meta({"config": {"p99": {"window_s": 0.5, "consecutive": 2}}}),
                   good_events(), craft.end({"duration_s": 1.0}))
    result = CliRunner().invoke(cli, ["report", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["events"] == {"cpu.runq": 10}


# ------------------------------------------------------------- schemas

@pytest.mark.parametrize("schemas, expected", [
    ({"cpu.runq": [["delay_ns", "<u8"], ["pid", "<u4"]]}, "ts_ns"),
    ({"x.other": [["when", "<u8"]]}, "ts_ns"),
    ({"x.other": [["ts_ns", "<f8"]]}, "ts_ns"),
    ({"x.other": [["ts_ns", "<u8"], ["o", "|O"]]}, "field 'o'"),
    ({"x.other": [["ts_ns", "<u8"], ["o", "<u8"], ["o", "<u8"]]}, "invalid record layout"),
    ({"x.other": [["ts_ns", "<u8"], ["big", "V100000"]]}, "bytes"),
    ({"x.other": []}, "pairs"),
    ({"x.other": "ts_ns"}, "pairs"),
    ({"cpu.runq": [["ts_ns", "<u8"], ["delay_ns", "<u4"]]}, "delay_ns"),
    ({"dev.event": [["ts_ns", "<u8"]]}, "device event layout"),
    ([1], "schemas"),
])
def test_schemas_without_what_readers_need_are_one_line(tmp_path, schemas, expected):
    path = crafted(tmp_path, craft.header(schemas=schemas), craft.end({}))
    every_command_refuses(path, "header is not valid", expected)


def test_a_schema_readers_do_not_know_is_counted_and_left_alone(tmp_path):
    records = np.zeros(3, [("ts_ns", "<u8"), ("x", "<f4")])
    records["ts_ns"] = [5, 6, 7]
    path = crafted(tmp_path, craft.header(schemas={"x.other": [["ts_ns", "<u8"], ["x", "<f4"]]}),
                   craft.events(records), craft.end({}))
    result = CliRunner().invoke(cli, ["report", str(path), "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["events"] == {"x.other": 3}


# --------------------------------------------------------------- nesting

@pytest.mark.parametrize("where", ["header", "meta", "end"])
def test_deeply_nested_json_is_one_line(tmp_path, where):
    deep = craft.nested(100_000)
    parts = {
        "header": [craft.header(body=b'{"schemas": {}, "x": ' + deep + b"}")],
        "meta": [craft.header(), craft.meta(b'{"x": ' + deep + b"}")],
        "end": [craft.header(), craft.end(b'{"x": ' + deep + b"}")],
    }[where]
    path = crafted(tmp_path, *parts)
    every_command_refuses(path, "nested")


def test_brackets_inside_strings_are_not_nesting(tmp_path):
    path = crafted(tmp_path, craft.header(), craft.meta({"note": "[" * 5000 + '\\"{'}),
                   good_events(), craft.end({}))
    assert CliRunner().invoke(cli, ["report", str(path)]).exit_code == 0


# --------------------------------------------------------- header damage

def test_damaged_version_is_damage_not_a_newer_format(tmp_path):
    data = bytearray(write_sample(tmp_path / "full.mmtr").read_bytes())
    data[8:10] = b"\x42\x1b"            # major 6978: the checksum no longer holds
    path = crafted(tmp_path, bytes(data), name="v.mmtr")
    line = one_error_line(CliRunner().invoke(cli, ["report", str(path)]), "checksum")
    assert "newer" not in line and "upgrade" not in line


def test_garbage_after_the_magic_is_not_a_newer_format(tmp_path):
    path = crafted(tmp_path, recording.MAGIC + bytes(range(200, 256)) * 4)
    line = one_error_line(CliRunner().invoke(cli, ["report", str(path)]))
    assert "newer" not in line and "upgrade" not in line


def test_only_an_intact_newer_header_asks_for_an_upgrade(tmp_path):
    path = crafted(tmp_path, craft.header(major=recording.MAJOR + 1), craft.end({}))
    one_error_line(CliRunner().invoke(cli, ["report", str(path)]), "newer", "upgrade")


def test_a_huge_header_length_is_damage(tmp_path):
    head = craft.header()
    path = crafted(tmp_path, head[:12] + (0xFFFFFFFF).to_bytes(4, "little") + head[16:])
    one_error_line(CliRunner().invoke(cli, ["report", str(path)]), "header", "damaged")


@pytest.mark.parametrize("chunk, expected", [
    (craft.chunk(recording.KIND_EVENTS, b"\0" * 48, schema=7, count=1), "schema 7"),
    (craft.chunk(recording.KIND_EVENTS, b"\0" * 47, schema=0, count=1), "47 bytes"),
    (craft.chunk(recording.KIND_META, b"\xff\xfe"), "chunk 0"),
])
def test_inconsistent_chunks_keep_the_prefix(tmp_path, chunk, expected):
    path = crafted(tmp_path, craft.header(), chunk, craft.end({}))
    result = CliRunner().invoke(cli, ["report", str(path), "--json"])
    if result.exit_code == 0:
        assert expected in result.stderr and "mmtrace: warning:" in result.stderr
    else:
        one_error_line(result, expected)


# ------------------------------------------------------ not regular files

@pytest.mark.parametrize("target", ["/dev/zero", "fifo"])
def test_inputs_that_are_not_files_are_refused_at_once(tmp_path, target, mmtrace_cli):
    if target == "fifo":
        target = tmp_path / "fifo"
        os.mkfifo(target)
    started = time.monotonic()
    result = mmtrace_cli("report", target, timeout=30)
    assert time.monotonic() - started < 10
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1 and result.stderr.startswith("mmtrace: error:")


# ----------------------------------------------------------------- exports

def test_export_into_a_full_device_is_one_line(tmp_path):
    path = write_sample(tmp_path / "a.mmtr", chunks=20, per_chunk=1000)
    with open("/dev/full", "w") as full:
        proc = subprocess.run([str(_mmtrace()), "export", str(path), "--format", "jsonl",
                               "-o", "-"], stdout=full, stderr=subprocess.PIPE, text=True,
                              timeout=60)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [
        "mmtrace: error: cannot write standard output: No space left on device"]


def _mmtrace():
    from conftest import MMTRACE
    return MMTRACE


def test_a_closed_pipe_is_silent(tmp_path):
    path = write_sample(tmp_path / "a.mmtr", chunks=50, per_chunk=2000)
    proc = subprocess.run(f'"{_mmtrace()}" export "{path}" --format jsonl -o - | head -1',
                          shell=True, capture_output=True, text=True, timeout=60,
                          executable="/bin/bash")
    assert proc.stderr == ""
    assert json.loads(proc.stdout)["kind"] == "runq"


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("how", ["same", "symlink", "hardlink"])
def test_an_export_never_overwrites_its_input(tmp_path, fmt, how):
    path = write_sample(tmp_path / "a.mmtr")
    before = path.read_bytes()
    out = {"same": path, "symlink": tmp_path / "link", "hardlink": tmp_path / "hard"}[how]
    if how == "symlink":
        out.symlink_to(path)
    elif how == "hardlink":
        os.link(path, out)
    result = CliRunner().invoke(cli, ["export", str(path), "--format", fmt, "-o", str(out)])
    one_error_line(result, "refusing to write through it" if how == "symlink"
                   else "refusing to overwrite")
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        {"a.mmtr", out.name})


@pytest.fixture
def small_disk(tmp_path):
    """A real 64 KiB tmpfs: writes past it fail with ENOSPC."""
    if os.geteuid() != 0 or not shutil.which("mount"):
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "disk"
    where.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(where)], check=True)
    yield where
    subprocess.run(["umount", str(where)], check=True)


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_failed_export_leaves_nothing_and_keeps_the_old_output(tmp_path, small_disk, fmt):
    path = write_sample(tmp_path / "a.mmtr", chunks=20, per_chunk=1000)
    old = small_disk / "out"
    old.write_bytes(b"the previous export")
    result = CliRunner().invoke(cli, ["export", str(path), "--format", fmt, "-o", str(old)])
    one_error_line(result, "cannot write", "No space left on device")
    assert [p.name for p in small_disk.iterdir()] == ["out"]
    assert old.read_bytes() == b"the previous export"


@pytest.mark.parametrize("fmt", FORMATS)
def test_an_export_replaces_its_output_whole(tmp_path, fmt):
    path = write_sample(tmp_path / "a.mmtr")
    out = tmp_path / "out"
    out.write_bytes(b"x" * 10_000_000)
    result = CliRunner().invoke(cli, ["export", str(path), "--format", fmt, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert out.stat().st_size < 1_000_000
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.mmtr", "out"]
    if fmt == "chrome":
        assert len(json.loads(out.read_text())["traceEvents"]) == 41


# ------------------------------------------------------------ meta budget

def test_only_the_latest_symbol_table_is_kept(tmp_path):
    w = recording.RecordingWriter(tmp_path / "s.mmtr", {"cpu.runq": RUNQ_EVENT})
    for n in range(1, 30):
        w.write_meta({"symbol_names": {str(k): f"aclnnOp{k}" for k in range(n)}})
    w.write_meta({"op_names": [[1, 2, "k"]]})
    w.close({})
    with recording.RecordingReader(tmp_path / "s.mmtr") as rec:
        tables = [d for d in rec.meta if "symbol_names" in d]
        assert len(tables) == 1 and len(tables[0]["symbol_names"]) == 29
        assert {"op_names": [[1, 2, "k"]]} in rec.meta


def test_meta_beyond_the_budget_is_left_out_with_a_warning(tmp_path):
    w = recording.RecordingWriter(tmp_path / "m.mmtr", {"cpu.runq": RUNQ_EVENT})
    row = [[1, 0x1000, "k" * 200]]
    for _ in range(3):
        w.write_meta({"op_names": row * 15_000})      # about 3.2 MB each
    w.close({})
    with recording.RecordingReader(tmp_path / "m.mmtr") as rec:
        assert len(rec.meta) == 2
        assert any("meta beyond" in warning for warning in rec.warnings)
        assert rec.complete


@pytest.mark.parametrize("dangling", [False, True])
def test_an_export_through_a_symlink_is_refused_and_its_target_left_alone(tmp_path, dangling):
    """A link planted where root will write (a sticky /tmp): neither a file
    it points to nor a missing one it names is changed or created."""
    path = write_sample(tmp_path / "a.mmtr")
    target = tmp_path / "victim"
    if not dangling:
        target.write_text("root's own")
        target.chmod(0o600)
    (tmp_path / "link.jsonl").symlink_to(target)
    result = CliRunner().invoke(cli, ["export", str(path), "--format", "jsonl",
                                      "-o", str(tmp_path / "link.jsonl")])
    one_error_line(result, f"{tmp_path / 'link.jsonl'}: is a symbolic link (to {target}); "
                           "refusing to write through it")
    assert (tmp_path / "link.jsonl").is_symlink()
    if dangling:
        assert not target.exists()
    else:
        assert target.read_text() == "root's own" and target.stat().st_mode & 0o777 == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["a.mmtr", "link.jsonl"] + ([] if dangling else ["victim"]))