"""``rollout-service serve``: SGLang and its sidecar as one supervised unit.

The counterpart of ``trl vllm-serve``. SGLang runs as a child process group; a
supervisor thread restarts it when it dies (with exponential back-off, up to a
limit) and the sidecar, seeing the server come back with its base weights,
re-applies the newest checkpoint before reporting ready again. Ctrl-C or
SIGTERM stops the sidecar and the whole SGLang process group.
"""

from __future__ import annotations

import logging
import signal
import threading
from dataclasses import dataclass, field

from .sglang_launcher import SGLangServer, SGLangStartError
from .sidecar.settings import SidecarSettings

log = logging.getLogger(__name__)


@dataclass
class RestartPolicy:
    """How a crashed SGLang server is brought back."""

    max_restarts: int = 5
    backoff_s: float = 2.0
    max_backoff_s: float = 60.0
    startup_timeout_s: float = 600.0
    restarts: int = field(default=0, init=False)


class Supervisor(threading.Thread):
    """Watches the SGLang process and restarts it; calls ``on_restart`` after each restart."""

    def __init__(self, server: SGLangServer, policy: RestartPolicy, on_restart, on_give_up):
        super().__init__(name="sglang-supervisor", daemon=True)
        self.server = server
        self.policy = policy
        self._on_restart = on_restart
        self._on_give_up = on_give_up
        self._stop = threading.Event()

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        backoff = self.policy.backoff_s
        while not self._stop.wait(1.0):
            if self.server.is_running():
                continue
            if self.policy.restarts >= self.policy.max_restarts:
                log.error("SGLang exited and the restart limit (%d) is reached; stopping. Log tail:\n%s",
                          self.policy.max_restarts, self.server.log_tail(40))
                self._on_give_up()
                return
            self.policy.restarts += 1
            log.warning("SGLang exited; restart %d of %d in %.0f s", self.policy.restarts,
                        self.policy.max_restarts, backoff)
            if self._stop.wait(backoff):
                return
            backoff = min(backoff * 2, self.policy.max_backoff_s)
            try:
                self.server.restart()
                self.server.wait_healthy(self.policy.startup_timeout_s)
            except SGLangStartError as exc:
                log.error("SGLang restart failed: %s", exc)
                continue
            backoff = self.policy.backoff_s
            log.info("SGLang is back at %s; the sidecar re-applies the newest checkpoint", self.server.url)
            self._on_restart()


def run_serve(server: SGLangServer, settings: SidecarSettings, policy: RestartPolicy) -> int:
    """Start SGLang, then the sidecar in the foreground; return the exit code."""
    import uvicorn

    from .sidecar.app import create_app

    exit_code = 0
    log.info("starting SGLang on %s (log: %s)", server.url, server.log_path)
    server.start()
    try:
        server.wait_healthy(policy.startup_timeout_s)
        app = create_app(settings)
        config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level="info")
        http = uvicorn.Server(config)

        def give_up() -> None:
            nonlocal exit_code
            exit_code = 3
            http.should_exit = True

        supervisor = Supervisor(server, policy,
                                on_restart=lambda: app.state.controller.notify("restart"),
                                on_give_up=give_up)
        supervisor.start()
        log.info("sidecar on http://%s:%d (readiness: /readyz)", settings.host, settings.port)
        # uvicorn re-raises the signal that stopped it once it has shut down; with these
        # handlers installed that lands here instead of killing us before SGLang is stopped.
        previous = {sig: signal.signal(sig, _note_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            http.run()
        finally:
            supervisor.stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    except SGLangStartError as exc:
        log.error("%s", exc)
        exit_code = 2
    finally:
        server.stop()
    return exit_code


def _note_signal(signum, frame) -> None:
    log.info("received %s; stopping SGLang and the sidecar", signal.Signals(signum).name)
