"""`nexttoken serve`: an OpenAI-compatible HTTP server over the continuous-batching engine."""

from .app import ServerSettings, build_app

__all__ = ["ServerSettings", "build_app"]
