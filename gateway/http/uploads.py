"""An adapter upload, `POST /v1/adapters` (torch-free): a `multipart/form-data` body, read to at
most its own size limit, with a `name` and either a `file` (a GGUF adapter) or PEFT's
`adapter_config.json` and `adapter_model.safetensors` (converted here), with, optionally, the
adapter's chat template as PEFT saves it (`tokenizer_config.json`, `chat_template.jinja`)."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fastapi import Request
from starlette.datastructures import FormData, UploadFile

from gateway.config import NAME
from gateway.errors import GatewayError
from gateway.registry.store import PEFT_CONFIG, PEFT_TEMPLATE_FILES, PEFT_WEIGHTS, check_gguf, convert_peft
from worker.formats.adapter import LoRAAdapter
from worker.formats.gguf_file import GGUFFile

UPLOAD_PARTS = ("name", "file", PEFT_CONFIG, PEFT_WEIGHTS, *PEFT_TEMPLATE_FILES)
FILE_PARTS = ("file", PEFT_CONFIG, PEFT_WEIGHTS, *PEFT_TEMPLATE_FILES)
UPLOAD_BODY = {"required": True, "content": {"multipart/form-data": {"schema": {  # for the OpenAPI document
    "type": "object", "required": ["name"],
    "properties": {"name": {"type": "string", "pattern": NAME}, "file": {"type": "string", "format": "binary"},
                   PEFT_CONFIG: {"type": "string", "format": "binary"},
                   PEFT_WEIGHTS: {"type": "string", "format": "binary"},
                   **{name: {"type": "string", "format": "binary"} for name in PEFT_TEMPLATE_FILES}}}}}}
SPOOL_IN_MEMORY_BYTES = 8 << 20  # a larger upload spools to a temporary file
COPY_BYTES = 1 << 20

ReadAdapter = Callable[[Path], LoRAAdapter]  # writes the adapter into a scratch directory and checks it


async def read_form(request: Request, limit_bytes: int) -> FormData:
    """The multipart form, read to at most `limit_bytes` (413 beyond, whatever the header said)."""
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise GatewayError(400, "expected a multipart/form-data body: a 'name' field and a 'file' part, or "
                       f"'{PEFT_CONFIG}' and '{PEFT_WEIGHTS}' parts", "invalid_value")
    too_large = GatewayError(413, f"upload over {limit_bytes} bytes (registry.max_upload_bytes)", "body_too_large")
    if int(request.headers.get("content-length") or 0) > limit_bytes:
        raise too_large
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY_BYTES) as spool:
        num_bytes = 0
        async for received in request.stream():
            num_bytes += len(received)
            if num_bytes > limit_bytes:
                raise too_large
            spool.write(received)
        spool.seek(0)

        async def receive() -> dict[str, Any]:
            block = spool.read(COPY_BYTES)
            return {"type": "http.request", "body": block, "more_body": bool(block)}

        try:
            return await Request(request.scope, receive).form(max_files=len(UPLOAD_PARTS),
                                                              max_fields=len(UPLOAD_PARTS))
        except Exception as e:  # a malformed multipart body, too many parts
            raise GatewayError(400, f"the multipart body cannot be read: {getattr(e, 'detail', None) or e}",
                           "invalid_value") from e


def adapter_reader(form: FormData, base: GGUFFile) -> ReadAdapter:
    """What reads the form's adapter: its GGUF `file`, or its PEFT parts converted (a 400 for any
    other set of parts)."""
    parts = {k: form.get(k) for k in FILE_PARTS}
    given = {k for k, v in parts.items() if v is not None}
    not_files = [k for k in given if not isinstance(parts[k], UploadFile)]
    if not_files:
        raise GatewayError(400, f"{not_files[0]}: expected a file part", "invalid_value")
    if given == {"file"}:
        gguf_part = parts["file"]

        def read_gguf(scratch: Path) -> LoRAAdapter:
            path = scratch / "adapter.gguf"
            _save(gguf_part, path)
            return check_gguf(path, base)

        return read_gguf
    if {PEFT_CONFIG, PEFT_WEIGHTS} <= given <= {PEFT_CONFIG, PEFT_WEIGHTS, *PEFT_TEMPLATE_FILES}:
        peft_parts = {name: parts[name] for name in given}

        def read_peft(scratch: Path) -> LoRAAdapter:
            peft = scratch / "peft"
            peft.mkdir()
            for name, part in peft_parts.items():
                _save(part, peft / name)
            return convert_peft(peft, base, scratch / "adapter.gguf")

        return read_peft
    raise GatewayError(400, f"send either a 'file' part (a GGUF adapter) or both '{PEFT_CONFIG}' and '{PEFT_WEIGHTS}' "
                   f"(a PEFT adapter, with '{PEFT_TEMPLATE_FILES[0]}' or '{PEFT_TEMPLATE_FILES[1]}' if it has its own "
                   f"chat template); got {', '.join(sorted(given)) or 'no file'}", "invalid_value")


def _save(part: UploadFile, path: Path) -> None:
    part.file.seek(0)
    with open(path, "wb") as out:
        shutil.copyfileobj(part.file, out, COPY_BYTES)
