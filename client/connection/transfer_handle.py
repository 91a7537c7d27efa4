"""A STORE or LOAD in flight, waited on layer by layer through the session's completion block.

The daemon reports each transfer in one slot of the completion block (shared memory): a sequence
number, the layers done so far, and a status. The handle reads that slot; it never talks to the
daemon itself. What it needs from the connection that started it (the timeouts, whether the
daemon still lives, and what to do with the slot when the transfer ends or is abandoned) is the
small :class:`TransferOwner` protocol, so this module does not import the connection.
"""

from __future__ import annotations

import logging
import operator
import time
from typing import Any, Protocol

from kvtier.config import ClientConfig
from kvtier.ipc.completion import (
    CompletionBlock,
    CompletionTimeout,
    TransferStatus,
    check_timeout,
)

log = logging.getLogger("kvtier.client")

UNTIL_ENDED_POLL_S = 0.01
"""How often :meth:`TransferHandle.until_ended` looks at a failed transfer still copied."""

__all__ = ["TransferHandle", "TransferOwner"]


class TransferOwner(Protocol):
    """What a :class:`TransferHandle` needs from the connection that started it.

    :class:`~kvtier.client.connection.connection.Connection` implements it; the two underscored
    methods are hooks for handles only, not for engine code.
    """

    config: ClientConfig
    """The client settings (``load_timeout_s`` bounds each wait)."""

    def daemon_alive(self) -> bool:
        """False when the daemon's process is known to be gone."""
        ...

    def serving(self) -> bool:
        """False once the connection is closing or its daemon is known to be gone (waits
        then stop early)."""
        ...

    def _abandon(self, handle: TransferHandle) -> None:
        """A wait for ``handle`` timed out: cancel it in the daemon; its slot waits in limbo."""
        ...

    def _slot_done(
        self, block: CompletionBlock | None, slot: int, seq: int, status: TransferStatus
    ) -> None:
        """The transfer ``seq`` in ``slot`` of ``block`` ended with ``status``: the slot may
        be reused (unless ``seq`` no longer owns it: a transfer of an earlier
        registration). Called without waiting for the connection's lock."""
        ...


class LayerEvents(Protocol):
    """A CUDA session's events in the engine
    (:class:`~kvtier.client.connection.cuda_wait.CudaLayerWaiter`)."""

    @property
    def closed(self) -> bool:
        """The events were dropped (their registration is over)."""
        ...

    def wait_if_open(self, layer: int, stream: Any = None) -> bool:
        """Make the current stream wait for layer ``layer``'s copies; False (no wait) when
        the events were dropped."""
        ...


class TransferHandle:
    """A STORE or LOAD in flight.

    Made by :meth:`Connection.store <kvtier.client.connection.connection.Connection.store>` and
    :meth:`~kvtier.client.connection.connection.Connection.load`; a handle without an owner
    (``conn`` None) is one that never ran: a miss, a dropped store, or nothing to copy.

    On a GPU (``cuda``: the session's events) a layer is "in place" once the engine's
    current stream waits for its copies; a handle whose events were dropped (the daemon died
    or the connection re-registered) reports a miss, and never waits on them.

    Attributes:
        count: for a load, the leading pages being loaded (0: a miss, nothing runs); for a
            store, the leading keys now in L2 or being written (the rest were dropped).
        writing: pages actually being copied (0: nothing to wait for).
    """

    __slots__ = (
        "_block",
        "_conn",
        "_cuda",
        "_layers_ok",
        "_status",
        "count",
        "num_layers",
        "seq",
        "slot",
        "writing",
    )

    def __init__(
        self,
        conn: TransferOwner | None,
        block: CompletionBlock | None,
        slot: int,
        seq: int,
        count: int,
        writing: int,
        num_layers: int,
        cuda: LayerEvents | None = None,
    ) -> None:
        self._conn = conn
        self._cuda = cuda
        self._block = block
        self.slot = slot
        self.seq = seq
        self.count = count
        self.writing = writing
        self.num_layers = num_layers
        self._status: TransferStatus | None = None if writing else TransferStatus.DONE
        self._layers_ok = num_layers if not writing else 0

    @property
    def block(self) -> CompletionBlock | None:
        """The completion block this transfer reports in (its registration's); None for a
        handle that never ran."""
        return self._block

    @property
    def done(self) -> bool:
        """True once the transfer has ended (whatever the outcome)."""
        return self._status is not None

    @property
    def ok(self) -> bool:
        """True when every layer completed."""
        return self._status is TransferStatus.DONE

    def wait_layer(self, layer: int, timeout: float | None = None) -> bool:
        """Block until layer ``layer`` of this transfer is in place.

        Args:
            layer: a layer index, ``0 <= layer < num_layers``.
            timeout: the longest wait in seconds (default ``load_timeout_s``).

        Returns:
            True when it is; False when the transfer failed, was cancelled or timed out
            (the engine must then treat the whole transfer as a miss and recompute).

        Raises:
            IndexError / TypeError: ``layer`` is not a layer index of this transfer.
            ValueError: ``timeout`` is not a finite number of seconds, 0 or more.
        """
        layer = self._layer_index(layer)
        if timeout is not None:
            check_timeout(timeout)
        if self._layers_ok > layer:
            return True
        if self._status is not None:
            return self._status is TransferStatus.DONE
        assert self._conn is not None and self._block is not None
        conn = self._conn
        try:
            st = self._block.wait(
                self.slot,
                self.seq,
                layer + 1,
                conn.config.load_timeout_s if timeout is None else timeout,
                alive=self._alive,
            )
        except CompletionTimeout:
            st = TransferStatus.FAILED
            conn._abandon(self)
        except (TypeError, ValueError):  # the block was closed under us (re-registration)
            st = TransferStatus.FAILED
        if st is TransferStatus.RUNNING:
            if self._cuda is not None and not self._stream_wait(layer):
                return False
            self._layers_ok = layer + 1
            return True
        self._end(st)  # DONE: the daemon saw every copy finish on the GPU, nothing to wait for
        return st is TransferStatus.DONE

    def _alive(self) -> bool:
        """Whether a wait on this transfer's slot may go on: its connection serves, and no
        re-registration closed the block (its daemon gone, whose successor never writes
        it: a daemon in another pid namespace is not watched by its pid)."""
        block, conn = self._block, self._conn
        return block is not None and not block.closed and conn is not None and conn.serving()

    def _layer_index(self, layer: object) -> int:
        """``layer`` as an index in ``[0, num_layers)``, else IndexError / TypeError naming
        it (nothing waited on or changed: a load that copied every page stays good)."""
        if isinstance(layer, bool):
            raise TypeError(f"layer = {layer!r}: must be an integer layer index")
        try:
            i = operator.index(layer)  # type: ignore[arg-type]
        except TypeError:
            raise TypeError(f"layer = {layer!r}: must be an integer layer index") from None
        if not 0 <= i < self.num_layers:
            raise IndexError(f"layer = {i}: this transfer has layers 0 to {self.num_layers - 1}")
        return int(i)

    def _stream_wait(self, layer: int) -> bool:
        """The current stream waits for layer ``layer``'s event, unless its daemon is gone."""
        assert self._cuda is not None and self._conn is not None
        if self._cuda.closed or not self._conn.daemon_alive() or not self._cuda.wait_if_open(layer):
            self._end(TransferStatus.FAILED)  # its events are gone: a miss, never a wait
            return False
        return True

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the whole transfer ends; True when it succeeded.

        It has ended once the daemon has settled it: a store's pages are in L2, a load's
        pins are dropped.

        Raises:
            ValueError: ``timeout`` is not a finite number of seconds, 0 or more.
        """
        if timeout is not None:
            check_timeout(timeout)
        if (
            self._status is None
            and self.wait_layer(self.num_layers - 1, timeout)
            and self._status is None
        ):
            # all layers landed; wait for the final status (the daemon settled it)
            conn = self._conn
            assert self._block is not None and conn is not None
            try:
                st = self._block.wait(
                    self.slot,
                    self.seq,
                    self.num_layers,
                    conn.config.load_timeout_s,
                    alive=self._alive,
                    end=True,
                )
            except CompletionTimeout:  # the daemon may still hold the slot: given up on
                st = TransferStatus.FAILED
                conn._abandon(self)
            except (TypeError, ValueError):  # the block was closed under us (re-registration)
                st = TransferStatus.FAILED
            self._end(st)
        return self._status is TransferStatus.DONE

    def wait_loaded(self, timeout: float | None = None) -> bool:
        """For a LOAD: block until every layer's pages are in the engine's memory; True
        when they are (False: failed, cancelled or timed out, recompute).

        Unlike :meth:`wait` it does not wait for the daemon to settle the transfer (drop
        its pins on the host pages): the copy thread announces the last layer once the last
        byte is in place, and that settling can lag behind it when the daemon's event loop
        waits for a core. The completion slot is reused once the daemon has settled it. A
        STORE must use :meth:`wait` (its pages are in L2 only once settled).
        """
        if self._status is not None:
            return self._status is TransferStatus.DONE
        if not self.wait_layer(self.num_layers - 1, timeout):
            return False
        if self._status is None:  # every layer landed, not settled yet: the slot waits
            self._status = TransferStatus.DONE
            if self._conn is not None:
                self._conn._slot_done(self._block, self.slot, self.seq, TransferStatus.RUNNING)
        return True

    def layers_ready(self) -> int:
        """Leading layers in place now, without waiting (0 once the transfer failed)."""
        if self._status is not None:
            return self.num_layers if self._status is TransferStatus.DONE else 0
        if self._block is None:
            return self._layers_ok
        try:
            seq, layers, status = self._block.read(self.slot)
        except (TypeError, ValueError, AttributeError):  # the block was closed: re-registered
            return self._layers_ok
        if seq != self.seq or status not in (TransferStatus.RUNNING, TransferStatus.DONE):
            return self._layers_ok
        return max(self._layers_ok, min(layers, self.num_layers))

    def copying(self) -> bool:
        """Whether the daemon may still be copying this transfer's pages: it has not
        reported an end in the slot, and its process lives. A transfer whose wait failed
        or timed out keeps its engine pages out of use until this returns False."""
        if self._conn is None or self._block is None or self.slot < 0:
            return False
        if not self._conn.daemon_alive():
            return False
        try:
            seq, _, status = self._block.read(self.slot)
        except (TypeError, ValueError, AttributeError):  # the block was closed: re-registered
            return False
        return seq == self.seq and status == TransferStatus.RUNNING

    def until_ended(self, what: str = "") -> None:
        """Return once kvtierd can no longer copy this transfer's pages: call it after a
        wait that failed, before the pages are used again. An engine reuses the pages of a
        failed store and recomputes a failed load into the same pages, and a stalled
        daemon resuming its copy would store other KV under these keys, or overwrite the
        recomputed KV. Normally immediate: the daemon ends a transfer whose wait failed
        promptly; while it is still copying (stalled), this waits, logged once, until it
        ends the transfer or its process is gone.

        Args:
            what: names the transfer in the log line (a request id).
        """
        logged = False
        while self.copying():
            if not logged:
                log.warning(
                    "kvtier transfer%s failed but kvtierd is still copying it; its pages are "
                    "held until it stops",
                    f" of {what}" if what else "",
                )
                logged = True
            time.sleep(UNTIL_ENDED_POLL_S)

    def _end(self, st: TransferStatus) -> None:
        """Record the final status once and give the completion slot back to the owner."""
        if self._status is None:
            self._status = st
            if st is TransferStatus.DONE:
                self._layers_ok = self.num_layers
            if self._conn is not None:
                self._conn._slot_done(self._block, self.slot, self.seq, st)
