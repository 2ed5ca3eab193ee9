"""Reading a config: a YAML file (YAML 1.1's base-60 numbers left as text, a key given twice refused) and
`key=value` overrides."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

from meshtune.errors import ConfigError


class _Loader(yaml.SafeLoader):
    """YAML 1.1 reads `1:4` as the base-60 integer 64; here it stays the text an elastic `nnodes: 1:4` means."""


_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if not (tag.endswith(":int") or tag.endswith(":float"))]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
for _tag, _pattern in (("tag:yaml.org,2002:int", r"^[-+]?(?:0|[1-9][0-9_]*|0x[0-9a-fA-F_]+|0o?[0-7_]+)$"),
                       ("tag:yaml.org,2002:float",
                        r"^[-+]?(?:[0-9][0-9_]*)?\.[0-9_]*(?:[eE][-+]?[0-9]+)?$|^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"
                        r"|^[-+]?\.(?:inf|Inf|INF)$|^\.(?:nan|NaN|NAN)$")):
    _Loader.add_implicit_resolver(_tag, re.compile(_pattern), list("-+0123456789."))


def _no_duplicate_keys(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    """A key given twice in one mapping is an error: YAML would silently keep the last one."""
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key '{key}' is given twice (lines {seen[key]} and {key_node.start_mark.line + 1}); "
                            f"keep one", key_node.start_mark)
        seen[key] = key_node.start_mark.line + 1
    return yaml.SafeLoader.construct_mapping(loader, node, deep=deep)


_Loader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _no_duplicate_keys)


def _yaml(text: str) -> Any:
    return yaml.load(text, Loader=_Loader)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """`key=value` pairs from the command line; values are parsed as YAML (numbers, booleans, lists)."""
    overrides: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override '{item}' is not key=value, e.g. learning_rate=1e-4")
        try:
            overrides[key.strip()] = _yaml(raw) if raw != "" else None
        except yaml.YAMLError:
            overrides[key.strip()] = raw
    return overrides


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = _yaml(path.read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path} is not valid YAML: {exc}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path} must hold a mapping of key: value, not a {type(data).__name__}")
    return data

