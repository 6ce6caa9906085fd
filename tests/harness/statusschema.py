"""``GET /status`` against its published JSON Schema (docs/status.schema.json)."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import jsonschema

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "docs" / "status.schema.json"


@functools.cache
def validator() -> jsonschema.Draft202012Validator:
    schema = json.loads(SCHEMA_PATH.read_text())
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def validate_status(doc: Any) -> None:
    """Raise AssertionError naming every place where ``doc`` breaks the schema."""
    errors = sorted(validator().iter_errors(doc), key=lambda e: list(e.absolute_path))
    problems = [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in errors]
    assert not problems, "status document breaks docs/status.schema.json:\n" + "\n".join(problems)
