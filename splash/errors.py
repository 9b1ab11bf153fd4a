"""Errors users see. Every failure a caller can act on is a SplashError subclass with a message
that says what was wrong; the engine and the server keep serving after raising one."""


# text prompts without a tokenizer: what is missing and how to get it
NO_TOKENIZER = ("this model has no usable tokenizer (no tokenizer files in the checkpoint, or "
                "transformers is not installed: pip install 'splash-serve[tokenizer]')")


class SplashError(Exception):
    """Base class of every error SPLASH raises on purpose."""


class InvalidRequestError(SplashError, ValueError):
    """The request itself is malformed: bad prompt, sampling values or lengths."""


class ConfigError(SplashError, ValueError):
    """Engine or model configuration that cannot work (shapes, layouts, memory)."""


class LayoutInfeasibleError(ConfigError):
    """A layout that does not fit the model (head divisibility) or the memory budget."""


class WorkerDiedError(SplashError, RuntimeError):
    """A worker process exited or stopped answering; in-flight requests fail with this."""


class StepFailedError(SplashError, RuntimeError):
    """A step failed on a worker that kept its state (an out-of-memory error of a single-rank
    group): the engine fails that step's requests and serves on."""


class ProtocolError(SplashError):
    """A malformed or unsupported message on the wire."""


class RequestTimeoutError(SplashError, TimeoutError):
    """The server did not answer within the client's timeout."""


class ServerError(SplashError, RuntimeError):
    """The server reported an internal failure."""


class NotFoundError(SplashError, KeyError):
    """The request id is unknown to the server (finished, aborted or never sent)."""
