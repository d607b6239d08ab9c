"""HTTP connections as `whetstone serve` takes them: uvicorn's h11 protocol with a deadline for a
request's headers.

uvicorn closes a kept-alive connection that stays idle (`timeout_keep_alive`), and the app bounds
the time a body takes (`ServeConfig.body_timeout_s`), but nothing bounds the headers: a client that
opens a connection and sends nothing, or trickles its headers a byte at a time, would hold one of
the `max_connections` for ever, and enough such clients would get every other one 503. Here a
request's headers must be in within `header_timeout_s` of the connection opening, or of the first
byte of the next request on a kept-alive connection; a slower request gets 408 and its connection
is closed. The rest of a body that its route answered without reading (uvicorn drops it, and each
byte of it puts off the keep-alive timeout) must come within `header_timeout_s` too, or the
connection is closed. The h11 protocol is the one uvicorn takes when `httptools` is not installed: one implementation,
whichever packages are.
"""

from __future__ import annotations

import asyncio

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol


def timed_out_response(timeout_s: float) -> bytes:
    """The 408 a request whose headers are late gets, in the app's error format (written on the
    socket by hand: the protocol can answer only a request whose headers it has)."""
    from whetstone.inference.server import error_body

    message = f"the request's headers did not arrive within {timeout_s:g} s (header_timeout_s)"
    body = bytes(error_body(408, message).body)
    head = (
        "HTTP/1.1 408 Request Timeout\r\ncontent-type: application/json\r\nconnection: close\r\n"
        f"content-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def with_header_deadline(timeout_s: float) -> type[H11Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request's headers take over `timeout_s`
    to arrive (after a 408); uvicorn.Config's `http` takes it."""
    timed_out = timed_out_response(timeout_s)

    class HeaderDeadline(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            unread = self._unread_body()
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:
                if unread:  # that body has ended: the next request's headers get time of their own
                    self._disarm()
                if self._deadline is None:  # the first bytes of a kept-alive connection's next request
                    self._arm()
            elif self._unread_body():
                if self._deadline is None:
                    self._arm()
            else:  # the headers are in (or the connection is done)
                self._disarm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._deadline = self.loop.call_later(timeout_s, self._late)

        def _disarm(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def _unread_body(self) -> bool:
            """The answer has gone out while the request's body is still coming: a route that
            answers without reading its body (/health, an unknown route, a 401). uvicorn drops
            those bytes, and each one puts off its keep-alive timeout, so a body trickled a byte
            at a time would hold the connection for ever; the rest of it gets `timeout_s`."""
            return self.conn.our_state is h11.DONE and self.conn.their_state is h11.SEND_BODY

        def _late(self) -> None:
            self._deadline = None
            if self.transport.is_closing():
                return
            if self.conn.their_state is h11.IDLE:
                self.transport.write(timed_out)
                self.transport.close()
            elif self._unread_body():  # answered already: the connection just closes
                self.transport.close()

    return HeaderDeadline
