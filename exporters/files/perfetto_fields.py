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

SEQUENCE_ID = 7


def packet(*fields: bytes) -> bytes:
    """A TracePacket on mmtrace's sequence, holding `fields`."""
    return field_bytes(TRACE_PACKET, field_varint(TP_SEQUENCE_ID, SEQUENCE_ID) + b"".join(fields))
