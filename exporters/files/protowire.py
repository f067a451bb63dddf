"""The few protobuf wire-format encoders the Perfetto exporter needs."""


def varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64          # int64 fields: two's complement, 10 bytes
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def field_varint(number: int, value: int) -> bytes:
    return varint(number << 3) + varint(value)


def field_bytes(number: int, payload: bytes) -> bytes:
    return varint(number << 3 | 2) + varint(len(payload)) + payload


def field_str(number: int, text: str) -> bytes:
    return field_bytes(number, text.encode())


def read_fields(data: bytes):
    """Decode one message into (number, wire_type, value) triples; for tests
    and for checking what was written."""
    i = 0
    out = []
    while i < len(data):
        key, i = _read_varint(data, i)
        number, wire = key >> 3, key & 7
        if wire == 0:
            value, i = _read_varint(data, i)
        elif wire == 2:
            length, i = _read_varint(data, i)
            value, i = data[i:i + length], i + length
        elif wire == 1:
            value, i = int.from_bytes(data[i:i + 8], "little"), i + 8
        elif wire == 5:
            value, i = int.from_bytes(data[i:i + 4], "little"), i + 4
        else:
            raise ValueError(f"wire type {wire} at byte {i} is not one this reader knows")
        out.append((number, wire, value))
    return out


def _read_varint(data: bytes, i: int):
    shift = value = 0
    while True:
        if i >= len(data):
            raise ValueError("varint runs past the end of the message")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, i
        shift += 7


def field_fixed64(number: int, value: int) -> bytes:
    return varint(number << 3 | 1) + (value % (1 << 64)).to_bytes(8, "little")
