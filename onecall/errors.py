"""Typed errors raised at onecall's boundaries.

Every error a user can cause (a bad path, an unsupported model, an out-of-range
parameter, a prompt that does not fit) is one of these, with a message that
names what is wrong and what would be accepted. The server turns them into
OpenAI-style 4xx responses; `assert` is kept for our own invariants only.
"""

from __future__ import annotations


class OnecallError(Exception):
    """Base class of every error onecall raises on purpose."""


class InvalidParameterError(OnecallError, ValueError):
    """A request or engine parameter is missing, ill-typed or out of range.

    `param` names the offending parameter (e.g. "top_p") so a server can put it
    in the error body's `param` field.
    """

    def __init__(self, param: str, message: str) -> None:
        super().__init__(f"{param}: {message}")
        self.param = param


class ContextLengthExceededError(InvalidParameterError):
    """The prompt (plus the tokens asked for) does not fit the context window."""

    def __init__(self, num_prompt_tokens: int, max_model_len: int, num_requested: int = 0) -> None:
        if num_requested:
            msg = (
                f"this model's context window is {max_model_len} tokens, but the request "
                f"needs {num_prompt_tokens + num_requested} ({num_prompt_tokens} in the prompt "
                f"and {num_requested} for the completion)"
            )
        else:
            msg = (
                f"this model's context window is {max_model_len} tokens, but the prompt "
                f"has {num_prompt_tokens}"
            )
        super().__init__("prompt", msg)
        self.num_prompt_tokens = num_prompt_tokens
        self.max_model_len = max_model_len
        self.num_requested = num_requested


class ModelNotFoundError(OnecallError, FileNotFoundError):
    """The model path does not exist or holds nothing onecall can load."""


class UnsupportedModelError(OnecallError, ValueError):
    """The model exists but uses an architecture, quantization, rope scaling or
    file format onecall refuses (unsafe formats such as pickled .bin/.pt included)."""


class TemplateError(OnecallError, ValueError):
    """The chat template failed to render (bad messages, raise_exception in the
    template, or an attempt to leave the sandbox)."""


class QueueFullError(OnecallError):
    """The engine's waiting queue is at its limit; the caller should retry later.

    `retry_after` is a hint in seconds (the server sends it as Retry-After).
    """

    def __init__(
        self, num_waiting: int, max_waiting: int, retry_after: int = 1, num_requested: int = 1
    ) -> None:
        adding = f" and this request would add {num_requested}" if num_requested > 1 else ""
        super().__init__(
            f"the server is busy: {num_waiting} requests are waiting (limit {max_waiting}){adding}; "
            "retry later"
        )
        self.num_waiting = num_waiting
        self.max_waiting = max_waiting
        self.retry_after = retry_after
        self.num_requested = num_requested


class EngineStepError(OnecallError):
    """The engine step that ran this request raised. Only the requests of that step's batch fail
    (each gets its own instance); their KV blocks are freed and the engine serves on.

    `stage` names where it raised ("model forward", "sampler", "grammar", "detokenizer"), `cause`
    is what was raised there (also the `__cause__`, so a logged traceback shows it).
    """

    def __init__(self, stage: str, cause: BaseException) -> None:
        super().__init__(f"the engine step failed in the {stage}: {type(cause).__name__}: {cause}")
        self.stage = stage
        self.cause = cause
        self.__cause__ = cause


class RequestFaultError(EngineStepError):
    """A step ended this one request, and only it, for a cause that is the request's own: its
    parameters leave no token allowed (`param` names them), its grammar failed, or its text could not
    be decoded. The rest of the batch goes on and the fault never counts toward the engine's death.
    A server answers it as the caller's error (400, `param`) when it comes before any token."""

    def __init__(self, stage: str, cause: BaseException, param: str | None = None) -> None:
        super().__init__(stage, cause)
        self.args = (f"the request was ended in the {stage}: {cause}",)
        self.param = param


class EngineDeadError(OnecallError):
    """The engine stopped (a fault repeated right after a recovery, its bookkeeping was found
    inconsistent, or its thread died); no request can be served until a restart. The message
    says why."""


class EngineRestartingError(EngineDeadError):
    """The engine stopped and is being rebuilt in place on the same weights: this request was not
    served (or was cut off), and the same request a moment later will be. An EngineDeadError, so a
    caller that only knows that one still sees the engine stopping; the server answers it with a
    503 and Retry-After (`retry_after` seconds, a hint), not the 503 of an engine dead for good."""

    def __init__(self, reason: str, retry_after: int = 1) -> None:
        super().__init__(f"the engine stopped ({reason}) and is restarting; retry in {retry_after} s")
        self.reason = reason
        self.retry_after = retry_after


class ModelFileError(UnsupportedModelError):
    """A model file is malformed: truncated, corrupt, or built to break the reader. The message names
    the file, what is wrong and where (which key, which tensor, which byte offset)."""
