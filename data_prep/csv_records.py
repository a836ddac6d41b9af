"""CSV files with a header row, read as ``setdiff-prep`` and ``setdiff-tasks`` read them.

Python's :class:`csv.DictReader`, with two differences: each record comes with the line it
starts on (a quoted field may hold newlines, so records and lines differ), and a quoted field
whose quote never closes is an error naming the file and the line where that quote opened.
Python's reader, unless strict, takes everything after such a quote, to the end of the file, as
that one field: the rest of the file silently becomes one giant record. (A strict reader would
also refuse files that the lenient one reads as their writers meant, such as text right after
a closing quote; those keep being read.)
"""

from __future__ import annotations

import csv
from typing import Iterable, Iterator, Optional


class _Lines:
    """The lines handed to the csv reader, counted, kept until the record they belong to is
    complete, and whether they ran out (the reader asked for another after the last)."""

    def __init__(self, lines: Iterable[str]):
        self._it = iter(lines)
        self.count = 0          # lines handed out
        self.held: list = []    # the lines since the end of the last complete record
        self.ran_out = False

    def __iter__(self):
        return self

    def __next__(self) -> str:
        try:
            line = next(self._it)
        except StopIteration:
            self.ran_out = True
            raise
        self.count += 1
        self.held.append(line)
        return line


class CsvRecords:
    """``(line, record)`` for each row of a CSV file with a header (``lines``: its text as an
    iterable of lines, e.g. a file opened with ``newline=""``); ``line``: where the record
    starts, counted from 1. ``fieldnames``: the header's columns. A quote that never closes, or
    a file the csv reader cannot parse, raises ``error(message)`` naming ``path`` and the
    line."""

    def __init__(self, path: str, lines: Iterable[str], error=ValueError):
        self.path, self._error = path, error
        self._lines = _Lines(lines)
        self._reader = csv.DictReader(self._lines)
        self._first = 1  # the line the next record starts on (before skipping blank lines)

    @property
    def fieldnames(self) -> Optional[list]:
        return self._read(lambda: self._reader.fieldnames)

    def __iter__(self) -> Iterator[tuple[int, dict]]:
        if self.fieldnames is None:  # (the header first: its lines are no record's)
            return
        while True:
            rec = self._read(lambda: next(self._reader, None))
            if rec is None:
                return
            yield self._start, rec

    def _read(self, step):
        """``step()`` (a read of the header or of a record), then the record's first line and
        the check that its quotes closed."""
        try:
            out = step()
        except csv.Error as exc:
            raise self._error(f"{self.path} line {self._lines.count}: not readable as CSV "
                              f"({exc})") from None
        held, first = self._lines.held, self._first
        # the lines a record read: blank lines before it are skipped (by the reader too)
        skip = 0
        while skip < len(held) - 1 and held[skip] in ("\n", "\r\n", "\r"):
            skip += 1
        self._start = first + skip
        if self._lines.ran_out and any(line.strip() for line in held) and out is not None:
            opened = _quote_left_open(held[skip:], self._start)
            rest = self._lines.count - opened + 1
            raise self._error(
                f"{self.path} line {opened}: a quoted field opens here and its quote never "
                f"closes, so the rest of the file ({rest} line{'s' if rest != 1 else ''}) would "
                "be one field: close the quote (a quote inside a quoted field is written "
                'twice: "")')
        self._first = self._lines.count + 1
        self._lines.held = []
        return out


def _quote_left_open(lines: list, first: int) -> int:
    """The line (counted from ``first``) of the quote that opened the field still open at the
    end of ``lines``: the csv reader's own states for its default dialect (``,`` between
    fields, ``"`` around them, doubled inside)."""
    state, opened = "start", first
    for number, line in enumerate(lines, first):
        for c in line:
            if state == "quoted":
                if c == '"':
                    state = "quote"  # the end of the field, or the first of a doubled quote
            elif state == "quote":
                state = "quoted" if c == '"' else "start" if c == "," else "field"
            elif c == '"' and state == "start":
                state, opened = "quoted", number
            elif c in ",\r\n":
                state = "start"
            else:
                state = "field"
    return opened
