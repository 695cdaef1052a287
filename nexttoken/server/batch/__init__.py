"""Batch jobs in OpenAI's batch file format: `nexttoken run-batch` and the server's /v1/batches run a file of
requests through the server's own routes (lines.py: the format and resuming; runner.py: the run; files.py,
jobs.py, routes.py: /v1/files and /v1/batches). Nothing is imported here: the command's parser reads ENDPOINTS
without the server's dependencies."""

# The APIs a batch line may call (OpenAI's batch endpoints that this server has).
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
