"""The HTTP server's life: uvicorn with a timeout on request headers, and a graceful stop on SIGTERM / SIGINT.

At the signal the listening socket closes, idle connections close, and the requests in flight get
`shutdown_timeout` seconds to finish; then the server aborts the rest (`OpenAIServer.abort_in_flight`: a 503 error
as JSON or as an SSE error event, one log line each), waits for those answers to go out, and the process exits 0.
"""

from __future__ import annotations

import asyncio
import logging
import signal

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("kestrel.serve")

ANSWER_SECONDS = 10.0       # after aborting, how long the aborted requests' error answers may take to go out


def header_timeout_protocol(seconds: float) -> type:
    """uvicorn's h11 protocol, closing a connection whose next request's headers have not all arrived `seconds`
    after it opened or after its last response (uvicorn itself waits for headers forever)."""

    class HeaderTimeoutH11(H11Protocol):
        _timer: asyncio.TimerHandle | None = None
        _cycle_before = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            self._disarm_if_started()

        def on_response_complete(self) -> None:
            self._arm()
            super().on_response_complete()
            self._disarm_if_started()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._disarm()
            self._cycle_before = self.cycle
            self._timer = self.loop.call_later(seconds, self._expired)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _disarm_if_started(self) -> None:
            if self._timer is not None and self.cycle is not self._cycle_before:
                self._disarm()          # a new request's headers are complete

        def _expired(self) -> None:
            self._timer = None
            if not self.transport.is_closing():
                client = "%s:%d" % self.client[:2] if self.client else "a client"
                log.info("closed the connection of %s: no complete request headers within %g s (--header-timeout)",
                         client, seconds)
                self.transport.close()

    return HeaderTimeoutH11


class GracefulServer(uvicorn.Server):
    """uvicorn's server, with the shutdown described in the module docstring."""

    def __init__(self, config: uvicorn.Config, api, shutdown_timeout: float):
        config.timeout_graceful_shutdown = shutdown_timeout + ANSWER_SECONDS
        super().__init__(config)
        self.api, self.shutdown_timeout = api, shutdown_timeout

    def handle_exit(self, sig: int, frame) -> None:
        # uvicorn records the signal and raises it again once stopped, so the process would die of it; a graceful
        # stop is a normal exit (status 0). A second Ctrl-C still forces the exit.
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        else:
            self.should_exit = True

    async def shutdown(self, sockets=None) -> None:
        self.api.draining = True
        running = len(self.api._in_flight)
        if running:
            log.info("shutting down: %d request(s) in flight get %g s to finish (--shutdown-timeout)", running,
                     self.shutdown_timeout)
        deadline = asyncio.create_task(self._abort_after_grace())
        try:
            await super().shutdown(sockets)
        finally:
            deadline.cancel()

    async def _abort_after_grace(self) -> None:
        await asyncio.sleep(self.shutdown_timeout)
        await self.api.abort_in_flight(self.shutdown_timeout)
