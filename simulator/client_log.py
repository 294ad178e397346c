"""What the simulated clients saw of every request, kept as columns.

``bench serve`` keeps a ``RequestRecord`` per request with a list of its chunks' arrival
times; a million simulated requests make 32 million list entries that way, appended one
Python call at a time. Here a request is a row of typed arrays (its lengths, send, end,
finish reason) and the token stream is one log of the whole run: for each rank step
that gave tokens, its end time and how many requests got one, and the index of each of
those requests (``stream``). Every simulated chunk is one token (a request gets one
token per engine step it is in), so a request's chunk times are the times of its
entries in that log, in order (``token_times``).

``records()`` gives the same data as ``RequestRecord``s (tests, small runs);
``simulator/metrics.py`` computes bench serve's summary from the columns.
"""

from __future__ import annotations

import math
from array import array
from dataclasses import dataclass

import numpy as np

from pdserve.bench.serve_metrics import RequestRecord

# Token owners are collected in a list (a list comprehension appends them fastest) and
# moved to the array of C ints every this many (4 bytes each there, not 8).
OWNERS_BATCH = 1 << 16


@dataclass(frozen=True)
class TokenTimes:
    """Every request's chunk arrival times, request after request: request i's are
    ``times[offsets[i]:offsets[i + 1]]``, in stream order."""

    times: np.ndarray  # float64
    offsets: np.ndarray  # int64, one more than there are requests

    @property
    def counts(self) -> np.ndarray:
        return np.diff(self.offsets)


class ClientLog:
    def __init__(self) -> None:
        self.prompt_len = array("q")
        self.expected_output_len = array("q")
        self.kind: list[str] = []
        self.scheduled_time = array("d")  # when the arrival process wanted it sent
        self.send_time = array("d")
        self.end_time = array("d")  # NaN until its stream ends
        self.finish_reason: list[str] = []
        self.error: list[str] = []
        self._step_times = array("d")  # per rank step that streamed tokens
        self._step_sizes = array("q")  # how many requests it gave one
        self._owners = array("i")  # each token's request index, in stream order
        self._recent_owners: list[int] = []  # the newest of them, not moved there yet

    def __len__(self) -> int:
        return len(self.prompt_len)

    # -- recording (the cluster) ------------------------------------------------------

    def open(self, prompt_len: int, expected_output_len: int, kind: str,
             scheduled_time: float) -> int:
        """A new request; its index (requests are numbered in the order they open)."""
        self.prompt_len.append(prompt_len)
        self.expected_output_len.append(expected_output_len)
        self.kind.append(kind)
        self.scheduled_time.append(scheduled_time)
        self.send_time.append(0.0)  # RequestRecord's default, for one never sent
        self.end_time.append(math.nan)
        self.finish_reason.append("")
        self.error.append("")
        return len(self.prompt_len) - 1

    def stream(self, now: float, seqs: list) -> None:
        """One rank step's end: each of ``seqs`` (sequences carrying ``client``, their
        request's index) got one token at ``now``."""
        if seqs:
            self._step_times.append(now)
            self._step_sizes.append(len(seqs))
            recent = self._recent_owners
            recent += [seq.client for seq in seqs]
            if len(recent) >= OWNERS_BATCH:
                self._owners.fromlist(recent)
                recent.clear()

    def end(self, index: int, reason: str, now: float) -> None:
        """The request's stream ended (``reason``: the finish reason; one that is not
        stop or length is its error too, unless it has one)."""
        self.end_time[index] = now
        self.finish_reason[index] = reason
        if reason not in ("stop", "length") and not self.error[index]:
            self.error[index] = reason

    # -- reading ----------------------------------------------------------------------

    def token_times(self) -> TokenTimes:
        self._owners.fromlist(self._recent_owners)
        self._recent_owners.clear()
        owners = np.frombuffer(self._owners, dtype=np.intc) if self._owners else \
            np.zeros(0, dtype=np.intc)
        times = np.repeat(np.frombuffer(self._step_times, dtype=np.float64),
                          np.frombuffer(self._step_sizes, dtype=np.int64)) \
            if self._step_times else np.zeros(0)
        # A stable sort keeps each request's tokens in stream (= time) order.
        times = times[np.argsort(owners, kind="stable")]
        counts = np.bincount(owners, minlength=len(self))
        offsets = np.zeros(len(self) + 1, dtype=np.int64)
        np.cumsum(counts, out=offsets[1:])
        return TokenTimes(times, offsets)

    def duration(self) -> float:
        """First send to last end (the same span ``bench serve`` reports)."""
        if not len(self):
            return 0.0
        ends = np.frombuffer(self.end_time, dtype=np.float64)
        ends = ends[~np.isnan(ends)]
        last = float(ends.max()) if ends.size else 0.0
        return last - min(self.send_time)

    def records(self) -> list[RequestRecord]:
        """Every request as bench serve's ``RequestRecord`` (lists of Python floats)."""
        tokens = self.token_times()
        times = tokens.times.tolist()
        offsets = tokens.offsets.tolist()
        return [self._record(i, times[offsets[i]:offsets[i + 1]]) for i in range(len(self))]

    def _record(self, i: int, chunk_times: list[float]) -> RequestRecord:
        end = self.end_time[i]
        return RequestRecord(
            prompt_len=self.prompt_len[i], expected_output_len=self.expected_output_len[i],
            kind=self.kind[i], send_time=self.send_time[i],
            scheduled_time=self.scheduled_time[i], chunk_times=chunk_times,
            chunk_tokens=[1] * len(chunk_times), end_time=None if math.isnan(end) else end,
            request_id=str(i), finish_reason=self.finish_reason[i], error=self.error[i])


__all__ = ["ClientLog", "TokenTimes"]
