"""Typed errors raised at the edges (files, configs, options, prompts).

Every message names the bad value and says what is allowed or how to fix it. They subclass the builtin
that a caller would naturally catch (ValueError, FileNotFoundError) so plain `except ValueError` works too.

Every exception class nexttoken defines derives from NextTokenError (tests/test_errors.py walks the package),
those defined beside their owners too: the engine's EngineDeadError / EngineClosedError (RuntimeErrors; the server
answers them with a 503, so it catches them before NextTokenError), model/kernels.py's NativeKernelError, the
server's APIError (an error body with its status) and ClientGone, the bench's BenchError.
"""


class NextTokenError(Exception):
    """Base class of every error nexttoken raises: bad input (the classes below), and the typed run-time errors
    defined beside their owners."""


class ModelLoadError(NextTokenError, ValueError):
    """A model folder cannot be loaded: unknown architecture, bad config, missing or malformed tensor."""


class MissingFileError(ModelLoadError, FileNotFoundError):
    """A file the model folder needs is not there."""


class TokenizerError(NextTokenError, ValueError):
    """The tokenizer files are unusable, or an operation needs a tokenizer that the folder lacks."""


class ChatTemplateError(TokenizerError):
    """A chat template is missing, fails to render, or tried something the sandbox forbids."""


class GenerationConfigError(NextTokenError, ValueError):
    """An unknown generation option or a value out of its allowed range."""


class MissingExtraError(NextTokenError, ImportError):
    """A feature needs a package that the base install does not carry; the message names the install command."""


class PromptTooLongError(NextTokenError, ValueError):
    """The prompt plus the requested new tokens do not fit the model's context."""


class TensorParallelError(NextTokenError, RuntimeError):
    """The ranks of a tensor-parallel model cannot work together: a rank died or hung, or a forward ran outside
    the engine's steps (docs/tensor_parallel.md)."""


class LoraError(ModelLoadError):
    """A LoRA adapter cannot be used: not a PEFT LoRA folder, not safetensors, a damaged file, a target module or
    option nexttoken does not apply (embeddings, heads, DoRA), a rank above the limit, or an unknown name."""


class UnknownLoraError(LoraError, LookupError):
    """A request names an adapter that is not loaded."""


class ImageError(NextTokenError, ValueError):
    """An image in a request cannot be used: unreadable or truncated bytes, an unknown source, too many images or
    too many pixels, or a model that takes no images."""
