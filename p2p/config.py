"""The error type and check helper shared by every component's config dataclasses."""


class ConfigError(ValueError):
    """A configuration value that cannot be used; the message names the key and what is allowed."""


def require(ok: bool, key: str, message: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {message}")
