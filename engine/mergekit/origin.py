"""What a recipe translated from a mergekit config carries beside it, from submit to manifest:
the config as given (lineage), what differs from mergekit (plan warnings), the layer count a
whole-model slice assumed (checked once the checkpoints are open), the mergekit field of each
source and of tokenizer_source (so an error names the field the user wrote), and the model
mergekit takes config.json and the tokenizer from (side_files.py writes them as mergekit
does)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from engine.mergekit.config import declared_dtype
from engine.mergekit.side_files import donate, write
from engine.plan.model import MEAN, Plan

# An engine or service error: a message and details naming the field.
E = TypeVar("E", bound=Exception)
_SAFETENSORS = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}


@dataclass(frozen=True)
class MergekitOrigin:
    config: dict[str, Any]  # the mergekit config as given, less the top-level keys it ignores
    warnings: tuple[str, ...] = ()
    source_fields: dict[str, str] = field(default_factory=dict)  # recipe field -> mergekit's
    donor: str | None = None  # the source of the config's base_model (None: it has none)

    def apply(self, plan: Plan) -> None:
        """Take config.json and the tokenizer from mergekit's donor; add the translation's
        warnings."""
        donated = donate(plan, self.donor, self.config.get("chat_template"))
        said = [*self.warnings, *self._averaged_rows(plan), *donated]
        plan.warnings[:0] = [w for w in said if w not in plan.warnings]

    def _averaged_rows(self, plan: Plan) -> list[str]:
        """A token several inputs have and the base lacks gets the mean of their rows, which
        mergekit computes in its `dtype` and Layerswap, as mergekit without one, in the
        checkpoints' own."""
        vocabulary, dtype = plan.vocabulary, self.config.get("dtype")
        if vocabulary is None or MEAN not in vocabulary.fill or not plan.checkpoints:
            return []
        name = min(vocabulary.tensors)
        ours = plan.checkpoints[0].tensors[name].dtype
        if not isinstance(dtype, str) or _SAFETENSORS.get(dtype.removeprefix("torch.")) == ours:
            return []
        where = self.source_fields.get("tokenizer_source", "tokenizer_source")
        return [
            f"{where}: rows averaged for tokens the base lacks are computed in {ours}, the "
            f"checkpoints' dtype; mergekit computes them in {dtype}, so they may differ from "
            "mergekit's in the last bit"
        ]

    @property
    def declared_dtype(self) -> str:
        """config.json's dtype as mergekit writes it: the config's out_dtype, else its dtype,
        though the tensors may be wider (a method's `writes`); "source": the donor's own."""
        return declared_dtype(self.config)

    def write_side_files(self, plan: Plan, staging: Path) -> list[str]:
        """config.json and the tokenizer's files, as mergekit writes them, into `staging` (after
        apply); the names written."""
        return write(plan, staging, self.declared_dtype, self.config.get("chat_template"))

    def renamed(self, error: E, *, prefix: str = "") -> E:
        """`error` (an EngineError or ServiceError) naming the mergekit field, under `prefix`,
        where it names one of the recipe's sources or is one of apply()'s."""
        details, message = getattr(error, "details", None), getattr(error, "message", None)
        where = details.get("field") if isinstance(details, dict) else None
        mergekit = self.source_fields.get(where) if isinstance(where, str) else None
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
            "source_fields": self.source_fields,
            "donor": self.donor,
        }

    @classmethod
    def from_record(cls, data: dict[str, Any]) -> MergekitOrigin:
        return cls(  # a record's "depth" (of older records) is no longer needed: ignored
            data["config"],
            tuple(data.get("warnings") or ()),
            dict(data.get("source_fields") or {}),
            data.get("donor"),
        )
