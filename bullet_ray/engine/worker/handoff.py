"""The direct prefill -> decode hand-off (`handoff: direct`): a prefilled sequence goes from the prefill worker to
the decode worker over a Unix socket of their own, not through the engine front.

With `handoff: front` (the default) a prefilled sequence rides in the prefill worker's `StepOutputs` to the front,
whose receive thread (beside the Serve replica's event loop, under one GIL) relabels it and sends it on to decode:
two pickles and two socket hops, and a wait for the front's thread. With `direct` the prefill worker sends a
`Handoff` straight to the decode worker and then tells the front which ids it handed (`StepOutputs.handed_direct`),
so that aborts go to where the sequence now is.

How the pair connects: the decode worker listens on `<runtime dir>/handoff.sock` (`HandoffInbox`, the engine's
authkey) and names it in its Ready info; the front then sends the prefill worker `ConnectHandoff`, and the prefill
worker connects (`HandoffOutbox`). Until then, and after a failed send, hand-offs take the front's way.

Order: the prefill worker sends its message to the front (the first tokens, `handed_direct`) before the hand-offs,
and the front reads every waiting prefill message before a decode message, so a request's second token (from
decode) never reaches the client before its first (from prefill). The price: a hand-off also waits for that send.

Aborts: the front sends an abort to where it last knew the request to be. An abort can reach the decode worker
before the hand-off it concerns (two sockets, no order between them), so with `direct` the decode worker
remembers the ids it was asked to abort and did not hold (`AbortTombstones`) and drops a hand-off of one of them on
arrival, freeing its blocks. A tombstone lasts `TOMBSTONE_HOLD_S`, less than the front refuses a finished id for
reuse (`RETIRED_ID_HOLD_S`), so it never meets a new request of the same id; a hand-off held up longer than that
after its abort (a decode loop stalled for seconds) would run to its end unwatched, its blocks then freed.

Both ways time each hand-off from the prefill worker's step message (`StepOutputs.sent_s`, stamped as its tokens
are sent) to the decode worker taking it: the decode worker reports them to the front
(`StepOutputs.handoff_hops_s`: the `bullet_handoff_seconds` metric) and into its step log (`handoff` records).
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing
import os
import socket
import threading
from multiprocessing import Pipe
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

from bullet_ray.engine.expiring_ids import ExpiringIds

logger = logging.getLogger(__name__)

SOCKET_NAME = "handoff.sock"
# how long the decode worker remembers an abort of a sequence it did not hold: a hand-off in transit arrives within
# a decode step; below the front's RETIRED_ID_HOLD_S (5 s, tests/unit/test_handoff.py checks it), after which a
# finished id may be submitted again
TOMBSTONE_HOLD_S = 2.0
MAX_TOMBSTONES = 4096


class HandoffInbox:
    """The decode worker's end: a listener that accepts the prefill worker's one connection in a thread."""

    def __init__(self, runtime_dir: str, authkey: bytes) -> None:
        self.address = os.path.join(runtime_dir, SOCKET_NAME)
        self._listener = Listener(self.address, family="AF_UNIX", authkey=authkey)
        self._conn: Connection | None = None
        self._closed = False
        self._lock = threading.Lock()  # the accept thread's taking of the connection against close()
        # the accept thread's word that the prefill worker connected: the worker waits on it meanwhile, so a wait
        # begun before the connection wakes up for it (and the first hand-offs) at once
        self._connected_r, self._connected_w = Pipe(duplex=False)
        self._thread = threading.Thread(target=self._accept, name="bullet-handoff-accept", daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        """Until the prefill worker has connected: a client that fails the key (or drops mid-handshake) is
        turned away and the next one awaited."""
        while not self._closed:
            try:
                conn = self._listener.accept()
            except (OSError, EOFError, multiprocessing.AuthenticationError) as e:
                if self._closed:
                    return  # closed before the prefill worker connected
                logger.warning("hand-off listener: a client was turned away: %s", e)
                continue
            with self._lock:
                if self._closed:  # closed while the prefill worker's handshake ran
                    conn.close()
                    return
                self._conn = conn
                self._listener.close()  # one peer: the socket file goes
                self._connected_w.send(True)
                self._connected_w.close()
            return

    def connections(self) -> list[Connection]:
        """What the worker waits on besides the front: the prefill worker's connection once it has connected,
        the accept thread's word of it until then (nothing once closed, or after the prefill worker went away)."""
        if self._closed:
            return []
        if self._conn is not None:
            return [self._conn]
        return [] if self._connected_r.closed else [self._connected_r]

    def receive(self, conn: Connection) -> Any:
        """The next message on `conn`; None when there is nothing to dispatch: the word that the prefill worker
        connected, or the prefill worker went away (the front sees that too: its own connection to the prefill
        worker ends, and it marks the engine dead)."""
        if conn is self._connected_r:  # read once: from now on the prefill worker's connection is waited on
            with contextlib.suppress(EOFError, OSError):
                conn.recv()
            conn.close()
            return None
        try:
            return conn.recv()
        except (EOFError, OSError):
            logger.info("decode worker: the prefill worker's hand-off connection closed (it stopped)")
            conn.close()
            self._conn = None
            return None

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._conn is not None:
                self._conn.close()
                self._conn = None
        if self._thread.is_alive():  # wake an accept() still waiting: its handshake fails, it sees `_closed`
            with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as poke:
                poke.connect(self.address)
        with contextlib.suppress(OSError):
            self._listener.close()
        self._thread.join(1.0)
        self._connected_r.close()
        self._connected_w.close()


class HandoffOutbox:
    """The prefill worker's end: `send` returns False (the caller then sends by the front) until connected, or
    once a send failed."""

    def __init__(self) -> None:
        self._conn: Connection | None = None

    @property
    def is_connected(self) -> bool:
        return self._conn is not None

    def connect(self, address: str, authkey: bytes) -> None:
        try:
            self._conn = Client(address, family="AF_UNIX", authkey=authkey)
        except (OSError, EOFError, multiprocessing.AuthenticationError) as e:  # hand-offs keep going by the front
            logger.warning("prefill worker: cannot connect to the decode worker's hand-off socket %s: %s", address, e)

    def send(self, msg: Any) -> bool:
        if self._conn is None:
            return False
        try:
            self._conn.send(msg)
            return True
        except (OSError, EOFError) as e:
            logger.warning("prefill worker: direct hand-off failed (%s); hand-offs go through the front", e)
            self.close()
            return False

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None


class AbortTombstones(ExpiringIds):
    """Request ids the decode worker was asked to abort while it did not hold them, for `TOMBSTONE_HOLD_S`: a
    hand-off of one of them that arrives later is dropped (`take`: whether it was aborted before its hand-off
    arrived, forgotten once asked)."""

    def __init__(self, hold_s: float = TOMBSTONE_HOLD_S) -> None:
        super().__init__(hold_s, MAX_TOMBSTONES)
