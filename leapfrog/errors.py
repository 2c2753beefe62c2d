"""Error types. Every one carries a message a user can act on."""


class LeapfrogError(Exception):
    """Base of leapfrog's own errors."""


class CheckpointError(LeapfrogError, ValueError):
    """A checkpoint directory, config or tensor is missing, malformed or unsupported."""


class ConfigError(LeapfrogError, ValueError):
    """An engine, sampling or speculative configuration value is invalid."""


class NotShareable(ConfigError):
    """An engine cannot run on another engine's loaded target (``LLM(share_target_with=...)``:
    engine.check_shareable, or a target that would stream its weights beside a drafter)."""


class RequestError(LeapfrogError, ValueError):
    """A request cannot be served as given (too long, bad prompt, ...). ``param``: the request
    field at fault when it is not the prompt (the server's 400 names it)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EngineError(LeapfrogError, RuntimeError):
    """A request failed inside the engine (the engine isolated it: other requests go on)."""


class CacheBusy(LeapfrogError, RuntimeError):
    """An engine stepped while another engine sharing its KV cache (``share_kv_cache``) has
    unfinished requests: such engines run one at a time."""
