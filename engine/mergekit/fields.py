"""The mergekit config's field a translated recipe's field came from, so that an error the
recipe's validation finds names what the user wrote (`slices`, `models.1.parameters.weight`),
not the recipe they never saw (`params.slices`, `params.weights.1`)."""

from __future__ import annotations

from engine.translation.config import MergekitConfig
from engine.translation.translators import Translation


def mergekit_field(
    where: str, config: MergekitConfig, translation: Translation, sources: dict[str, str]
) -> str | None:
    """The config's field for the recipe's `where`, or None where the recipe's field has no
    counterpart. `sources` maps the recipe's source fields (models.0, base, params.slices) to
    the config's."""
    known = [key for key in sources if where == key or where.startswith(f"{key}.")]
    if known:
        key = max(known, key=len)
        return _beneath(sources[key], where[len(key) + 1 :], translation)
    if where == "models":
        return _models_list(config)
    parts = where.split(".")
    if parts[0] == "params" and len(parts) > 1:
        return _parameter(parts[1:], config, translation, sources)
    return None


def _beneath(field: str, rest: str, translation: Translation) -> str:
    """A field beneath a source's (`params.slices` -> `slices`): the recipe's sources carry
    their parameters (`scale`) where the config writes them in a `parameters` block."""
    if not rest:
        return field
    parts = rest.split(".")
    written = [*field.split("."), *parts]
    if parts[-1] in translation.shared | translation.per_model and written[-2] != "parameters":
        parts.insert(len(parts) - 1, "parameters")
    return ".".join([field, *parts])


def _models_list(config: MergekitConfig) -> str:
    """Where the config lists its models: `models`, or its (first) slice's sources."""
    if config.slices:
        return f"{config.slices[0].field}.sources"
    return config.inputs[0].field.rsplit(".", 1)[0] if config.inputs else "models"


def _parameter(
    path: list[str], config: MergekitConfig, translation: Translation, sources: dict[str, str]
) -> str | None:
    """The field that sets the mergekit parameter a recipe param (`params.weights.1`) is read
    from: the model's own, else the block all the models share."""
    declared = next((p for p in translation.parameters if p.into == path[0]), None)
    if declared is None:
        return None
    name = declared.name
    model_field = sources.get(f"models.{path[1]}") if len(path) > 1 else None
    if declared.per_model and model_field is not None:
        model = model_field.removesuffix(".model")
        own = next((m for m in config.inputs if m.field == model), None)
        if own is not None and name in own.parameters:
            return f"{model}.parameters.{name}"
    shared = [where for where, block in config.shared_blocks if name in block]
    return f"{shared[0]}.{name}" if shared else f"parameters.{name}"
