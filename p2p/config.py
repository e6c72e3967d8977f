"""The error type and helpers shared by every component's configuration and input files."""

import tomllib
from pathlib import Path
from typing import Any

# Shares of a declared uplink a host paces everything it sends at (worker.uplink_mbit, swarm.uplink_mbit). On
# the WAN test bed (64 MiB to 6 peers at 20 Mbit/s, 2 behind NAT) peers at 90% and the learner at 100% took
# 1.13-1.16x T_min (NAT 1.17-1.20x), the learner at 90% too 1.20-1.23x (its uplink is the bound: pacing it
# below its rate lengthens every broadcast), nobody paced 1.28-1.32x (NAT 1.36-1.41x); docs/benchmarks.md.
UPLINK_PACE = 0.9
LEARNER_PACE = 1.0


def paced_bps(uplink_mbit: float, share: float = UPLINK_PACE) -> float | None:
    """Bytes/s a host with an uplink of `uplink_mbit` Mbit/s paces its sends at; None for 0 (unpaced)."""
    return uplink_mbit * share * 1e6 / 8 or None


def check_uplink(uplink_mbit: float, key: str) -> None:
    require(uplink_mbit == 0 or 0.1 <= uplink_mbit <= 100_000, key,
            f"must be 0 (unpaced) or 0.1 to 100000 Mbit/s, got {uplink_mbit}")  # fmt: skip


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key and what is allowed."""


def require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")


def read_toml(path: str | Path, what: str) -> dict[str, Any]:
    """A TOML file as a dict; a missing or malformed file is a ConfigError naming `what` it was for."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"{what} {str(path)!r} does not exist")
    try:
        return tomllib.loads(path.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{what} {path} is not valid TOML: {exc}") from None
