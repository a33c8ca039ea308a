"""Run as `python -m tests.engine.throwaway_method EXAMPLES WORKDIR` (test_method_registry.py):
imports everything derived from the method registry, then registers a method declared here, as
a method module would declare it, and writes where it shows to WORKDIR/report.json. A process
of its own, so the registry of the tests' process stays as shipped."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Literal

from fastapi.testclient import TestClient
from pydantic import Field
from safetensors.torch import load_file

from core.db.migrate import upgrade
from core.settings import Settings
from engine.errors import RecipeError
from engine.merge import MergeOptions, merge
from engine.mergekit import translate
from engine.methods import Inputs, Method, MethodPlan, register
from engine.plan.model import Op, Term
from engine.recipe import parse_recipe, recipe_to_dict
from engine.schema.parts import ModelsRecipe, Source, Strict
from engine.translation.config import MergekitConfig
from engine.translation.translators import Parameter, Translation, read_parameters
from service.app import create_app
from service.sweeps.spec import Baseline
from tests.docs.reference_hook import load


class HalfwayParams(Strict):
    share: float = Field(0.5, ge=0, le=1, description="the second model's share")


class HalfwayRecipe(ModelsRecipe):
    """Two models mixed by one share."""

    method: Literal["halfway"]
    models: list[Source] = Field(min_length=2, max_length=2)
    params: HalfwayParams = HalfwayParams()


def plan_halfway(recipe: HalfwayRecipe, inputs: Inputs) -> MethodPlan:
    first, second = inputs.indices("model")
    share = recipe.params.share
    made = (Term(first, 1.0 - share), Term(second, share))

    def rule(name: str, layer: int | None) -> tuple[Op, tuple[Term, ...], str]:
        return "linear", made, "halfway"

    return MethodPlan(rule=rule, config_input=first, tokenizer_input=first)


def translate_halfway(config: MergekitConfig, translation: Translation) -> dict[str, Any]:
    models = config.inputs
    return {"models": [m.source for m in models],
            "params": read_parameters(config, translation, models)}  # fmt: skip


HALFWAY = Method(
    name="halfway",
    recipe=HalfwayRecipe,
    params=HalfwayParams,
    plan=plan_halfway,
    summary="two models mixed by one share",
    formula="(1 − share)·T₀ + share·T₁",
    title="a halfway mix",
    tags=("halfway",),
    base="unused",
    mergekit=Translation(
        names=("halfway_mix",),
        translate=translate_halfway,
        parameters=(Parameter("share", 0.5, into="share", varies=False),),
    ),
)


def app_settings(work: Path, examples: Path) -> Settings:
    data = work / "data"
    return Settings(
        data_dir=data,
        allowed_roots=[examples, data / "artifacts"],
        trusted_hosts=["testserver"],
    )


class IdleExecutor:
    """Queues nothing anywhere: a submitted job stays queued."""

    def dispatch(self, job_id: str, kind: str) -> None: ...

    def pending(self) -> set[str]:
        return set()

    def start(self) -> None: ...

    def stop(self) -> None: ...


def served(settings: Settings, models: list[str]) -> dict[str, Any]:
    """What the API, made after the method was registered, says of it."""
    app = create_app(settings, executor=IdleExecutor())
    client = TestClient(app)
    listed = {m["method"]: m for m in client.get("/v1/methods").json()}
    body = {"method": "halfway", "models": models, "params": {"share": 0.25}}
    accepted = client.post("/v1/merges", json=body)
    refused = client.post("/v1/merges", json={**body, "params": {"share": 2}})
    schema = client.get("/openapi.json").json()
    request = schema["paths"]["/v1/merges"]["post"]["requestBody"]["content"]["application/json"]
    return {
        "listed": listed.get("halfway"),
        "submitted": [accepted.status_code, accepted.json().get("request", {}).get("method")],
        "refused": [refused.status_code, refused.json()["error"]["details"].get("field")],
        "request_schemas": [ref["$ref"] for ref in request["schema"]["oneOf"]],
        "component": "HalfwayMerge" in schema["components"]["schemas"],
    }


def merged(work: Path, models: list[str]) -> dict[str, Any]:
    """A halfway merge run, against the soup of the same weights (the same linear terms)."""
    options = MergeOptions(durable=False)
    halfway = {"method": "halfway", "models": models, "params": {"share": 0.25}}
    soup = {"method": "soup", "models": models, "params": {"weights": [0.75, 0.25]}}
    outputs = []
    for name, recipe in (("halfway", halfway), ("soup", soup)):
        merge(parse_recipe(recipe), work / name, resolve=Path, options=options)
        shards = sorted((work / name).glob("*.safetensors"))
        outputs.append({k: v for shard in shards for k, v in load_file(shard).items()})
    ours, theirs = outputs
    return {"tensors": len(ours), "equal": ours.keys() == theirs.keys()
            and all(ours[k].equal(theirs[k]) for k in ours)}  # fmt: skip


def main(examples: Path, work: Path) -> dict[str, Any]:
    settings = app_settings(work, examples)
    settings.data_dir.mkdir(parents=True)
    upgrade(settings.database)
    models = [str(examples / "math"), str(examples / "swh")]
    docs = load("tables")
    # An app and the recipe schema made before the method is registered, as in a process that
    # used them first: what is made afterwards must know the method all the same.
    create_app(settings, executor=IdleExecutor())
    parse_recipe({"method": "soup", "models": models})
    register(HALFWAY)
    report: dict[str, Any] = {"parsed": recipe_to_dict(parse_recipe(
        {"method": "halfway", "models": models, "params": {"share": 0.25}}))}  # fmt: skip
    try:
        parse_recipe({"method": "halfway", "models": models, "params": {"share": 2}})
    except RecipeError as e:
        report["parse_refused"] = e.details["field"]
    report |= served(settings, models)
    row = [line for line in docs.methods_table().splitlines() if line.startswith("| `halfway`")]
    report["docs_row"] = row[0] if row else None
    config = {"merge_method": "halfway_mix", "models": [{"model": m} for m in models],
              "parameters": {"share": 0.75}}  # fmt: skip
    report["mergekit"] = recipe_to_dict(translate(config, is_local=lambda _: True).recipe)
    report["baseline"] = Baseline(method="halfway").method
    report["merged"] = merged(work, models)
    return report


if __name__ == "__main__":
    work = Path(sys.argv[2])
    (work / "report.json").write_text(json.dumps(main(Path(sys.argv[1]), work)))
