"""Text and protobuf rows built for a whole batch of events at once with
numpy, not one event at a time: each row is laid out as columns of bytes
(fixed pieces, decimal numbers, varints, strings from a small table) with a
mask of the bytes it uses, and the rows come out as one compacted buffer."""

import ctypes
import json
from dataclasses import dataclass

import numpy as np

_POW10 = 10 ** np.arange(1, 20, dtype=np.uint64)   # 10 .. 10**19
# Four decimal digits at once, as the uint32 of their bytes: 0..9999 with
# leading zeros, then 10000 + (0..9999) with NUL for the leading zeros (the
# highest group of a number: 0 is "0"), then 20000: four NULs (a group
# above the number's highest).
_DIGITS4 = np.array([b"%04d" % i for i in range(10000)]
                    + [(b"%d" % i).rjust(4, b"\0") for i in range(10000)] + [b"\0" * 4],
                    "S4").view(np.uint32)
_TEN4 = np.uint64(10000)
_VARINT_STEPS = np.array([1 << 7 * k for k in range(1, 10)], np.uint64)   # 2**7 .. 2**63
# Text rows carry no control byte but a newline: the others can stand for
# long fixed pieces until the end.
_STAND_IN_BYTES = [bytes([b]) for b in range(1, 0x20) if b not in b"\t\n\r"]
# A fixed piece of text rows stands in where it is longer than this share
# of the mean row (and than 16 bytes): a byte costs about twelve times as
# much carried through the matrix (compared and compacted) as passed over
# by bytes.replace once the rows are joined.
STAND_IN_SHARE = 1 / 12


class Rows:
    """n rows, built left to right; bytes() joins them (no separator).

    `text=True` (JSON text, where no byte below 0x20 appears raw) marks
    unused bytes with NUL and drops them in one comparison, instead of a
    mask per column; and a long fixed piece stands as one control byte
    until the end, where bytes.replace puts it back. That pass over the
    text pays where the piece is a twelfth of a row or more; a shorter one
    costs less carried through every row of the matrix (STAND_IN_SHARE)."""

    def __init__(self, n: int, text: bool = False):
        self.n = n
        self.text = text
        self._cols: list[np.ndarray] = []
        self._keep: list[np.ndarray | None] = []    # None: every byte of the column
        self._lengths = np.zeros(n, np.int64)

    def const(self, text: bytes):
        if text:
            self._cols.append(np.broadcast_to(np.frombuffer(text, np.uint8), (self.n, len(text))))
            self._keep.append(None)
            self._lengths += len(text)
        return self

    def _add(self, cols: np.ndarray, lengths: np.ndarray, right: bool, padded: bool = False):
        """`padded`: the unused bytes of `cols` are NUL already."""
        if (self.text and padded) or not len(lengths) or int(lengths.min()) == cols.shape[1]:
            keep = None         # NUL where unused already, or every byte used
        else:
            width = cols.shape[1]
            pos = np.arange(width)
            keep = pos >= (width - lengths)[:, None] if right else pos < lengths[:, None]
        if self.text and keep is not None:
            cols = np.where(keep, cols, np.uint8(0))
            keep = None
        self._cols.append(cols)
        self._keep.append(keep)
        self._lengths += lengths

    def decimal(self, values: np.ndarray):
        """Non-negative integers in decimal."""
        values = np.asarray(values).astype(np.uint64, copy=False)
        lengths, shortest, width = _lengths_and_range(values, _POW10)
        groups = (width + 3) // 4
        digits = np.empty((self.n, groups), np.uint32)
        v = values
        for k in range(groups - 1, -1, -1):     # four digits a step, NUL before the first
            above = v // _TEN4
            at = (v - above * _TEN4).astype(np.intp)
            digits_below = 4 * (groups - 1 - k)     # in the groups to the right of this one
            if shortest < digits_below + 4:     # a number whose highest group this is, or above it
                at += 10000 * (above == 0)
                if shortest <= digits_below:
                    at += 10000 * (v == 0)
            digits[:, k] = _DIGITS4[at]
            v = above
        cols = digits.view(np.uint8).reshape(self.n, 4 * groups)[:, 4 * groups - width:]
        self._add(cols, lengths, right=True, padded=True)
        return self

    def signed(self, values: np.ndarray):
        """Integers in decimal, a minus sign before the negative ones."""
        values = np.asarray(values).astype(np.int64)
        self.optional(values < 0, Rows(self.n, text=True).const(b"-"), absent=b"")
        return self.decimal(np.abs(values))

    def fixed3(self, thousandths: np.ndarray):
        """Non-negative integers n written as n / 1000 with three decimals."""
        values = np.asarray(thousandths).astype(np.uint64)
        self.decimal(values // 1000)
        self.const(b".")
        frac = values % 1000
        cols = np.stack([frac // 100, frac // 10 % 10, frac % 10], axis=1).astype(np.uint8) + 48
        self._cols.append(cols)
        self._keep.append(None)
        self._lengths += 3
        return self

    def varint(self, values: np.ndarray):
        """Protobuf base-128 varints of non-negative integers. Built a byte
        position at a time into contiguous planes, laid out as columns by a
        transposed view: written straight into the columns of the row
        matrix, each position was a strided pass, and varints of 6 or 9
        bytes took about twice as long."""
        v = np.asarray(values).astype(np.uint64)       # a copy: shifted in place below
        lengths, shortest, width = _lengths_and_range(v, _VARINT_STEPS)
        planes = np.empty((width, self.n), np.uint8)   # planes[k]: each varint's byte k
        for k in range(width):
            np.bitwise_and(v, np.uint64(0x7F), out=planes[k], casting="unsafe")
            if k + 1 < width:
                v >>= np.uint64(7)
        if shortest > 1:                # every varint goes on past these bytes
            planes[:shortest - 1] |= 0x80
        for k in range(shortest - 1, width - 1):
            planes[k] |= (lengths > k + 1).view(np.uint8) << 7
        self._add(planes.T, lengths, right=False)
        return self

    def fixed(self, cols: np.ndarray, present: np.ndarray):
        """Row i gets cols[i] (a byte matrix) where present[i], else nothing."""
        if self.text:
            cols = np.array(cols, np.uint8)     # text rows may write over their columns
        self._add(cols, np.where(present, cols.shape[1], 0), right=False)
        return self

    def table(self, codes: np.ndarray, entries: list[bytes]):
        """Row i gets entries[codes[i]]."""
        width = max((len(e) for e in entries), default=0)
        if not width:
            return self
        padded = np.zeros((len(entries), width), np.uint8)
        for i, entry in enumerate(entries):
            padded[i, :len(entry)] = np.frombuffer(entry, np.uint8)
        lengths = np.array([len(e) for e in entries], np.int64)
        # Padded with NUL: text rows need no mask (JSON text holds no NUL).
        self._add(padded[codes], lengths[codes], right=False, padded=True)
        return self

    def optional(self, present: np.ndarray, sub: "Rows", absent: bytes = b"null"):
        """`sub`'s text on the rows where `present`, else `absent` (text rows).
        `sub` is used up: its columns may be written over."""
        if not self.text or not sub.text:
            raise ValueError("optional() takes text rows")
        if not sub._cols:
            cols = np.zeros((self.n, 0), np.uint8)
        elif len(sub._cols) == 1:
            cols = sub._cols[0]
            if not cols.flags.writeable:    # a fixed piece alone: a view of its bytes
                cols = cols.copy()
        else:
            cols = np.concatenate(sub._cols, axis=1)
        if cols.shape[1] < len(absent):
            cols = np.concatenate([cols, np.zeros((self.n, len(absent) - cols.shape[1]),
                                                  np.uint8)], axis=1)
        missing = ~np.asarray(present, bool)
        # The absent text over the first bytes of a missing row, NUL after.
        stand = np.zeros(cols.shape[1], np.uint8)
        stand[:len(absent)] = np.frombuffer(absent, np.uint8)
        cols[missing] = stand
        self._cols.append(cols)
        self._keep.append(None)
        self._lengths += np.where(missing, len(absent), sub._lengths)
        return self

    def where(self, present: np.ndarray, sub: "Rows"):
        """`sub`'s bytes on the rows where `present`, else none (binary rows)."""
        if self.text or sub.text:
            raise ValueError("where() takes binary rows; optional() is for text")
        present = np.asarray(present, bool)
        for col, keep in zip(sub._cols, sub._keep):
            mask = np.broadcast_to(present[:, None], col.shape)    # no copy: a view
            self._cols.append(col)
            self._keep.append(mask if keep is None else keep & mask)
        self._lengths += np.where(present, sub._lengths, 0)
        return self

    def take(self, at: np.ndarray) -> "Rows":
        """A new Rows of the rows `at` (indices), in that order."""
        out = Rows(len(at), self.text)
        out._cols = [np.broadcast_to(col[:1], (len(at), col.shape[1])) if _fixed(col)
                     else col[at] for col in self._cols]
        out._keep = [None if keep is None else keep[at] for keep in self._keep]
        out._lengths = self._lengths[at]
        return out

    def rows(self, other: "Rows"):
        """Append another batch's columns (same row count) to each row."""
        self._cols += other._cols
        self._keep += other._keep
        self._lengths += other._lengths
        return self

    def lengths(self) -> np.ndarray:
        """Bytes in each row."""
        return self._lengths

    def bytes(self) -> bytes:
        if not self.n or not self._cols:
            return b""
        cols, stand_ins = self._matrix()
        if self.text:
            out = cols[cols != 0].tobytes()
            # Each pass copies all that the ones before it grew: the
            # longest pieces go back last (a run-queue line's replaces took
            # 0.7 of the time in this order).
            for stand_in, text in sorted(stand_ins, key=lambda pair: len(pair[1])):
                out = out.replace(stand_in, text)
            return out
        if all(mask is None for mask in self._keep):
            return cols.tobytes()       # every row as wide as the others
        keep = np.ones(cols.shape, bool)
        at = 0
        for col, mask in zip(self._cols, self._keep):
            if mask is not None:
                keep[:, at:at + col.shape[1]] = mask
            at += col.shape[1]
        return cols[keep].tobytes()

    def _matrix(self) -> tuple[np.ndarray, list[tuple[bytes, bytes]]]:
        """The columns side by side, and the (stand-in, fixed piece) pairs
        of text rows. Copying a column into place costs per row whatever
        its width, and half the columns are fixed pieces: those are laid
        once in a template row that every row is copied from (one wide copy
        a row), and only the computed columns are copied in."""
        long_piece = max(16, int(self._lengths.mean()) * STAND_IN_SHARE) if self.text else None
        pieces, stand_ins, computed = [], [], []
        at = 0
        for col in self._cols:
            piece = col[0].tobytes() if _fixed(col) else None
            if long_piece is not None and piece is not None and len(piece) > long_piece \
                    and len(stand_ins) < len(_STAND_IN_BYTES):
                stand_ins.append((_STAND_IN_BYTES[len(stand_ins)], piece))
                piece = stand_ins[-1][0]
            if piece is not None:
                pieces.append(piece)
                at += len(piece)
            else:
                pieces.append(bytes(col.shape[1]))
                computed.append((at, col))
                at += col.shape[1]
        out = np.empty((self.n, at), np.uint8)
        out[:] = np.frombuffer(b"".join(pieces), np.uint8)
        for at, col in computed:
            out[:, at:at + col.shape[1]] = col
        return out, stand_ins


def _fixed(col: np.ndarray) -> bool:
    """Whether a column is a fixed piece (a broadcast: one row's bytes)."""
    return col.strides[0] == 0


def records_at(records: np.ndarray, at: np.ndarray) -> np.ndarray:
    """records[at], copied as whole records' bytes: numpy copies records
    that hold byte-string fields field by field, ten times slower (as
    agent/ingest/record_arrays.take, which this layer may not import)."""
    rows = np.ascontiguousarray(records).view(np.uint8).reshape(len(records), -1)
    return np.ascontiguousarray(rows[at]).view(records.dtype).reshape(-1)


def first_per_thread(records: np.ndarray, order: np.ndarray | None = None
                     ) -> tuple[list, list, list]:
    """(pids, tids, comms) of each thread's first record, in record order
    (that of records[order], where given)."""
    pid, tid = records["pid"], records["tid"]
    if order is not None:
        pid, tid = pid[order], tid[order]
    keys = pid.astype(np.uint64) << np.uint64(32) | tid
    first = _firsts(keys[:, None])
    if first is None:
        first = np.sort(np.unique(keys, return_index=True)[1])
    at = first if order is None else order[first]
    return (records["pid"][at].tolist(), records["tid"][at].tolist(),
            records["comm"][at].tolist())


def _lengths(values: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """1 + how many of `steps` (ascending) each value reaches. Only the
    steps between the column's least and greatest value are compared, a
    vector comparison each: a column's values mostly share a length (times,
    pids), and a binary search per value cost 2-10 times more."""
    values = np.asarray(values).astype(np.uint64)
    lengths, _, _ = _lengths_and_range(values, steps)
    return lengths if values.ndim else lengths[()]     # one value: a scalar, as before


def _lengths_and_range(values: np.ndarray, steps: np.ndarray) -> tuple[np.ndarray, int, int]:
    """(lengths, the least, the greatest) of uint64 `values` (_lengths);
    no values: the lengths of none, and 1 (the width of "0")."""
    if not values.size:
        return np.zeros(values.shape, np.int64), 1, 1
    low = int(np.searchsorted(steps, values.min(), side="right"))
    high = int(np.searchsorted(steps, values.max(), side="right"))
    lengths = np.full(values.shape, 1 + low, np.int64)
    for step in steps[low:high]:
        lengths += values >= step
    return lengths, 1 + low, 1 + high


def decimal_lengths(values: np.ndarray) -> np.ndarray:
    """Digits of each non-negative integer in decimal."""
    return _lengths(values, _POW10)


def varint_lengths(values: np.ndarray) -> np.ndarray:
    """Bytes of each value as a protobuf varint (negative ones as uint64)."""
    return _lengths(values, _VARINT_STEPS)


def codes(values) -> tuple[np.ndarray, list]:
    """(codes, distinct values in first-seen order) of a column of hashable
    Python values; hashing runs in C (dict.fromkeys, map), not per row.
    An object array is told apart by its objects first (object_codes)."""
    if isinstance(values, np.ndarray) and values.dtype == object and values.ndim == 1:
        return object_codes(values)
    distinct = list(dict.fromkeys(values))
    index = {v: i for i, v in enumerate(distinct)}
    return np.fromiter(map(index.__getitem__, values), np.int64, len(values)), distinct


FEW_ROWS = 256


def object_codes(values: np.ndarray) -> tuple[np.ndarray, list]:
    """codes() of a 1-d object array (row_codes of one column)."""
    found, distinct = row_codes(values)
    return found, [value for value, in distinct]


def row_codes(*columns: np.ndarray) -> tuple[np.ndarray, list[tuple]]:
    """codes() of the rows of object columns taken together, as tuples
    (codes(list(zip(*columns)))). A decoded column holds few objects, each
    in many rows (every row of an API shares its name's str): rows are
    grouped by the objects they hold, read as integers from the arrays'
    own buffers and hashed (_distinct_words), and one row of each group is
    hashed by value, which merges equal values held by distinct objects.
    A hash of each row's values cost 3-5 times more; below FEW_ROWS rows
    (a batch's failed calls) the hash tables' set-up costs more than it
    saves, and the values are hashed row by row."""
    n = len(columns[0])
    if any(len(c) != n for c in columns):
        raise ValueError(f"expected columns of one length, got {[len(c) for c in columns]}")
    if n < FEW_ROWS:
        return codes(list(zip(*(np.asarray(c, object).tolist() for c in columns))))
    held = [np.ascontiguousarray(np.asarray(c, object)) for c in columns]
    found, firsts = _distinct_words(np.stack([_addresses(c) for c in held], axis=1))
    merged, distinct = codes(list(zip(*(c[firsts].tolist() for c in held))))
    return merged[found], distinct


def _addresses(values: np.ndarray) -> np.ndarray:
    """The address of each object of a contiguous object array (what id()
    gives), copied out of its buffer: the caller keeps `values`, and so
    the objects, alive while it uses them."""
    held = (ctypes.c_char * (len(values) * values.itemsize)).from_address(values.ctypes.data)
    return np.frombuffer(held, np.uintp).astype(np.uint64)


def _distinct_words(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(each row's index among the distinct rows, the first row of each, in
    row order) of n rows of 8-byte words (_firsts, or a sort where two
    distinct rows share a slot)."""
    slot = _slots(words)
    firsts = _firsts(words, slot)
    if firsts is not None:
        code = np.empty(1 << _HASH_BITS, np.int64)
        code[slot[firsts]] = np.arange(len(firsts))
        return code[slot], firsts
    # Told apart a word at a time, as integers: several times faster than
    # a sort of whole rows.
    found = np.zeros(len(words), np.int64)
    for column in words.T:
        seen, inverse = np.unique(column, return_inverse=True)
        _, found = np.unique(found * len(seen) + inverse.reshape(-1), return_inverse=True)
    _, first = np.unique(found, return_index=True)
    by_first = np.argsort(first)
    renumber = np.empty(len(first), np.int64)
    renumber[by_first] = np.arange(len(first))
    return renumber[found.reshape(-1)], first[by_first]


def json_texts(values) -> tuple[np.ndarray, list[bytes]]:
    """(codes, JSON texts) of a column of str or None, for Rows.table."""
    found, distinct = codes(values)
    return found, [json_value(v) for v in distinct]


def json_value(value) -> bytes:
    """A str or None as JSON text."""
    return b"null" if value is None else json.dumps(value).encode()


_HASH_BITS = 16
_HASH_MIX = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F], np.uint64)


def _slots(words: np.ndarray) -> np.ndarray:
    """A slot of 2**16 per row of 8-byte words, by a multiplicative hash."""
    mixed = np.zeros(len(words), np.uint64)
    for k, column in enumerate(words.T):
        mixed ^= column * _HASH_MIX[k % 2]
        mixed = mixed << np.uint64(29) | mixed >> np.uint64(35)
    return ((mixed * _HASH_MIX[0]) >> np.uint64(64 - _HASH_BITS)).astype(np.intp)


def _firsts(words: np.ndarray, slot: np.ndarray | None = None) -> np.ndarray | None:
    """The first row of each distinct row of `words` (n rows of 8-byte
    words), in row order, without sorting them: each slot of a hash table
    keeps the first row that hashed there, and every row is checked equal
    to its slot's. None where two distinct rows share a slot."""
    n = len(words)
    slot = _slots(words) if slot is None else slot
    first = np.full(1 << _HASH_BITS, n, np.intp)
    np.minimum.at(first, slot, np.arange(n))
    same = first[slot]
    if not (words[same] == words).all():
        return None
    return np.flatnonzero(same == np.arange(n))


def strings(values: np.ndarray) -> tuple[np.ndarray, list]:
    """(codes, distinct values) of a byte-string column, for Rows.table.
    Strings of whole 8-byte words are hashed as integers into a table of
    2**16 slots, without sorting (_firsts); where two distinct strings
    share a slot, they are told apart word by word as integers, several
    times faster than sorting them as strings."""
    if values.dtype.kind != "S" or values.dtype.itemsize % 8 or not len(values):
        distinct, found = np.unique(values, return_inverse=True)
        return found.reshape(-1), distinct.tolist()
    words = np.ascontiguousarray(values).view(np.uint64).reshape(len(values), -1)
    found, firsts = _distinct_words(words)
    return found, values[firsts].tolist()


# Rows built at once: memory follows the batch, not the step. A replay step
# of the soak's mix holds 17 000 run-queue events and 5 600 GPU/NPU calls:
# at 2**14 each was two batches, the second small and as dear to set up.
BATCH = 1 << 15


@dataclass
class Lines:
    """Rows' bytes one after another (row i ends at ends[i]): what is merged
    among other rows a run of rows at a time, not a bytes object a row."""
    data: bytes
    ends: np.ndarray

    def __len__(self) -> int:
        return len(self.ends)

    def starts_of(self, rows: np.ndarray) -> np.ndarray:
        """Where each of `rows` (indices) begins."""
        return np.where(rows > 0, self.ends[np.maximum(rows - 1, 0)], 0)


NO_LINES = Lines(b"", np.zeros(0, np.int64))


def lines(rows: Rows) -> Lines:
    return Lines(rows.bytes(), np.cumsum(rows.lengths()))


def write_merged(out, make_rows, records: np.ndarray, keys: np.ndarray, others: Lines,
                 other_keys: np.ndarray, batch: int = BATCH) -> None:
    """The rows of `records` (keys ascending), made `batch` at a time by
    `make_rows` so that memory stays small, merged with `others` by key."""
    n, done = len(records), 0
    for lo in range(0, n, batch):
        hi = min(n, lo + batch)
        cut = len(others) if hi == n else max(done, int(np.searchsorted(other_keys, keys[hi])))
        interleave(out, lines(make_rows(records[lo:hi])), keys[lo:hi], others, other_keys,
                   done, cut)
        done = cut


def device_lines(make_rows, device, out=None) -> Lines:
    """`make_rows` over the device rows a batch at a time: written to `out`
    when given (then NO_LINES is returned), else returned as Lines."""
    blobs, lengths = [], []
    for part in device.batches(BATCH // 4):
        rows = make_rows(part)
        if out is not None:
            out.write(rows.bytes())
        else:
            blobs.append(rows.bytes())
            lengths.append(rows.lengths())
    if out is not None or not blobs:
        return NO_LINES
    return Lines(b"".join(blobs), np.cumsum(np.concatenate(lengths)))


def interleave(out, mine: Lines, keys: np.ndarray, others: Lines, other_keys: np.ndarray,
               first: int = 0, last: int | None = None) -> None:
    """Write the rows `mine` (keys ascending) and the rows first..last of
    `others` (keys ascending) merged by key, `mine` first on ties: each run
    of rows of one side that falls between two rows of the other is
    written as one slice."""
    last = len(others) if last is None else last
    if last <= first:
        out.write(mine.data)
        return
    at = np.searchsorted(keys, other_keys[first:last], side="right")
    group = np.flatnonzero(np.diff(at)) + 1             # where a run of other rows begins
    begins = np.concatenate([[0], group])
    ends = np.concatenate([group, [len(at)]])
    view, other_view = memoryview(mine.data), memoryview(others.data)
    done = 0
    for pos, lo, hi in zip(mine.starts_of(at[begins]).tolist(),
                           others.starts_of(first + begins).tolist(),
                           others.ends[first + ends - 1].tolist()):
        if pos > done:
            out.write(view[done:pos])
            done = pos
        out.write(other_view[lo:hi])
    out.write(view[done:])
