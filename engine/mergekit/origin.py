"""What a recipe translated from a mergekit config carries beside it, from submit to manifest:
the config as given (lineage), what differs from mergekit (plan warnings), the layer count a
whole-model slice assumed (checked once the checkpoints are open), and the mergekit field of
each source (so a source's error names the field the user wrote)."""

from __future__ import annotations

import filecmp
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from engine.checkpoint import TOKENIZER_FILES
from engine.errors import RecipeError

if TYPE_CHECKING:
    from engine.plan import Plan

# An engine or service error: a message and details naming the field.
E = TypeVar("E", bound=Exception)


@dataclass(frozen=True)
class MergekitOrigin:
    config: dict[str, Any]  # the mergekit config as given
    warnings: tuple[str, ...] = ()
    depth: tuple[str, int] | None = None  # (field, layers) of a slice read as whole models
    source_fields: dict[str, str] = field(default_factory=dict)  # recipe field -> mergekit's
    tokenizer: tuple[str, int] | None = None  # (field, input) of tokenizer_source

    def apply(self, plan: Plan) -> None:
        """Refuse a plan the config does not describe; add the translation's warnings."""
        self._check_tokenizer(plan)
        if self.depth is not None:
            where, layers = self.depth
            if plan.num_layers != layers:
                found = "an unknown number of" if plan.num_layers is None else plan.num_layers
                raise RecipeError.for_field(
                    where,
                    f"[0, {layers}) must span every layer of the models, which have {found} "
                    "layers: Layerswap merges whole models (a part is passthrough's)",
                )
        plan.warnings[:0] = [w for w in self.warnings if w not in plan.warnings]

    def _check_tokenizer(self, plan: Plan) -> None:
        """mergekit builds the vocabulary from tokenizer_source and maps every model's
        embedding rows onto it; Layerswap copies the tokenizer input's files. The same when
        the named model's tokenizer files are the same; refused otherwise."""
        if self.tokenizer is None or self.tokenizer[1] == plan.tokenizer_input:
            return
        where, named = self.tokenizer
        ours, theirs = (Path(plan.inputs[i].path) for i in (plan.tokenizer_input, named))
        for name in TOKENIZER_FILES:
            a, b = ours / name, theirs / name
            if a.is_file() != b.is_file() or (a.is_file() and not filecmp.cmp(a, b, shallow=False)):
                raise RecipeError.for_field(
                    where,
                    f"{name} of {plan.inputs[named].source} differs from "
                    f"{plan.inputs[plan.tokenizer_input].source}'s, which Layerswap copies: "
                    "rebuilding the vocabulary from another model's tokenizer is not supported",
                )

    def renamed(self, error: E, *, prefix: str = "") -> E:
        """`error` (an EngineError or ServiceError) naming the mergekit field, under `prefix`,
        where it names one of the recipe's sources or is one of apply()'s."""
        details, message = getattr(error, "details", None), getattr(error, "message", None)
        where = details.get("field") if isinstance(details, dict) else None
        own = {found[0]: found[0] for found in (self.depth, self.tokenizer) if found}
        mergekit = (self.source_fields | own).get(where) if isinstance(where, str) else None
        if mergekit is None or not isinstance(details, dict) or not isinstance(message, str):
            return error
        details["field"] = prefix + mergekit
        if message.startswith(f"{where}:"):
            error.message = prefix + mergekit + message[len(str(where)) :]  # type: ignore[attr-defined]
            error.args = (error.message,)  # type: ignore[attr-defined]
        return error

    def record(self) -> dict[str, Any]:
        """JSON for a job's request and the output's manifest."""
        return {
            "config": self.config,
            "warnings": list(self.warnings),
            "depth": list(self.depth) if self.depth else None,
            "source_fields": self.source_fields,
            "tokenizer": list(self.tokenizer) if self.tokenizer else None,
        }

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> MergekitOrigin:
        depth, tokenizer = data.get("depth"), data.get("tokenizer")
        return cls(
            data["config"],
            tuple(data.get("warnings") or ()),
            (str(depth[0]), int(depth[1])) if depth else None,
            dict(data.get("source_fields") or {}),
            (str(tokenizer[0]), int(tokenizer[1])) if tokenizer else None,
        )
