"""The routes of the server's files and batches (OpenAI's `/v1/files` and `/v1/batches`, what the `openai` SDK's
client.files and client.batches call): app.py adds them with `add_batch_routes`. They are not in /openapi.json
yet (the document's error and multipart shapes for them are not written)."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError

from ..http.errors import bad_request, from_validation_error
from .files import FileStore
from .jobs import BatchCreate, Batches


def add_batch_routes(app: FastAPI, concurrency: int, api_key: str | None) -> Batches:
    """/v1/files and /v1/batches on `app`; each batch runs through `app` itself, `concurrency` requests at once.
    Returns the batches (the app's lifespan cancels the running ones when the server stops)."""
    files = FileStore()
    app.state.files = files  # an input_image's file_id reads its image here (api/responses.py)
    batches = Batches(files, concurrency, {"authorization": f"Bearer {api_key}"} if api_key else None)

    @app.post("/v1/files", include_in_schema=False)
    async def upload(request: Request) -> JSONResponse:
        form = await request.form()
        file, purpose = form.get("file"), form.get("purpose")
        if file is None or isinstance(file, str):
            raise bad_request("file is required: the batch input, as a multipart file field", "file")
        if not isinstance(purpose, str):
            raise bad_request("purpose is required: \"batch\"", "purpose")
        stored = files.add(file.filename or "upload.jsonl", purpose, await file.read())
        return JSONResponse(stored.object())

    @app.get("/v1/files", include_in_schema=False)
    async def list_files(purpose: str | None = None) -> JSONResponse:
        return JSONResponse(files.listing(purpose))

    @app.get("/v1/files/{file_id}", include_in_schema=False)
    async def get_file(file_id: str) -> JSONResponse:
        return JSONResponse(files.get(file_id).object())

    @app.get("/v1/files/{file_id}/content", include_in_schema=False)
    async def file_content(file_id: str) -> Response:
        return Response(files.get(file_id).data, media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}", include_in_schema=False)
    async def delete_file(file_id: str) -> JSONResponse:
        return JSONResponse(files.delete(file_id))

    @app.post("/v1/batches", include_in_schema=False)
    async def create_batch(request: Request) -> JSONResponse:
        try:
            body = BatchCreate.model_validate_json(await request.body())
        except ValidationError as e:
            raise from_validation_error(e) from e
        return JSONResponse(batches.create(request.app, body).object())

    @app.get("/v1/batches", include_in_schema=False)
    async def list_batches(after: str | None = None, limit: str = "20") -> JSONResponse:
        if not (limit.isdigit() and 1 <= int(limit) <= 100):  # read here: FastAPI's own refusal is a 422
            raise bad_request(f"limit must be an integer from 1 to 100, got {limit!r}", "limit")
        return JSONResponse(batches.listing(after, int(limit)))

    @app.get("/v1/batches/{batch_id}", include_in_schema=False)
    async def get_batch(batch_id: str) -> JSONResponse:
        return JSONResponse(batches.get(batch_id).object())

    @app.post("/v1/batches/{batch_id}/cancel", include_in_schema=False)
    async def cancel_batch(batch_id: str) -> JSONResponse:
        return JSONResponse((await batches.cancel(batch_id)).object())

    return batches
