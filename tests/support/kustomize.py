"""The subset of kustomize that deploy/kubernetes uses, rendered in Python for the tests.

No kustomize or kubectl binary comes from PyPI, and the tests must run without one. This renders
the fields our kustomizations use (resources, namespace, images, replicas, secretGenerator from
files with fixed names, strategic-merge patches from files) and refuses any other, so that a
kustomization growing past it fails here instead of rendering differently from kustomize.
tests/test_kubernetes.py compares it with `kubectl kustomize` wherever kubectl is installed.
"""
from __future__ import annotations

import base64
import copy
from pathlib import Path

import yaml

SUPPORTED = {"apiVersion", "kind", "namespace", "resources", "images", "replicas", "secretGenerator",
             "generatorOptions", "patches"}
# Strategic merge: the lists of built-in kinds that merge element-wise, and by which key (the
# x-kubernetes-patch-merge-key of the Kubernetes API). Other lists, and every list of a custom
# resource, are replaced whole, as kustomize does.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "volumeMounts": "mountPath",
              "env": "name", "ports": "containerPort"}
BUILT_IN_GROUPS = {"v1", "apps/v1", "networking.k8s.io/v1", "batch/v1", "policy/v1"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume"}


def render(directory: Path) -> list[dict]:
    """Every resource the kustomization in `directory` produces, as kustomize build would."""
    k = yaml.safe_load((directory / "kustomization.yaml").read_text())
    unknown = set(k) - SUPPORTED
    if unknown:
        raise NotImplementedError(f"{directory}: kustomization fields beyond the tests' renderer: {sorted(unknown)}")
    objects: list[dict] = []
    for entry in k.get("resources", []):
        path = directory / entry
        objects += render(path) if path.is_dir() else _load_all(path)
    objects += _generate_secrets(directory, k)
    for patch_entry in k.get("patches", []):
        if set(patch_entry) != {"path"}:
            raise NotImplementedError(f"{directory}: only `patches: - path:` is rendered here")
        for patch in _load_all(directory / patch_entry["path"]):
            target = _find(objects, patch["kind"], patch["metadata"]["name"])
            target.update(_merge(target, patch, built_in=patch["apiVersion"] in BUILT_IN_GROUPS))
    for image in k.get("images", []):
        _set_image(objects, image)
    for replicas in k.get("replicas", []):
        _find_named(objects, replicas["name"])["spec"]["replicas"] = replicas["count"]
    if "namespace" in k:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = k["namespace"]
    return objects


def _load_all(path: Path) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _generate_secrets(directory: Path, k: dict) -> list[dict]:
    generators = k.get("secretGenerator", [])
    if generators and not k.get("generatorOptions", {}).get("disableNameSuffixHash"):
        raise NotImplementedError("name suffix hashes are not rendered here: set disableNameSuffixHash")
    secrets = []
    for gen in generators:
        if set(gen) - {"name", "files"}:
            raise NotImplementedError(f"secretGenerator {gen['name']}: only `files` is rendered here")
        data = {}
        for item in gen["files"]:
            key, _, rel = item.partition("=")
            data[key] = base64.b64encode((directory / rel).read_bytes()).decode()
        secrets.append({"apiVersion": "v1", "kind": "Secret", "metadata": {"name": gen["name"]},
                        "type": "Opaque", "data": data})
    return secrets


def _merge(base, patch, built_in: bool, field: str = ""):
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for key, value in patch.items():
            out[key] = _merge(base[key], value, built_in, key) if key in base else copy.deepcopy(value)
        return out
    key = MERGE_KEYS.get(field) if built_in else None
    if key and isinstance(base, list) and isinstance(patch, list):
        by_key = {old.get(key): old for old in base}
        # kustomize's order: the patch's elements (merged into their namesakes), then the rest
        first = [_merge(by_key[item.get(key)], item, built_in) if item.get(key) in by_key else copy.deepcopy(item)
                 for item in patch]
        patched = {item.get(key) for item in patch}
        return first + [copy.deepcopy(old) for old in base if old.get(key) not in patched]
    return copy.deepcopy(patch)


def _set_image(objects: list[dict], image: dict) -> None:
    for obj in objects:
        pod = obj.get("spec", {}).get("template", {}).get("spec", {})
        for container in pod.get("containers", []) + pod.get("initContainers", []):
            if container["image"].split(":")[0] == image["name"]:
                container["image"] = f"{image.get('newName', image['name'])}:{image['newTag']}"


def _find(objects: list[dict], kind: str, name: str) -> dict:
    hits = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    if len(hits) != 1:
        raise LookupError(f"patch target {kind}/{name}: {len(hits)} matches")
    return hits[0]


def _find_named(objects: list[dict], name: str) -> dict:
    hits = [o for o in objects if o["metadata"]["name"] == name and "replicas" in o.get("spec", {})]
    if len(hits) != 1:
        raise LookupError(f"replicas target {name}: {len(hits)} matches")
    return hits[0]
