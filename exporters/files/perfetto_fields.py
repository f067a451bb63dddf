"""Field numbers of Perfetto's trace_packet.proto, track_event.proto,
track_descriptor.proto and counter_descriptor.proto that the trace
writers use (perfetto.py and the perfetto_* modules beside it),
and the packet every one of them is wrapped in."""

from mmtrace.exporters.files.protowire import field_bytes, field_varint

# Trace
TRACE_PACKET = 1
# TracePacket
TP_TIMESTAMP = 8
TP_SEQUENCE_ID = 10
TP_TRACK_EVENT = 11
TP_SEQUENCE_FLAGS = 13
TP_TRACK_DESCRIPTOR = 60
SEQ_INCREMENTAL_STATE_CLEARED = 1
# TrackDescriptor
TD_UUID = 1
TD_NAME = 2
TD_PROCESS = 3
TD_THREAD = 4
TD_PARENT_UUID = 5
TD_COUNTER = 8
# CounterDescriptor
CD_UNIT = 3
UNIT_SIZE_BYTES = 3
# ProcessDescriptor / ThreadDescriptor
PD_PID = 1
PD_NAME = 6
THD_PID = 1
THD_TID = 2
THD_NAME = 5
# TrackEvent
TE_TYPE = 9
TE_TRACK_UUID = 11
TE_CATEGORIES = 22
TE_NAME = 23
TE_COUNTER_VALUE = 30
TE_DOUBLE_COUNTER_VALUE = 44
TE_FLOW_IDS = 47
TE_TERMINATING_FLOW_IDS = 48
SLICE_BEGIN = 1
SLICE_END = 2
INSTANT = 3
COUNTER = 4

# TracePacket, the clocks: every timestamp is CLOCK_MONOTONIC (the kernel's
# bpf_ktime_get_ns), said once per sequence in its defaults; a
# ClockSnapshot pairs it with the wall clock.
TP_CLOCK_SNAPSHOT = 6
TP_TRACE_PACKET_DEFAULTS = 59
TPD_TIMESTAMP_CLOCK_ID = 58
CS_CLOCKS = 1
CS_PRIMARY_TRACE_CLOCK = 2
CLOCK_ID = 1
CLOCK_TIMESTAMP = 2
BUILTIN_CLOCK_REALTIME = 1
BUILTIN_CLOCK_MONOTONIC = 3

# Sequences: the tracks' events (in time order, perfetto_order.py), the
# few that came too late for it, and the anomalies, the hints and device
# memory written last.
SEQUENCE_ID = 7
LATE_SEQUENCE = 8
ANOMALY_SEQUENCE = 9
HINT_SEQUENCE = 10
MEMORY_SEQUENCE = 11        # device memory held per process (perfetto_memory.py)


def packet(*fields: bytes, sequence: int = SEQUENCE_ID) -> bytes:
    """A TracePacket on one of mmtrace's sequences (the main one unless
    told), holding `fields`; the sequence id comes first."""
    return field_bytes(TRACE_PACKET, field_varint(TP_SEQUENCE_ID, sequence) + b"".join(fields))


def sequence_start(sequence: int) -> bytes:
    """The first packet of a sequence: its state starts here, and its
    timestamps are CLOCK_MONOTONIC."""
    defaults = field_varint(TPD_TIMESTAMP_CLOCK_ID, BUILTIN_CLOCK_MONOTONIC)
    return packet(field_varint(TP_SEQUENCE_FLAGS, SEQ_INCREMENTAL_STATE_CLEARED),
                  field_bytes(TP_TRACE_PACKET_DEFAULTS, defaults), sequence=sequence)


def clock_snapshot(monotonic_ns: int, realtime_minus_monotonic_ns: int | None) -> bytes:
    """A ClockSnapshot: CLOCK_MONOTONIC (the trace's clock) and, where the
    recording knows it, the wall clock at the same moment."""
    clocks = [(BUILTIN_CLOCK_MONOTONIC, monotonic_ns)]
    if isinstance(realtime_minus_monotonic_ns, int):
        clocks.append((BUILTIN_CLOCK_REALTIME, monotonic_ns + realtime_minus_monotonic_ns))
    body = b"".join(field_bytes(CS_CLOCKS, field_varint(CLOCK_ID, cid)
                                + field_varint(CLOCK_TIMESTAMP, max(0, ts)))
                    for cid, ts in clocks)
    body += field_varint(CS_PRIMARY_TRACE_CLOCK, BUILTIN_CLOCK_MONOTONIC)
    return packet(field_bytes(TP_CLOCK_SNAPSHOT, body))


def trace_start(start_ns: int, realtime_minus_monotonic_ns: int | None) -> bytes:
    """What a trace opens with: its main sequence's state and clock, and
    the wall clock beside it."""
    return sequence_start(SEQUENCE_ID) + clock_snapshot(start_ns, realtime_minus_monotonic_ns)
