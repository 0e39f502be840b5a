"""Fuzzing the live server from its own /openapi.json: no body gets a 5xx.

Two bounded, deterministic runs against the limited server (small limits keep each accepted request short):
hypothesis bodies built from the request schemas, some with one field replaced by arbitrary JSON; and schemathesis
(positive and negative cases) over every operation of the document."""

import httpx
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import serve_helpers as H

AUTH = {"Authorization": f"Bearer {H.API_KEY}"}
BOUNDED = settings(max_examples=40, derandomize=True, deadline=None, database=None,
                   suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])

# JSON values: no NaN or infinity, which JSON cannot carry (the client would fail to encode the body)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
                    | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner,
                                                                                max_size=3), max_leaves=6)


@pytest.fixture(scope="module")
def srv():
    return H.limited_server()


@pytest.fixture(scope="module")
def document(srv):
    r = httpx.get(f"{srv.url}/openapi.json", headers=AUTH)
    assert r.status_code == 200
    return r.json()


def from_schema(schema: dict, components: dict, depth: int = 0) -> st.SearchStrategy:
    """Values valid for the JSON schema subset the document uses (refs, anyOf, const/enum, typed objects, arrays,
    strings, numbers); optional object properties are sometimes left out."""
    if "$ref" in schema:
        return from_schema(components[schema["$ref"].rsplit("/", 1)[1]], components, depth)
    if "anyOf" in schema:
        return st.one_of([from_schema(s, components, depth) for s in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        props = schema.get("properties", {})
        required = set(schema.get("required", ()))
        if not props:           # free-form (chat_template_kwargs): small JSON objects
            return st.dictionaries(st.text(max_size=6), JSON, max_size=2 if depth < 3 else 0)
        fields = {k: from_schema(v, components, depth + 1) for k, v in props.items()}
        chosen = st.sets(st.sampled_from(sorted(set(props) - required)), max_size=6) if set(props) - required \
            else st.just(set())
        return chosen.flatmap(lambda keys: st.fixed_dictionaries({k: fields[k] for k in required | keys}))
    if kind == "array":
        items = from_schema(schema.get("items", {}), components, depth + 1) if schema.get("items") else JSON
        return st.lists(items, min_size=schema.get("minItems", 0), max_size=min(schema.get("maxItems", 4), 4))
    if kind == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 12), 12))
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        lo, hi = schema.get("minimum", schema.get("exclusiveMinimum")), schema.get("maximum")
        return st.floats(lo, hi, exclude_min="exclusiveMinimum" in schema, allow_nan=False, allow_infinity=False)
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    return JSON


def _bodies(document: dict, component: str):
    components = document["components"]["schemas"]
    built = from_schema(components[component], components)
    mutated = st.tuples(built, st.text(max_size=24), JSON).map(lambda t: {**t[0], t[1]: t[2]})
    return st.one_of(built, mutated)


@pytest.mark.parametrize("route,component", [("/v1/completions", "CompletionRequest"),
                                             ("/v1/chat/completions", "ChatCompletionRequest")])
def test_no_body_from_the_schema_gets_a_5xx(srv, document, route, component):
    client = httpx.Client(headers=AUTH, timeout=60)
    seen = {"ok": 0, "refused": 0}

    @BOUNDED
    @given(_bodies(document, component))
    def run(body):
        r = client.post(f"{srv.url}{route}", json=body)
        assert r.status_code < 500, (body, r.text)
        if r.status_code >= 400:
            H.assert_error_shape(r, r.status_code, r.json()["error"]["param"])
            seen["refused"] += 1
        else:
            seen["ok"] += 1

    run()
    assert seen["ok"] > 0 and seen["refused"] > 0, seen
    assert client.post(f"{srv.url}/v1/completions", json={"prompt": "still fine", "max_tokens": 2}).status_code == 200


def test_schemathesis_finds_no_server_error(srv, document):
    import schemathesis
    from schemathesis.checks import not_a_server_error
    from schemathesis.specs.openapi.checks import content_type_conformance, status_code_conformance

    schema = schemathesis.openapi.from_dict(document)
    schema.config.generation.update(modes=[schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
    failures = []
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=15, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
        @given(operation.as_strategy())
        def run(case):
            response = case.call(base_url=srv.url, headers=AUTH)
            try:
                case.validate_response(response, checks=[not_a_server_error, status_code_conformance,
                                                         content_type_conformance])
            except Exception as e:   # collect every failure with its operation, then report them together
                failures.append(f"{operation.label}: {type(e).__name__}: {e}")

        run()
    assert not failures, "\n".join(failures[:5])
