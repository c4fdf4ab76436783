"""The step plan of an engine on a mesh across processes (kivi_jax.distributed): what process 0's
scheduler decided a step does, as the device operations that carry it out, sent to every other
process so that all of them dispatch the same programs in the same order.

A plan is a list of operations, each an `Op` and its host arguments (ints, numpy arrays of
int32 / float32 / uint32 / bool, None), in the order the scheduler made them. It travels as
int32 words: per operation [op, fields, then each field: INT value | NONE | ARRAY dtype ndim
*shape *data | TABLE rows (row *its M entries)...]. A TABLE is the page table [S, M] the
operation reads, sent as the rows that changed since the previous plan's last table (both
ends keep it), so a step that allocates a few pages sends a few rows. The words go out in
buffers of a fixed shape, int32 [PLAN_WORDS] = [payload length, more follows, payload...],
through `multihost_utils.broadcast_one_to_all` (a psum over every device, behind the programs
already dispatched): one buffer a step unless its prompts and tables exceed it.
"""

from __future__ import annotations

import enum

import numpy as np
from jax.experimental import multihost_utils

PLAN_WORDS = 1 << 13  # int32 words of one broadcast buffer (32 kB)


class Op(enum.IntEnum):
    """The engine's device operations (Engine._op_<name>), with their arguments."""

    RESET = 0  # slot
    SAVE = 1  # table, slot, key: a preempted row to host memory
    RESTORE = 2  # table, slot, key
    DROP = 3  # key: a preempted row's host copy dropped
    PREFILL = 4  # tokens [N, W], lengths [N]
    NEW_ROW = 5  # (a long prompt's empty one-row state)
    PREFIX_ROW = 6  # pages [1, M], tokens
    CHUNK = 7  # tokens [R, C], offset, count [R], following [R, C] or None
    INSERT = 8  # table, source, slot, prompt, limit, stops, sampled, *RowSampling's arrays
    DECODE = 9  # table, sampled, extras, rows
    READ = 10  # n: the n oldest device results read back (every process)
    STOP = 11  # process 0's engine stopped: the others return


TABLE_OPS = (Op.SAVE, Op.RESTORE, Op.INSERT, Op.DECODE)  # field 0 is the page table
_INT, _NONE, _ARRAY, _TABLE = range(4)
_DTYPES = [np.dtype(np.int32), np.dtype(np.float32), np.dtype(np.uint32), np.dtype(bool)]


class Codec:
    """Plans to int32 words and back; each end keeps the last page table [S, M] it sent or
    received (zeros before the first)."""

    def __init__(self, table_shape: tuple[int, int]):
        self.table = np.zeros(table_shape, np.int32)

    def encode(self, ops: list[tuple]) -> list[int]:
        words: list[int] = []
        for op, *fields in ops:
            words += [int(op), len(fields)]
            for i, x in enumerate(fields):
                if i == 0 and op in TABLE_OPS:
                    words += self._table_words(x)
                elif x is None:
                    words.append(_NONE)
                elif isinstance(x, np.ndarray):
                    if x.dtype not in _DTYPES:
                        raise TypeError(f"{op.name}: a plan holds no {x.dtype} array")
                    data = x.astype(np.int32) if x.dtype == bool else x
                    words += [_ARRAY, _DTYPES.index(x.dtype), x.ndim, *x.shape]
                    words += np.ascontiguousarray(data).view(np.int32).ravel().tolist()
                else:
                    words += [_INT, int(x)]
        return words

    def _table_words(self, table: np.ndarray) -> list[int]:
        changed = np.flatnonzero((table != self.table).any(axis=1))
        words = [_TABLE, len(changed)]
        for r in changed:
            words += [int(r), *table[r].tolist()]
        self.table = table.copy()
        return words

    def decode(self, words: np.ndarray) -> list[tuple]:
        ops, at = [], 0
        while at < len(words):
            op, n, fields = Op(int(words[at])), int(words[at + 1]), []
            at += 2
            for _ in range(n):
                kind = int(words[at])
                if kind == _INT:
                    fields.append(int(words[at + 1]))
                    at += 2
                elif kind == _NONE:
                    fields.append(None)
                    at += 1
                elif kind == _ARRAY:
                    dtype, ndim = _DTYPES[int(words[at + 1])], int(words[at + 2])
                    shape = tuple(int(s) for s in words[at + 3 : at + 3 + ndim])
                    at += 3 + ndim
                    size = int(np.prod(shape))
                    data = words[at : at + size].astype(np.int32)
                    x = data.astype(bool) if dtype.kind == "b" else data.view(dtype)
                    fields.append(x.reshape(shape))
                    at += size
                else:  # _TABLE
                    rows, at = int(words[at + 1]), at + 2
                    M = self.table.shape[1]
                    for _ in range(rows):
                        self.table[int(words[at])] = words[at + 1 : at + 1 + M]
                        at += 1 + M
                    fields.append(self.table.copy())
            ops.append((op, *fields))
        return ops


def send(words: list[int]) -> None:
    """(Process 0.) The plan's words to every process, PLAN_WORDS at a time."""
    room = PLAN_WORDS - 2
    for start in range(0, max(len(words), 1), room):
        part = words[start : start + room]
        buffer = np.zeros(PLAN_WORDS, np.int32)
        buffer[:2] = len(part), start + room < len(words)
        buffer[2 : 2 + len(part)] = part
        multihost_utils.broadcast_one_to_all(buffer)


def receive() -> np.ndarray:
    """(Every other process.) The next plan's words, as process 0 sent them."""
    parts = []
    while True:
        buffer = multihost_utils.broadcast_one_to_all(np.zeros(PLAN_WORDS, np.int32))
        parts.append(buffer[2 : 2 + buffer[0]])
        if not buffer[1]:
            return np.concatenate(parts)
