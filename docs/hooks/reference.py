"""MkDocs hook: the pages generated from the code at build time, so they cannot drift.

- configuration.md: one table of every LAYERSWAP_* variable, from `core.settings.Settings`;
- api/reference.md: the HTTP API, rendered from the app's own OpenAPI schema;
- api/openapi.json: that schema as the app serves it at /openapi.json.

Nothing here is committed: the files exist only in the build. Building the schema constructs the
app (`create_app`) on a throw-away data directory with an executor that runs nothing; no server
starts and no database is opened.
"""

from __future__ import annotations

import html
import json
import os
import re
import tempfile
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File as DocFile
from mkdocs.structure.files import Files
from pydantic.fields import FieldInfo

CONFIGURATION_PAGE = "configuration.md"
REFERENCE_PAGE = "api/reference.md"
SCHEMA_FILE = "api/openapi.json"
HTTP_METHODS = ("get", "post", "put", "patch", "delete")


# -- configuration ----------------------------------------------------------------------------


def settings_rows() -> list[tuple[str, str, str, str]]:
    """(variable, type, default, meaning) for every field of Settings, in declaration order."""
    from core.settings import Settings

    prefix = str(Settings.model_config.get("env_prefix", ""))
    return [
        (
            f"{prefix}{name}".upper(),
            _type_name(field.annotation),
            _default(field),
            _meaning(field),
        )
        for name, field in Settings.model_fields.items()
    ]


def undescribed_settings() -> list[str]:
    """Settings fields declared without a description (their row's meaning says only the bounds)."""
    from core.settings import Settings

    return [name for name, field in Settings.model_fields.items() if not field.description]


def configuration_markdown() -> str:
    lines = [
        "# Configuration",
        "",
        "Every setting is an environment variable, read once when a process starts and checked",
        "then: `layerswap serve` and `layerswap worker` refuse to start on an invalid value, and",
        "the error never echoes the value. Lists and maps are JSON. This table is generated from",
        "`core.settings.Settings` when the documentation is built.",
        "",
        "| variable | type | default | meaning |",
        "|---|---|---|---|",
    ]
    for variable, kind, default, meaning in settings_rows():
        lines.append(f"| `{variable}` | {_cell(kind)} | {_cell(default)} | {_cell(meaning)} |")
    lines += [
        "",
        "The Hugging Face client's own variables apply too: `HF_ENDPOINT` (a Hub mirror or an",
        "enterprise endpoint) and `HF_HUB_DISABLE_XET`. API processes and workers need the same",
        "`LAYERSWAP_HUB_CREDENTIALS`; only API processes need `LAYERSWAP_WEBHOOK_SECRET_KEYS`.",
        "",
    ]
    return "\n".join(lines)


def _type_name(annotation: Any) -> str:
    text = repr(annotation) if not isinstance(annotation, type) else annotation.__name__
    for noise in ("typing.", "pathlib.", "pydantic.types.", "<class '", "'>"):
        text = text.replace(noise, "")
    text = text.replace("Annotated[list[SecretStr], NoDecode]", "list[SecretStr]")
    text = re.sub(
        r"Literal\[([^\]]*)\]",
        lambda match: " | ".join(part.strip(" '\"") for part in match.group(1).split(",")),
        text,
    )
    return _code(text)


def _default(field: FieldInfo) -> str:
    if field.default_factory is not None:
        value: Any = field.default_factory()  # type: ignore[call-arg]
    else:
        value = field.default
    if value is None:
        return "none"
    if isinstance(value, (list, dict)):
        return _code(json.dumps(value))
    if isinstance(value, bool):
        return _code(str(value).lower())
    return _code(str(value))


def _meaning(field: FieldInfo) -> str:
    bounds = []
    for constraint in field.metadata:
        for attribute, symbol in (("ge", "≥"), ("gt", ">"), ("le", "≤"), ("lt", "<")):
            value = getattr(constraint, attribute, None)
            if value is not None:
                shown = f"{value:g}" if isinstance(value, float) else str(value)
                bounds.append(f"{symbol} {shown}")
        pattern = getattr(constraint, "pattern", None)
        if pattern:
            bounds.append(f"matches {_code(pattern)}")
        for attribute, word in (("min_length", "at least"), ("max_length", "at most")):
            value = getattr(constraint, attribute, None)
            if value is not None:
                bounds.append(f"{word} {value} characters")
    text = html.escape(field.description or "", quote=False)  # plain text: <data_dir> stays
    if bounds:
        text = f"{text} ({', '.join(bounds)})" if text else ", ".join(bounds)
    return text


def _code(text: str) -> str:
    """Inline code that may hold `|`: a Markdown table would split a code span on it."""
    return f"<code>{html.escape(text).replace('|', '&#124;')}</code>"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# -- the HTTP API -------------------------------------------------------------------------------


class _IdleExecutor:
    """Runs nothing: the schema needs an app, not a working executor."""

    def dispatch(self, job_id: str, kind: str) -> None: ...

    def pending(self) -> set[str]:
        return set()

    def start(self) -> None: ...

    def stop(self) -> None: ...


def openapi_schema() -> dict[str, Any]:
    """The schema the app serves at /openapi.json, built without serving or a database."""
    from core.settings import Settings
    from service.app import create_app

    # The schema is made from the code alone: this shell's LAYERSWAP_* variables (a database
    # URL, a host that needs auth) must not change it or stop the build.
    saved = {name: value for name, value in os.environ.items() if name.startswith("LAYERSWAP_")}
    for name in saved:
        del os.environ[name]
    try:
        with tempfile.TemporaryDirectory(prefix="layerswap-docs-") as data:
            app = create_app(Settings(data_dir=Path(data)), executor=_IdleExecutor())
            return dict(app.openapi())
    finally:
        os.environ.update(saved)


def operations(schema: dict[str, Any]) -> Iterable[tuple[str, str, dict[str, Any]]]:
    """(METHOD, path, operation) for every operation, in the schema's order."""
    for path, item in schema.get("paths", {}).items():
        for method in HTTP_METHODS:
            if method in item:
                yield method.upper(), path, item[method]


def reference_markdown(schema: dict[str, Any]) -> str:
    info = schema.get("info", {})
    lines = [
        "# API reference",
        "",
        f"{info.get('title', '')} {info.get('version', '')}, OpenAPI {schema.get('openapi', '')}.",
        "This page is generated from the application's own schema when the documentation is",
        "built; the same schema is [openapi.json](openapi.json) here and `/openapi.json` on a",
        "running service (which also serves it at `/docs` and `/redoc`). Every error answer has",
        'the body `ErrorBody`: `{"error": {"code", "message", "details"}}`.',
        "",
    ]
    tag_of: dict[str, list[tuple[str, str, dict[str, Any]]]] = {}
    for method, path, operation in operations(schema):
        tag = (operation.get("tags") or ["service"])[0]
        tag_of.setdefault(tag, []).append((method, path, operation))
    for tag, entries in tag_of.items():
        lines += [f"## {tag}", ""]
        for method, path, operation in entries:
            lines += _operation_markdown(method, path, operation)
    lines += ["## Schemas", ""]
    for name, component in schema.get("components", {}).get("schemas", {}).items():
        lines += _schema_markdown(name, component)
    return "\n".join(lines)


def _operation_markdown(method: str, path: str, operation: dict[str, Any]) -> list[str]:
    lines = [f"### `{method} {path}`", ""]
    if operation.get("summary"):
        lines += [f"**{operation['summary']}**", ""]
    if operation.get("description"):
        lines += [operation["description"].strip(), ""]
    parameters = operation.get("parameters", [])
    if parameters:
        lines += ["| parameter | in | type | required | description |", "|---|---|---|---|---|"]
        for parameter in parameters:
            lines.append(
                f"| `{parameter['name']}` | {parameter['in']} | "
                f"{_cell(_schema_type(parameter.get('schema', {})))} | "
                f"{'yes' if parameter.get('required') else 'no'} | "
                f"{_cell(parameter.get('description', ''))} |"
            )
        lines.append("")
    body = operation.get("requestBody")
    if body:
        for media, content in body.get("content", {}).items():
            required = "required" if body.get("required") else "optional"
            model = _schema_type(content.get("schema", {}))
            lines += [f"Request body ({media}, {required}): {model}", ""]
    responses = operation.get("responses", {})
    if responses:
        lines += ["| status | description | body |", "|---|---|---|"]
        for status, response in responses.items():
            bodies = [
                f"{media}: {_schema_type(content.get('schema', {}))}"
                for media, content in response.get("content", {}).items()
            ]
            lines.append(
                f"| {status} | {_cell(response.get('description', ''))} | "
                f"{_cell('; '.join(bodies))} |"
            )
        lines.append("")
    return lines


def _schema_markdown(name: str, component: dict[str, Any]) -> list[str]:
    lines = [f"### {name} {{#{_anchor(name)}}}", ""]
    if component.get("description"):
        lines += [component["description"].strip(), ""]
    properties = component.get("properties", {})
    if properties:
        required = set(component.get("required", []))
        lines += ["| field | type | required | description |", "|---|---|---|---|"]
        for field, schema in properties.items():
            lines.append(
                f"| `{field}` | {_cell(_schema_type(schema))} | "
                f"{'yes' if field in required else 'no'} | {_cell(schema.get('description', ''))} |"
            )
        lines.append("")
    elif component.get("enum"):
        lines += ["One of: " + ", ".join(f"`{value}`" for value in component["enum"]), ""]
    return lines


def _anchor(name: str) -> str:
    return f"schema-{name.lower()}"


def _schema_type(schema: dict[str, Any]) -> str:
    """A schema as a short type: a link for a component, `list[...]`, `a | b`."""
    if "$ref" in schema:
        name = schema["$ref"].rsplit("/", 1)[-1]
        return f"[{name}](#{_anchor(name)})"
    for combinator in ("anyOf", "oneOf", "allOf"):
        if combinator in schema:
            return " | ".join(_schema_type(part) for part in schema[combinator])
    kind = schema.get("type")
    if kind == "array":
        return f"list[{_schema_type(schema.get('items', {}))}]"
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        return f"map[str, {_schema_type(schema['additionalProperties'])}]"
    if "const" in schema:
        return f"`{json.dumps(schema['const'])}`"
    if "enum" in schema:
        return " | ".join(f"`{json.dumps(value)}`" for value in schema["enum"])
    if kind == "string" and schema.get("format"):
        return f"string ({schema['format']})"
    return str(kind or "any")


# -- MkDocs events -------------------------------------------------------------------------------


def on_files(files: Files, config: MkDocsConfig) -> Files:
    schema = openapi_schema()
    generated = {
        CONFIGURATION_PAGE: configuration_markdown(),
        REFERENCE_PAGE: reference_markdown(schema),
        SCHEMA_FILE: json.dumps(schema, indent=2) + "\n",
    }
    for uri, content in generated.items():
        existing = files.get_file_from_path(uri)
        if existing is not None:
            files.remove(existing)
        files.append(DocFile.generated(config, uri, content=content))
    return files
