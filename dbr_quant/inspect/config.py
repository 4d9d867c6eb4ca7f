"""The inspect YAML config: sections that select layers and enable features on them.

Schema (modelled on Transformer Engine's debug config)::

    <section name>:                # any name; sections apply in file order
      enabled: true                # optional, default true
      layers:                      # all given selectors must match
        name_regex: "encoder\\.layer\\.0\\..*"   # re.search on the layer fqn
        module_type: Linear        # class name of the layer's module (or a base class's name)
        kind: linear               # linear / matmul / sdpa
      features:
        LogTensorStats: {tensors: [input, output], stats: [amax, std], freq: 1, start_step: 0}
        DisableFP8: {}

A layer takes each feature from the first section that enables it for that layer. Every problem
(YAML syntax, unknown key or feature, bad regex, wrong parameter, a selection that matches no recorded
quantized layer) raises :class:`InspectConfigError` naming the file and line.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml

from dbr_quant.inspect.features import FEATURES, Feature, LayerInfo


class InspectConfigError(ValueError):
    """A problem in an inspect config; ``line`` is 1-based (None when unknown)."""

    def __init__(self, message: str, line: int | None = None, source: str = "<config>") -> None:
        self.line, self.source = line, source
        where = f"{source}, line {line}: " if line is not None else f"{source}: "
        super().__init__(where + message)


@dataclass(frozen=True)
class Selector:
    name_regex: str | None = None
    module_type: str | None = None
    kind: str | None = None

    def matches(self, layer: LayerInfo, module_types: tuple[str, ...]) -> bool:
        if self.name_regex is not None and re.search(self.name_regex, layer.name) is None:
            return False
        if self.module_type is not None and self.module_type not in module_types:
            return False
        return self.kind is None or self.kind == layer.kind


@dataclass(frozen=True)
class Section:
    name: str
    line: int
    selector: Selector
    features: tuple[Feature, ...]
    selector_line: int | None = None  # where the layers' selection is written (for "matches nothing")


@dataclass(frozen=True)
class InspectConfig:
    sections: tuple[Section, ...]
    source: str = "<config>"

    def plan(self, layers: Mapping[str, Any]) -> dict[str, tuple[Feature, ...]]:
        """Features per layer name; ``layers`` from :func:`~dbr_quant.inspect.recorded_layers`."""
        plan: dict[str, list[Feature]] = {name: [] for name in layers}
        for sec in self.sections:
            hit = [n for n, r in layers.items() if sec.selector.matches(r.info, r.module_types)]
            if not hit:
                raise InspectConfigError(
                    f"section {sec.name!r} selects no recorded quantized layer ({sec.selector}); recorded: "
                    f"{_short(list(layers))}", sec.selector_line or sec.line, self.source)
            for n in hit:
                have = {type(f) for f in plan[n]}
                new = [f for f in sec.features if type(f) not in have]
                self._check_settings(sec, layers[n].info, new)
                plan[n].extend(new)
        return {n: tuple(fs) for n, fs in plan.items() if fs}

    def _check_settings(self, sec: Section, layer: LayerInfo, features: list[Feature]) -> None:
        """A linear's input / weight settings (``tensor_config``) that no GEMM of this layer computes (e.g. Scaling
        of a weight-only layer's input) fail here, at the section's line, before anything runs."""
        if layer.kind != "linear":
            return
        for f in features:
            for tensor, base in (("input", layer.qconfig.activation), ("weight", layer.qconfig.weight)):
                try:
                    f.tensor_config(layer, tensor, base)
                except ValueError as e:
                    raise InspectConfigError(f"section {sec.name!r}: {e}", sec.line, self.source) from None


def _short(names: list[str], k: int = 8) -> str:
    return ", ".join(names[:k]) + (f", … ({len(names)} in all)" if len(names) > k else "")


# ---------------------------------------------------------------------------------------- loading
def load_config(config: str | os.PathLike | InspectConfig) -> InspectConfig:
    """Parse a YAML file path or YAML text (a string with a newline or a ':' is taken as text)."""
    if isinstance(config, InspectConfig):
        return config
    if isinstance(config, os.PathLike) or ("\n" not in config and ":" not in config):
        source = os.fspath(config)
        with open(source, encoding="utf-8") as f:
            text = f.read()
    else:
        source, text = "<config>", config
    return parse_config(text, source)


def parse_config(text: str, source: str = "<config>") -> InspectConfig:
    try:
        loader = yaml.SafeLoader(text)
        try:
            root = loader.get_single_node()
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        mark = e.problem_mark or e.context_mark
        raise InspectConfigError(f"invalid YAML: {e.problem or e}", mark.line + 1 if mark else None, source) from None
    p = _Parser(loader, source)
    if root is None:
        raise InspectConfigError("the config is empty", None, source)
    sections = tuple(p.section(k, v) for k, v in p.mapping(root, "the config").items())
    return InspectConfig(sections, source)


class _Parser:
    def __init__(self, loader: yaml.SafeLoader, source: str) -> None:
        self.loader, self.source = loader, source

    def error(self, msg: str, node: yaml.Node) -> InspectConfigError:
        return InspectConfigError(msg, node.start_mark.line + 1, self.source)

    def mapping(self, node: yaml.Node, what: str) -> dict[str, tuple[yaml.Node, yaml.Node]]:
        """key → (key node, value node), rejecting non-mappings and duplicate keys."""
        if not isinstance(node, yaml.MappingNode):
            raise self.error(f"{what} must be a mapping (key: value)", node)
        out: dict[str, tuple[yaml.Node, yaml.Node]] = {}
        for k, v in node.value:
            key = self.value(k)
            if not isinstance(key, str):
                raise self.error(f"keys in {what} must be strings, got {key!r}", k)
            if key in out:
                raise self.error(f"duplicate key {key!r} in {what}", k)
            out[key] = (k, v)
        return out

    def value(self, node: yaml.Node) -> Any:
        if isinstance(node, yaml.ScalarNode):
            return self.loader.construct_object(node, deep=True)
        if isinstance(node, yaml.SequenceNode):
            return [self.value(n) for n in node.value]
        return {k: self.value(v) for k, (_, v) in self.mapping(node, "a mapping").items()}

    def section(self, name: str, nodes: tuple[yaml.Node, yaml.Node]) -> Section:
        key_node, node = nodes
        entries = self.mapping(node, f"section {name!r}")
        self.unknown(entries, ("enabled", "layers", "features"), f"section {name!r}")
        if "layers" not in entries:
            raise self.error(f"section {name!r} needs 'layers:' (name_regex / module_type / kind)", key_node)
        if "features" not in entries:
            raise self.error(f"section {name!r} needs 'features:'", key_node)
        selector = self.selector(entries["layers"][1], name)
        features = tuple(f for fname, fn in self.mapping(entries["features"][1], "features").items()
                         if (f := self.feature(fname, fn)) is not None)
        if "enabled" in entries and self.typed(entries["enabled"][1], bool, "enabled") is False:
            features = ()
        layers_node = entries["layers"][1]
        sel_node = self.mapping(layers_node, "'layers'").get("name_regex", (None, layers_node))[1]
        return Section(name, key_node.start_mark.line + 1, selector, features, sel_node.start_mark.line + 1)

    def unknown(self, entries: dict, allowed: tuple[str, ...], what: str) -> None:
        for key, (k, _) in entries.items():
            if key not in allowed:
                hint = difflib.get_close_matches(key, allowed, 1)
                raise self.error(f"unknown key {key!r} in {what}" + (f" (did you mean {hint[0]!r}?)" if hint
                                 else f"; allowed: {list(allowed)}"), k)

    def selector(self, node: yaml.Node, section: str) -> Selector:
        entries = self.mapping(node, f"'layers' of section {section!r}")
        self.unknown(entries, ("name_regex", "module_type", "kind"), "'layers'")
        if not entries:
            raise self.error("'layers' needs name_regex, module_type or kind", node)
        vals = {k: self.typed(v, str, k) for k, (_, v) in entries.items()}
        if "name_regex" in vals:
            try:
                re.compile(vals["name_regex"])
            except re.error as e:
                raise self.error(f"name_regex {vals['name_regex']!r} is not a valid regex: {e}",
                                 entries["name_regex"][1]) from None
        if vals.get("kind") not in (None, "linear", "matmul", "sdpa", "experts"):
            raise self.error(f"kind must be linear, matmul, sdpa or experts, not {vals['kind']!r}",
                             entries["kind"][1])
        return Selector(**vals)

    def typed(self, node: yaml.Node, tp: Any, what: str) -> Any:
        value = self.value(node)
        ok, converted = _coerce(value, tp)
        if not ok:
            raise self.error(f"{what} must be {_type_name(tp)}, got {value!r}", node)
        return converted

    def feature(self, name: str, nodes: tuple[yaml.Node, yaml.Node]) -> Feature | None:
        key_node, node = nodes
        cls = FEATURES.get(name)
        if cls is None:
            hint = difflib.get_close_matches(name, list(FEATURES), 1)
            raise self.error(f"unknown feature {name!r}" + (f" (did you mean {hint[0]!r}?)" if hint else "")
                             + f"; registered: {sorted(FEATURES)}", key_node)
        is_null = isinstance(node, yaml.ScalarNode) and self.value(node) is None
        entries = {} if is_null else self.mapping(node, f"parameters of {name}")
        # register_feature made every registered class a dataclass; Feature itself is not one
        fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
        hints = typing.get_type_hints(cls)
        self.unknown(entries, tuple(fields) + ("enabled",), f"parameters of {name}")
        params = {k: self.typed(v, hints[k], f"{name}.{k}") for k, (_, v) in entries.items() if k != "enabled"}
        if "enabled" in entries and self.typed(entries["enabled"][1], bool, f"{name}.enabled") is False:
            return None
        try:
            return cls(**params)
        except (TypeError, ValueError) as e:
            raise self.error(f"bad parameters for {name}: {e}", key_node) from None


def _coerce(value: Any, tp: Any) -> tuple[bool, Any]:
    """Check a YAML value against a (simple) annotation; YAML lists become tuples."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return True, value
    if origin in (typing.Union, types.UnionType):
        for arm in typing.get_args(tp):
            ok, v = _coerce(value, arm)
            if ok:
                return True, v
        return False, value
    if tp is type(None):
        return value is None, value
    if origin in (tuple, list):
        args = typing.get_args(tp)
        if not isinstance(value, list):
            return False, value
        inner = args[0] if args else Any
        items = [_coerce(v, inner) for v in value]
        return all(ok for ok, _ in items), tuple(v for _, v in items)
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e9 (no dot) as a string
            try:
                return True, float(value)
            except ValueError:
                return False, value
        return isinstance(value, (int, float)) and not isinstance(value, bool), float(value) if isinstance(
            value, (int, float)) else value
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool), value
    if isinstance(tp, type):
        return isinstance(value, tp), value
    return True, value


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")
