"""Validates the Kubernetes manifests under deploy/ against the schemas the installed
packages publish: KServe's kinds against kserve.models (V1alpha1ServingRuntime,
V1beta1InferenceService: their openapi_types and attribute_map), the core kinds against
the `kubernetes` client's models (the same walk, then the model's own pydantic
validation). Every key must be one the schema names (a typo is an error), every value of
the type it gives, every required field present. Then what celer needs of them: v2
probes, a GPU, the flags that start it on 8080, an InferenceService naming a runtime and
model format defined here, a Service that selects the Deployment's pods.

  python scripts/check_manifests.py [FILE_OR_DIR ...]      (default: deploy/)
  python scripts/check_manifests.py --containers [...]     the containers as JSON
  python scripts/check_manifests.py --self-test            typos and wrong types caught

Exits 1 naming each error with its path in the document. Run by tests/deploy.rs.
"""

import copy
import inspect
import json
import re
import sys
from pathlib import Path

import kserve
import kserve.models
import kubernetes.client.models as k8s
import yaml

ROOT = Path(__file__).resolve().parent.parent

# (apiVersion, kind) -> the package's model of it.
KINDS = {
    ("serving.kserve.io/v1alpha1", "ServingRuntime"): kserve.V1alpha1ServingRuntime,
    ("serving.kserve.io/v1alpha1", "ClusterServingRuntime"): kserve.V1alpha1ClusterServingRuntime,
    ("serving.kserve.io/v1beta1", "InferenceService"): kserve.V1beta1InferenceService,
    ("apps/v1", "Deployment"): k8s.V1Deployment,
    ("v1", "Service"): k8s.V1Service,
    ("v1", "PersistentVolumeClaim"): k8s.V1PersistentVolumeClaim,
}

LIST = re.compile(r"^(?:list|List)\[(.+)\]$")
DICT = re.compile(r"^(?:dict\(str, (.+)\)|Dict\[str, (.+)\])$")


def model_class(name):
    for module in (kserve.models, k8s):
        cls = getattr(module, name, None)
        if cls is not None and hasattr(cls, "openapi_types"):
            return cls
    return None


def required_fields(cls):
    """The attributes the model refuses to be without: a pydantic model's required
    fields (the kubernetes client), or those whose generated setter refuses None
    (kserve's OpenAPI models)."""
    if hasattr(cls, "model_fields"):
        return {a for a, f in cls.model_fields.items() if f.is_required()}
    required = set()
    for attr in cls.openapi_types:
        prop = getattr(cls, attr, None)
        if isinstance(prop, property) and prop.fset is not None:
            if "must not be `None`" in inspect.getsource(prop.fset):
                required.add(attr)
    return required


def check(value, schema, path, errors):
    """Appends to `errors` what in `value` does not fit the schema type `schema`."""
    if schema == "object":
        return  # int-or-string, raw extensions: any JSON value
    if schema == "str":
        if not isinstance(value, str):
            errors.append(f"{path}: expected a string, got {type(value).__name__} {value!r}")
        return
    if schema == "int":
        if not isinstance(value, int) or isinstance(value, bool):
            errors.append(f"{path}: expected an integer, got {type(value).__name__} {value!r}")
        return
    if schema == "float":
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            errors.append(f"{path}: expected a number, got {type(value).__name__} {value!r}")
        return
    if schema == "bool":
        if not isinstance(value, bool):
            errors.append(f"{path}: expected true or false, got {type(value).__name__} {value!r}")
        return
    if schema in ("datetime", "date"):
        if not isinstance(value, str) and not hasattr(value, "isoformat"):
            errors.append(f"{path}: expected a timestamp, got {value!r}")
        return
    if m := LIST.match(schema):
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        for i, item in enumerate(value):
            check(item, m.group(1), f"{path}[{i}]", errors)
        return
    if m := DICT.match(schema):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected a map, got {type(value).__name__}")
            return
        for key, item in value.items():
            if not isinstance(key, str):
                errors.append(f"{path}: key {key!r} is not a string")
            check(item, m.group(1) or m.group(2), f"{path}.{key}", errors)
        return
    cls = model_class(schema)
    if cls is None:
        errors.append(
            f"{path}: the schema's type {schema} is in neither kserve.models nor kubernetes.client"
        )
        return
    if not isinstance(value, dict):
        errors.append(f"{path}: expected a {schema} object, got {type(value).__name__}")
        return
    by_key = {key: attr for attr, key in cls.attribute_map.items()}
    for key, item in value.items():
        attr = by_key.get(key)
        if attr is None:
            near = [k for k in by_key if k.lower() == str(key).lower()]
            hint = f" (did you mean {near[0]}?)" if near else ""
            errors.append(f"{path}.{key}: {schema} has no field {key!r}{hint}")
            continue
        check(item, cls.openapi_types[attr], f"{path}.{key}", errors)
    for attr in sorted(required_fields(cls)):
        if value.get(cls.attribute_map[attr]) is None:
            errors.append(f"{path}: {schema} requires {cls.attribute_map[attr]!r}")


def validate(doc, where):
    """The schema errors of one document."""
    if not isinstance(doc, dict):
        return [f"{where}: not a mapping"]
    cls = KINDS.get((doc.get("apiVersion"), doc.get("kind")))
    if cls is None:
        known = ", ".join(f"{v} {k}" for v, k in KINDS)
        return [
            f"{where}: {doc.get('apiVersion')} {doc.get('kind')} is not a kind checked here ({known})"
        ]
    errors = []
    check(doc, cls.__name__, where, errors)
    if not (doc.get("metadata") or {}).get("name"):
        errors.append(f"{where}.metadata: a name is required")
    if "spec" not in doc:
        errors.append(f"{where}: no spec")
    if not errors and hasattr(cls, "model_validate"):
        # The kubernetes client's own validation too (pydantic: extra keys forbidden,
        # strict strings), as a second opinion on the walk above.
        try:
            cls.model_validate(doc)
        except Exception as e:  # pydantic.ValidationError
            errors.append(f"{where}: {cls.__name__}: {e}")
    return errors


def load(paths):
    """(where, document) for every YAML document in the files and folders given."""
    files = []
    for p in paths:
        p = Path(p)
        files += sorted(p.rglob("*.yaml")) + sorted(p.rglob("*.yml")) if p.is_dir() else [p]
    docs = []
    for f in files:
        shown = f.resolve().relative_to(ROOT) if ROOT in f.resolve().parents else f
        for i, doc in enumerate(yaml.safe_load_all(f.read_text())):
            if doc is not None:
                kind = doc.get("kind") if isinstance(doc, dict) else None
                docs.append((f"{shown}#{i}({kind})", doc))
    return files, docs


def containers(docs):
    """(where, kind, owner, container) of every container a document runs."""
    out = []
    for where, doc in docs:
        kind, spec = doc.get("kind"), doc.get("spec") or {}
        if kind in ("ServingRuntime", "ClusterServingRuntime"):
            pod = spec
        elif kind == "Deployment":
            pod = (spec.get("template") or {}).get("spec") or {}
        else:
            continue
        for c in pod.get("containers") or []:
            out.append((where, kind, doc["metadata"]["name"], c))
    return out


def flag(args, name):
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return values[0] if len(values) == 1 else None


def celer_requirements(docs):
    """What celer needs of the manifests beyond their schemas."""
    errors = []
    runtimes = {
        d["metadata"]["name"]: d
        for _, d in docs
        if d["kind"] in ("ServingRuntime", "ClusterServingRuntime")
    }
    for where, kind, _, c in containers(docs):
        args = c.get("args") or []
        if args[:1] != ["serve"]:
            errors.append(
                f"{where}: container {c['name']}: args start with `serve` (the image's entrypoint is `celer`)"
            )
        for name, want in (("bind", "0.0.0.0"), ("port", "8080")):
            if flag(args, name) != want:
                errors.append(
                    f"{where}: container {c['name']}: --{name}={want} expected once in args"
                )
        if flag(args, "model-dir") is None:
            errors.append(f"{where}: container {c['name']}: --model-dir=... expected once in args")
        if 8080 not in [p.get("containerPort") for p in c.get("ports") or []]:
            errors.append(f"{where}: container {c['name']}: containerPort 8080 expected")
        for probe, path in (
            ("readinessProbe", "/v2/health/ready"),
            ("livenessProbe", "/v2/health/live"),
        ):
            got = ((c.get(probe) or {}).get("httpGet") or {}).get("path")
            if got != path:
                errors.append(
                    f"{where}: container {c['name']}: {probe} on {path} expected, got {got}"
                )
        res = c.get("resources") or {}
        for part in ("requests", "limits"):
            if (res.get(part) or {}).get("nvidia.com/gpu") is None:
                errors.append(
                    f"{where}: container {c['name']}: resources.{part} has no nvidia.com/gpu"
                )
    for where, d in docs:
        if d["kind"] in ("ServingRuntime", "ClusterServingRuntime"):
            if "v2" not in (d["spec"].get("protocolVersions") or []):
                errors.append(f"{where}: protocolVersions does not include v2")
        if d["kind"] == "InferenceService":
            model = (d["spec"].get("predictor") or {}).get("model") or {}
            runtime = runtimes.get(model.get("runtime"))
            if runtime is None:
                errors.append(
                    f"{where}: runtime {model.get('runtime')!r} is not a ServingRuntime under deploy/"
                )
                continue
            formats = [f.get("name") for f in runtime["spec"].get("supportedModelFormats") or []]
            if (model.get("modelFormat") or {}).get("name") not in formats:
                errors.append(
                    f"{where}: modelFormat is not one of runtime {model.get('runtime')}'s {formats}"
                )
            if model.get("protocolVersion") != "v2":
                errors.append(f"{where}: protocolVersion v2 expected")
        if d["kind"] == "Service":
            selector = d["spec"].get("selector") or {}
            pods = [
                (dep["spec"]["template"]["metadata"].get("labels") or {})
                for _, dep in docs
                if dep["kind"] == "Deployment"
            ]
            if not any(selector.items() <= labels.items() for labels in pods):
                errors.append(f"{where}: selector {selector} matches no Deployment's pods")
    return errors


def errors_of(paths):
    files, docs = load(paths)
    if not docs:
        return [f"no manifests in {', '.join(map(str, paths))}"], docs
    errors = [e for where, doc in docs for e in validate(doc, where)]
    if not errors:
        errors = celer_requirements(docs)
    return errors, docs


def self_test(paths):
    """Each mutation of a valid manifest must be refused: a typo in a key at the top,
    in a nested KServe field and in a core field inside it; a wrong type; a required
    field removed. Proves the check above can fail."""
    _, docs = load(paths)
    by_kind = {d["kind"]: d for _, d in docs}

    def rename(d, path, new):
        *parents, last = path
        for p in parents:
            d = d[p]
        d[new] = d.pop(last)

    def setv(d, path, value):
        *parents, last = path
        for p in parents:
            d = d[p]
        d[last] = value

    def delete(d, path):
        *parents, last = path
        for p in parents:
            d = d[p]
        del d[last]

    c0 = ("spec", "containers", 0)
    cases = [
        (
            "ServingRuntime",
            "spec key typo",
            lambda d: rename(d, ("spec", "supportedModelFormats"), "supportedModelFormat"),
        ),
        (
            "ServingRuntime",
            "container key typo",
            lambda d: rename(d, c0 + ("readinessProbe",), "readinesProbe"),
        ),
        (
            "ServingRuntime",
            "probe key typo",
            lambda d: rename(d, c0 + ("livenessProbe", "httpGet"), "httpget"),
        ),
        (
            "ServingRuntime",
            "bool as string",
            lambda d: setv(d, ("spec", "supportedModelFormats", 0, "autoSelect"), "true"),
        ),
        (
            "ServingRuntime",
            "quantity as a number",
            lambda d: setv(d, c0 + ("resources", "limits", "nvidia.com/gpu"), 1),
        ),
        ("ServingRuntime", "containers removed", lambda d: delete(d, ("spec", "containers"))),
        (
            "InferenceService",
            "predictor key typo",
            lambda d: rename(d, ("spec", "predictor", "model", "storageUri"), "storageURI"),
        ),
        (
            "InferenceService",
            "int as string",
            lambda d: setv(d, ("spec", "predictor", "minReplicas"), "1"),
        ),
        ("InferenceService", "top-level typo", lambda d: rename(d, ("metadata",), "metdata")),
        (
            "Deployment",
            "pod spec key typo",
            lambda d: rename(d, ("spec", "template", "spec", "containers"), "container"),
        ),
        (
            "Deployment",
            "container name removed",
            lambda d: delete(d, ("spec", "template", "spec", "containers", 0, "name")),
        ),
        (
            "Deployment",
            "port as a list",
            lambda d: setv(
                d,
                ("spec", "template", "spec", "containers", 0, "ports", 0, "containerPort"),
                [8080],
            ),
        ),
        (
            "Service",
            "port key typo",
            lambda d: rename(d, ("spec", "ports", 0, "targetPort"), "target_port"),
        ),
        ("Service", "port removed", lambda d: delete(d, ("spec", "ports", 0, "port"))),
    ]
    failed = []
    for kind, what, mutate in cases:
        if kind not in by_kind:
            failed.append(f"{kind}: not under deploy/, cannot mutate it ({what})")
            continue
        doc = copy.deepcopy(by_kind[kind])
        mutate(doc)
        errors = validate(doc, kind)
        if errors:
            print(f"self-test: {kind} {what}: refused: {errors[0]}")
        else:
            failed.append(f"{kind} {what}: accepted")
    # And the valid ones pass, so that the refusals above are the mutations' doing.
    for where, doc in docs:
        failed += validate(doc, where)
    return failed


def main():
    argv = sys.argv[1:]
    mode = argv.pop(0) if argv and argv[0].startswith("--") else None
    paths = argv or [ROOT / "deploy"]
    if mode == "--self-test":
        failed = self_test(paths)
        for f in failed:
            print(f"self-test FAILED: {f}", file=sys.stderr)
        sys.exit(1 if failed else 0)
    errors, docs = errors_of(paths)
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    if errors:
        sys.exit(1)
    if mode == "--containers":
        isvc = {
            d["spec"]["predictor"]["model"]["runtime"]: d["metadata"]["name"]
            for _, d in docs
            if d["kind"] == "InferenceService"
        }
        print(
            json.dumps(
                [
                    {
                        "where": where,
                        "kind": kind,
                        # KServe replaces {{.Name}} with the InferenceService's name.
                        "args": [
                            a.replace("{{.Name}}", isvc.get(owner, owner))
                            for a in c.get("args") or []
                        ],
                        "env": {e["name"]: e["value"] for e in c.get("env") or [] if "value" in e},
                        "probes": [
                            c[p]["httpGet"]["path"] for p in ("readinessProbe", "livenessProbe")
                        ],
                    }
                    for where, kind, owner, c in containers(docs)
                ]
            )
        )
        return
    elif mode is not None:
        sys.exit(f"unknown option {mode}")
    print(
        f"check_manifests: {len(docs)} manifests valid ({', '.join(sorted({d['kind'] for _, d in docs}))})"
    )


if __name__ == "__main__":
    main()
