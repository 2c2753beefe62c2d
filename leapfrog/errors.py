"""Error types. Every one carries a message a user can act on."""


class LeapfrogError(Exception):
    """Base of leapfrog's own errors."""


class CheckpointError(LeapfrogError, ValueError):
    """A checkpoint directory, config or tensor is missing, malformed or unsupported."""


class ConfigError(LeapfrogError, ValueError):
    """An engine, sampling or speculative configuration value is invalid."""


class RequestError(LeapfrogError, ValueError):
    """A request cannot be served as given (too long, bad prompt, ...)."""


class EngineError(LeapfrogError, RuntimeError):
    """A request failed inside the engine (the engine isolated it: other requests go on)."""
