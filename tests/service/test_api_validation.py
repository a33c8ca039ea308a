"""Every client mistake is a 4xx with one JSON shape, `{"error": {"code", "message",
"details"}}`, naming the field; nothing is queued. On SQLite and on PostgreSQL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.service.conftest import Service, layer_swap, postgres_database, running_service


@pytest.fixture(scope="module", params=["sqlite", "postgres"])
def api(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, examples: Path
) -> Iterator[Service]:
    """One service per store for the whole module: these tests only read, or fail to write."""
    root = tmp_path_factory.mktemp(f"validation-{request.param}")
    if request.param == "sqlite":
        with running_service(root, f"sqlite:///{root / 'layerswap.db'}", examples) as running:
            yield running
    else:
        with postgres_database() as url, running_service(root, url, examples) as running:
            yield running


def error_of(response: Any, status: int = 422) -> dict[str, Any]:
    """The error body, checked for the one shape every error has."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"code", "message", "details"}
    assert isinstance(error["code"], str) and error["code"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["details"], dict)
    assert "Traceback" not in error["message"]
    return dict(error)


def job_count(api: Service) -> int:
    items = api.client.get("/v1/merges", params={"limit": 200}).json()["items"]
    return len(items)


def soup(**params: Any) -> dict[str, Any]:
    return {"method": "soup", "models": ["math", "swh"], "params": params}


def ties(**params: Any) -> dict[str, Any]:
    return {"method": "ties", "base": "base", "models": ["math", "swh"], "params": params}


def with_(body: dict[str, Any], **top: Any) -> dict[str, Any]:
    return {**body, **top}


INVALID_RECIPES: list[tuple[str, Any, str]] = [
    ("unknown top-level key", with_(layer_swap(), colour="blue"), "colour"),
    ("unknown param", layer_swap(unknown=1), "params.unknown"),
    (
        "unknown key in experts",
        with_(layer_swap(), experts={"task": ["math"], "language": ["swh"], "code": ["math"]}),
        "experts.code",
    ),
    ("unknown method", with_(layer_swap(), method="frankenmerge"), "method"),
    ("method missing", {"models": ["math", "swh"]}, "method"),
    ("method not a string", with_(soup(), method=3), "method"),
    ("ties without base", {"method": "ties", "models": ["math"]}, "base"),
    ("task_arithmetic without base", {"method": "task_arithmetic", "models": ["math"]}, "base"),
    ("density above 1", ties(density=1.5), "params.density"),
    ("density zero", ties(density=0), "params.density"),
    ("density negative", ties(density=-0.1), "params.density"),
    ("density not a number", ties(density="half"), "params.density"),
    ("soup weights too short", soup(weights=[1.0]), "params.weights"),
    ("soup weights too long", soup(weights=[1.0, 1.0, 1.0]), "params.weights"),
    ("soup weights summing to zero", soup(weights=[1.0, -1.0]), "params.weights"),
    ("ties weights too short", ties(weights=[1.0]), "params.weights"),
    (
        "task arithmetic weights length",
        {
            "method": "task_arithmetic",
            "base": "base",
            "models": ["math"],
            "params": {"weights": []},
        },
        "params.weights",
    ),
    ("soup of one model", {"method": "soup", "models": ["math"]}, "models"),
    ("negative bottom", layer_swap(bottom=-1), "params.bottom"),
    ("bottom not an integer", layer_swap(bottom="five"), "params.bottom"),
    ("bad non_layer choice", layer_swap(non_layer="both"), "params.non_layer"),
    (
        "magnitude transition weights without base",
        layer_swap(transition_weights="magnitude"),
        "base",
    ),
    (
        "no task experts",
        with_(layer_swap(), experts={"task": [], "language": ["swh"]}),
        "experts.task",
    ),
    ("empty source path", with_(soup(), models=["", "swh"]), "models.0"),
    ("output.name with a slash", with_(layer_swap(), output={"name": "a/b"}), "output.name"),
    ("output.name with ..", with_(layer_swap(), output={"name": "../evil"}), "output.name"),
    ("output.name hidden", with_(layer_swap(), output={"name": ".hidden"}), "output.name"),
    ("output.name empty", with_(layer_swap(), output={"name": ""}), "output.name"),
    ("output.name too long", with_(layer_swap(), output={"name": "n" * 101}), "output.name"),
    ("output.dtype unknown", with_(layer_swap(), output={"dtype": "int8"}), "output.dtype"),
    ("output.shard_size", with_(layer_swap(), output={"shard_size": "huge"}), "output.shard_size"),
    ("unknown output option", with_(layer_swap(), output={"format": "gguf"}), "output.format"),
    (
        "33 task experts",
        with_(layer_swap(), experts={"task": ["math"] * 33, "language": ["swh"]}),
        "experts.task",
    ),
    ("65 models in a soup", with_(soup(), models=["math"] * 65), "models"),
    (
        "slerp of three",
        {"method": "slerp", "models": ["a", "b", "c"], "params": {"t": 0.5}},
        "models",
    ),
    (
        "passthrough slice of a model not among the inputs",
        {
            "method": "passthrough",
            "models": ["a"],
            "params": {"slices": [{"sources": [{"model": "b", "layer_range": [0, 2]}]}]},
        },
        "params.slices.0.sources.0.model",
    ),
    (
        "tokenizer_source naming no input",
        with_(soup(), tokenizer_source="./elsewhere"),
        "tokenizer_source",
    ),
    ("tokenizer_source empty", with_(layer_swap(), tokenizer_source=""), "tokenizer_source"),
    (
        "linear weight count",
        {"method": "linear", "models": ["a", "b"], "params": {"weights": [1.0]}},
        "params.weights",
    ),
    (
        "dare_ties density out of range",
        {
            "method": "dare_ties",
            "base": "base",
            "models": ["a", "b"],
            "params": {"density": [0.5, 1.5]},
        },
        "params.density.1",
    ),
    (
        "della density ± epsilon outside (0, 1)",
        {
            "method": "della",
            "base": "base",
            "models": ["a"],
            "params": {"density": 0.9, "epsilon": 0.2},
        },
        "params.epsilon",
    ),
    ("breadcrumbs without base", {"method": "breadcrumbs", "models": ["a", "b"]}, "base"),
    (
        "65 task-arithmetic weights",
        {
            "method": "task_arithmetic",
            "base": "base",
            "models": ["math"],
            "params": {"weights": [1.0] * 65},
        },
        "params.weights",
    ),
]


@pytest.mark.parametrize(
    ("body", "field"),
    [case[1:] for case in INVALID_RECIPES],
    ids=[case[0] for case in INVALID_RECIPES],
)
def test_invalid_recipe_is_422_naming_the_field(api: Service, body: Any, field: str) -> None:
    before = job_count(api)
    error = error_of(api.client.post("/v1/merges", json=body))
    assert error["code"] == "invalid_request"
    assert error["details"]["field"] == field
    assert error["message"].startswith(f"{field}:"), error["message"]
    assert job_count(api) == before, "an invalid recipe must not be queued"


@pytest.mark.parametrize(
    ("content", "content_type"),
    [
        (b"{not json", "application/json"),
        (b'{"method": "soup", "models": ["math", "swh"]', "application/json"),
        (b"\xff\xfe\x00", "application/json"),
        (b"", "application/json"),
        (b"[1, 2]", "application/json"),
        (b'"soup"', "application/json"),
        (b"null", "application/json"),
    ],
    # (YAML, or any body not sent as application/json, is a 415: test_api_security.py)
    ids=["garbage", "truncated", "not utf-8", "empty", "array", "string", "null"],
)
def test_body_that_is_not_a_json_object_is_422_naming_the_body(
    api: Service, content: bytes, content_type: str
) -> None:
    before = job_count(api)
    response = api.client.post(
        "/v1/merges", content=content, headers={"content-type": content_type}
    )
    error = error_of(response)
    assert error["code"] == "invalid_request"
    assert error["details"]["field"] == "body"
    assert job_count(api) == before


def test_sources_outside_the_allowed_roots_are_422(api: Service, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    link = api.checkpoints / f"escape-{tmp_path.name}"
    link.symlink_to(outside, target_is_directory=True)
    nested = api.checkpoints / f"nested-{tmp_path.name}"
    nested.mkdir()
    (nested / "up").symlink_to(api.checkpoints.parent.parent, target_is_directory=True)
    escapes = [
        "..",
        "../..",
        "math/../../..",
        f"../../{tmp_path.name}",
        str(outside),
        "/etc",
        link.name,
        f"{nested.name}/up",
        "https://example.com/model",
        "s3://bucket/model",
    ]
    before = job_count(api)
    for source in escapes:
        bodies = {
            "experts.task.0": with_(layer_swap(), experts={"task": [source], "language": ["swh"]}),
            "experts.language.1": with_(
                layer_swap(), experts={"task": ["math"], "language": ["swh", source]}
            ),
            "models.1": with_(soup(), models=["math", source]),
            "base": with_(ties(), base=source),
        }
        for field, body in bodies.items():
            error = error_of(api.client.post("/v1/merges", json=body))
            assert error["code"] == "source_not_allowed", (source, error)
            assert error["details"]["field"] == field, (source, error)
    assert job_count(api) == before


def test_header_checks_run_at_submit(api: Service, tmp_path: Path) -> None:
    """What the checkpoints' headers decide (7 of 6 layers asked for, an architecture that does
    not match, a tensor missing) is a 422 at submit: no job, nothing written."""
    import json
    import shutil

    before = job_count(api)
    too_many = layer_swap(bottom=3, top=2, bottom_transition=1, top_transition=1)
    error = error_of(api.client.post("/v1/merges", json=too_many))
    assert error["code"] == "invalid_recipe" and error["details"]["field"] == "params"
    assert error["message"].startswith("params:")
    assert "7" in error["message"] and "6" in error["message"]  # asked for 7 of 6 layers

    other = api.checkpoints / f"qwen-{tmp_path.name}"
    shutil.copytree(api.checkpoints / "swh", other)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "qwen2"}))
    error = error_of(api.client.post("/v1/merges", json=with_(soup(), models=["math", other.name])))
    assert error["code"] == "incompatible_checkpoints", error

    partial = api.checkpoints / f"partial-{tmp_path.name}"
    shutil.copytree(api.checkpoints / "swh", partial)
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(partial / "model.safetensors"))
    tensors.pop("model.norm.weight")
    save_file(tensors, str(partial / "model.safetensors"), metadata={"format": "pt"})
    error = error_of(
        api.client.post("/v1/merges", json=with_(soup(), models=["math", partial.name]))
    )
    assert error["code"] == "incompatible_checkpoints" and "model.norm.weight" in error["message"]
    assert job_count(api) == before


def test_unusable_source_paths_are_422_naming_the_field(api: Service) -> None:
    """A name too long for the filesystem, a path through a file: the OS refuses; a 422."""
    before = job_count(api)
    for source in ["x" * 5000, "a/" * 3000 + "b", "math/config.json/more"]:
        body = with_(soup(), models=["math", source])
        error = error_of(api.client.post("/v1/merges", json=body))
        assert error["code"] in {"source_not_allowed", "source_not_found"}, (source[:20], error)
        assert error["details"]["field"] == "models.1"
    assert job_count(api) == before


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", "/v1/merges/{id}"),
        ("POST", "/v1/merges/{id}/cancel"),
        ("GET", "/v1/merges/{id}/events"),
        ("GET", "/v1/analyses/{id}"),
        ("GET", "/v1/analyses/{id}/heatmap.png"),
        ("GET", "/v1/artifacts/{id}"),
        ("GET", "/v1/artifacts/{id}/lineage"),
    ],
)
def test_unknown_ids_are_404_json(api: Service, method: str, path: str) -> None:
    for unknown in ["0" * 32, "no-such-job", "%E2%98%83"]:
        response = api.client.request(method, path.format(id=unknown))
        error = error_of(response, 404)
        assert error["code"] == "not_found"


def test_unknown_ids_of_the_other_kind_are_404(api: Service) -> None:
    """A merge is not an analysis and the other way round."""
    merge = api.submit(layer_swap())
    assert api.client.get(f"/v1/analyses/{merge['id']}").status_code == 404
    analysis = api.client.post(
        "/v1/analyses", json={"base": "base", "experts": [{"label": "math", "path": "math"}]}
    )
    assert analysis.status_code == 202, analysis.text
    analysis_id = analysis.json()["id"]
    assert error_of(api.client.get(f"/v1/merges/{analysis_id}"), 404)["code"] == "not_found"
    assert api.client.post(f"/v1/merges/{analysis_id}/cancel").status_code == 404
    api.wait(merge["id"])
    api.wait(analysis_id, kind="analyses")


@pytest.mark.parametrize(
    ("method", "path", "status", "code"),
    [
        ("GET", "/", 404, "not_found"),
        ("GET", "/nope", 404, "not_found"),
        ("GET", "/v1", 404, "not_found"),
        ("GET", "/v1/nope", 404, "not_found"),
        ("POST", "/v1/nope", 404, "not_found"),
        ("GET", "/v1/merges/x/y/z", 404, "not_found"),
        ("GET", "/v2/merges", 404, "not_found"),
        ("DELETE", "/v1/merges", 405, "method_not_allowed"),
        ("PUT", "/v1/methods", 405, "method_not_allowed"),
        ("GET", "/v1/merges/x/cancel", 405, "method_not_allowed"),
    ],
)
def test_unknown_routes_answer_json_never_html(
    api: Service, method: str, path: str, status: int, code: str
) -> None:
    response = api.client.request(method, path, headers={"Accept": "text/html"})
    assert "<html" not in response.text.lower()
    assert error_of(response, status)["code"] == code


@pytest.mark.parametrize(
    ("params", "field"),
    [
        ({"status": "done"}, "status"),
        ({"limit": 0}, "limit"),
        ({"limit": 201}, "limit"),
        ({"limit": "ten"}, "limit"),
        ({"cursor": "not-a-cursor"}, "cursor"),
        ({"cursor": "WzEsMl0="}, "cursor"),  # base64 of [1,2]: decodes, but is no cursor
        ({"input_artifact": "a", "output_artifact": "b"}, "output_artifact"),
    ],
)
def test_bad_list_parameters_are_422(api: Service, params: dict[str, Any], field: str) -> None:
    error = error_of(api.client.get("/v1/merges", params=params))
    assert error["code"] == "invalid_request"
    assert error["details"]["field"] == field


def test_bad_headers_and_query_parameters_name_them(api: Service) -> None:
    error = error_of(
        api.client.post("/v1/merges", json=soup(), headers={"Idempotency-Key": "k" * 201})
    )
    assert error["details"]["field"] == "idempotency-key"
    job = api.submit(soup())
    error = error_of(
        api.client.get(f"/v1/merges/{job['id']}/events", headers={"Last-Event-ID": "latest"})
    )
    assert error["details"]["field"] == "last-event-id"
    error = error_of(api.client.get(f"/v1/merges/{job['id']}/events", params={"after": -1}))
    assert error["details"]["field"] == "after"
    error = error_of(api.client.get("/v1/artifacts/x/lineage", params={"direction": "sideways"}))
    assert error["details"]["field"] == "direction"
    api.wait(job["id"])


def analysis(**body: Any) -> dict[str, Any]:
    return {"base": "base", "experts": [{"label": "math", "path": "math"}], **body}


INVALID_ANALYSES: list[tuple[str, Any, str]] = [
    ("no base", {"experts": [{"label": "math", "path": "math"}]}, "base"),
    ("empty base", analysis(base=""), "base"),
    ("no experts", {"base": "base"}, "experts"),
    ("empty experts", analysis(experts=[]), "experts"),
    (
        "too many experts",
        analysis(experts=[{"label": f"e{i}", "path": "math"} for i in range(17)]),
        "experts",
    ),
    ("expert without path", analysis(experts=[{"label": "math"}]), "experts.0.path"),
    (
        "expert with empty label",
        analysis(experts=[{"label": "", "path": "math"}]),
        "experts.0.label",
    ),
    (
        "expert label too long",
        analysis(experts=[{"label": "l" * 65, "path": "math"}]),
        "experts.0.label",
    ),
    (
        "unknown expert key",
        analysis(experts=[{"label": "m", "path": "math", "w": 1}]),
        "experts.0.w",
    ),
    ("unknown key", analysis(method="soup"), "method"),
    ("negative threshold", analysis(threshold=-0.5), "threshold"),
    ("threshold not a number", analysis(threshold="auto"), "threshold"),
]


@pytest.mark.parametrize(
    ("body", "field"),
    [case[1:] for case in INVALID_ANALYSES],
    ids=[case[0] for case in INVALID_ANALYSES],
)
def test_invalid_analysis_is_422_naming_the_field(api: Service, body: Any, field: str) -> None:
    error = error_of(api.client.post("/v1/analyses", json=body))
    assert error["code"] == "invalid_request"
    assert error["details"]["field"] == field
    assert error["message"].startswith(f"{field}:"), error["message"]


def test_analysis_body_and_sources_are_checked(api: Service, tmp_path: Path) -> None:
    response = api.client.post(
        "/v1/analyses", content=b"{", headers={"content-type": "application/json"}
    )
    assert error_of(response)["details"]["field"] == "body"
    for body, field in [
        (analysis(base="../.."), "base"),
        (analysis(base=str(tmp_path)), "base"),
        (
            analysis(experts=[{"label": "m", "path": "math"}, {"label": "x", "path": "/etc"}]),
            "experts.1.path",
        ),
    ]:
        error = error_of(api.client.post("/v1/analyses", json=body))
        assert error["code"] == "source_not_allowed"
        assert error["details"]["field"] == field
