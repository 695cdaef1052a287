"""HTTP plumbing under every API: error bodies, the request guards (API key, body limits, internal errors),
graceful shutdown, and the bridge from requests to the engine's event streams (SSE)."""
