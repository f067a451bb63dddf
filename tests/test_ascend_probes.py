"""The NPU stream on real eBPF against stand-in libascendcl.so and
libopapi.so built from CANN's exact public prototypes (no NPU here): every
call once with every field decoded, aclnn ops named by the symbol they
entered (one program for all of them), opType strings, truncation of
over-long names, and the per-symbol attachment used on older kernels."""

import numpy as np
import pytest

from gpu_fixtures import DeviceSession, api_names, natives  # noqa: F401

pytestmark = pytest.mark.bpf

LONG_OP = ("FusedInferAttentionScoreWithQuantizedKeyValueCacheAndRotaryEmbeddingPagedV3_"
           "0123456789ab")
EXPECTED_APIS = [
    "aclnn", "aclnn", "aclnn", "aclopExecuteV2", "aclopCompileAndExecute",
    "aclopCompileAndExecuteV2", "aclmdlExecute", "aclmdlExecuteAsync", "aclrtLaunchKernel",
    "aclrtLaunchKernelWithConfig", "aclrtLaunchKernelWithHostArgs",
    *["aclrtMemcpyAsync"] * 8, "aclrtMemcpy", "aclrtSynchronizeStream",
    "aclrtSynchronizeStreamWithTimeout", "aclrtSynchronizeDevice"]


def run_calls(session, natives):
    out = session.run([natives.ascend_calls, 1000])
    return out, session.events(out["pid"])


@pytest.fixture(scope="module")
def ascend_session(natives):
    session = DeviceSession([natives.ascendcl, natives.opapi])
    yield session
    session.close()


def test_each_call_once_with_every_field(ascend_session, natives):
    from mmtrace.agent.recording.device_view import decode
    out, ev = run_calls(ascend_session, natives)
    assert api_names(ev) == EXPECTED_APIS
    assert set(ev["device"].tolist()) == {5}        # aclrtSetDevice(5) succeeded first
    assert set(ev["tid"].tolist()) == {out["pid"]}
    assert ev["op_id"].tolist() == list(range(1, 21)) + [0, 0, 0]
    col = {k: ev[k].tolist() for k in ("handle", "stream_handle", "bytes", "direction",
                                       "grid_x", "grid_y", "grid_z")}
    # aclnn: executor from phase 1, stream
    assert col["handle"][:3] == [out["add"], out["mul"], out["softmax"]]
    assert col["stream_handle"][:3] == [0xb001, 0xb002, 0xb001]
    # aclop: stack-passed streams (3rd and 6th stack slot)
    assert col["stream_handle"][3:6] == [0xb003, 0xb004, 0xb005]
    # aclmdlExecute (blocking, timed) and Async
    assert col["handle"][6:8] == [7, 8] and col["stream_handle"][7] == 0xb001
    assert ev["duration_ns"][6] >= 1_000_000 and ev["flags"][6] & 1
    # aclrtLaunchKernel*: function handle, blocks, stream
    assert col["handle"][8:11] == [0xc001, 0xc002, 0xc003]
    assert col["grid_x"][8:11] == [24, 48, 96] and set(col["grid_y"][8:11]) == {1}
    assert col["stream_handle"][8:11] == [0xb001, 0xb002, 0xb003]
    # copies: every aclrtMemcpyKind, then the blocking one
    assert col["bytes"][11:20] == [200, 201, 202, 203, 204, 205, 206, 207, 300]
    assert col["direction"][11:20] == [0, 1, 2, 3, 4, 5, 6, 7, 2]
    assert ev["duration_ns"][19] >= 1_000_000
    # syncs: stream, stream with timeout, device; each blocks 2-3 ms
    assert col["stream_handle"][20:23] == [0xb001, 0xb002, 0]
    assert (ev["duration_ns"][20:23] >= 2_000_000).all()

    rows = decode(ev, ascend_session.context())
    assert rows.api.tolist()[:6] == ["aclnnAdd", "aclnnMul", "aclnnSoftmax", "aclopExecuteV2",
                                     "aclopCompileAndExecute", "aclopCompileAndExecuteV2"]
    assert rows.op_name.tolist()[:6] == ["aclnnAdd", "aclnnMul", "aclnnSoftmax", "MatMulV2",
                                         "LayerNorm", LONG_OP[:63] + "\u2026"]
    assert rows.direction.tolist()[11:20] == ["h2h", "h2d", "d2h", "d2d", "default", "h2d",
                                              "d2d", "d2d", "d2h"]
    assert set(rows.stream.tolist()) == {"npu"}
    retired = rows.events["retired_ns"]
    ends = ev["ts_ns"].astype(np.int64) + ev["duration_ns"].astype(np.int64)
    stream_sync, timeout_sync, device_sync = ends[20], ends[21], ends[22]
    by_stream = {0xb001: stream_sync, 0xb002: timeout_sync}
    for i in [0, 1, 2, 3, 4, 5, 7, 8, 9, 10, *range(11, 19)]:
        expect = by_stream.get(col["stream_handle"][i], device_sync)
        assert retired[i] == expect, (i, api_names(ev[i:i + 1]))
    assert retired[6] == ends[6] and retired[19] == ends[19]     # blocking calls
    assert rows.events["op_id"][20:23].tolist() == [19, 10, 20]


def test_aclnn_phase_one_is_not_probed(ascend_session):
    rows = [s for s in ascend_session.states if s.symbol.startswith("aclnn")]
    assert [(s.state, s.count) for s in rows] == [("attached", 3)]
    assert sorted(ascend_session.device.symbol_names().values()) == [
        "aclnnAdd", "aclnnMul", "aclnnSoftmax"]


def test_over_long_op_type_is_truncated_and_flagged(ascend_session, natives):
    out, ev = run_calls(ascend_session, natives)
    long_op = ev[api_names(ev).index("aclopCompileAndExecuteV2")]
    assert long_op["name"] == LONG_OP[:63].encode()
    assert long_op["flags"] & 2     # DEV_NAME_TRUNCATED, by the kernel or the agent
    # Names are never longer than their field: neighbours are intact.
    assert ev[api_names(ev).index("aclmdlExecute")]["handle"] == 7


@pytest.mark.parametrize("cookies", [True, False], ids=["with-cookies", "by-address"])
def test_per_symbol_attachment(natives, monkeypatch, cookies):
    """Kernels without uprobe_multi: a uprobe per symbol, aclnn ops named by
    cookie (5.15+) or, without, by their address while the process lives."""
    from mmtrace.agent.kernel import probe_attach
    from mmtrace.agent.recording.device_view import decode
    from mmtrace.agent.kernel.uprobe_link import LinkError
    if not cookies:
        def refuse(*args, **kwargs):
            raise LinkError(22, "no cookies on this kernel")
        monkeypatch.setattr(probe_attach, "CookieLink", refuse)
    session = DeviceSession([natives.ascendcl, natives.opapi], attach_mode="single")
    try:
        assert session.device.mode == "single"
        out, ev = run_calls(session, natives)
        assert api_names(ev) == EXPECTED_APIS
        ids = ev["symbol_id"][:3].tolist()
        assert (all(ids) if cookies else ids == [0, 0, 0])
        rows = decode(ev, session.context())
        assert rows.op_name.tolist()[:3] == ["aclnnAdd", "aclnnMul", "aclnnSoftmax"]
        assert rows.events["retired_ns"][0] == ev["ts_ns"][20] + ev["duration_ns"][20]
    finally:
        session.close()
