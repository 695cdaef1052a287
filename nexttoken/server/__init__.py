"""`nexttoken serve`: an OpenAI-compatible HTTP server over the continuous-batching engine."""

from .app import build_app
from .settings import ServerSettings

__all__ = ["ServerSettings", "build_app"]
