"""py-libp2p's own log records, kept out of a user's terminal.

py-libp2p logs expected network events at ERROR level: every dial to a peer that has left prints
"Failed to open TCP stream: all attempts to connect to 127.0.0.1:NNNNN failed", dozens of lines at the
end of a local run. Its records are demoted to DEBUG, so they show only with --verbose. (No libp2p import
here: the CLI sets up logging before it knows whether it will start a host.)
"""

from __future__ import annotations

import logging


class DemoteLibp2p(logging.Filter):
    """A handler filter: records of the `libp2p` loggers become DEBUG records, kept only at DEBUG level."""

    def __init__(self, keep_debug: bool) -> None:
        super().__init__()
        self.keep_debug = keep_debug

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "libp2p" or record.name.startswith("libp2p."):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return self.keep_debug
        return True
