"""Why each token came out: the recorder that keeps every step's candidates through the processors and the draw
(recorder.py), the explain page that shows them (page.py), and replay, which runs a trace again (replay.py)."""

from .recorder import TraceRecorder, to_json

__all__ = ["TraceRecorder", "to_json"]
